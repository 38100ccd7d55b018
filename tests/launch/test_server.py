"""The OpenAI-compatible server, driven by the openai client against a real `shardserve launch`."""

import asyncio
import json
import re
import time

import openai
import pytest

from tests.launch.conftest import API_KEY, AUTH, MODEL, http, metric, post

pytestmark = pytest.mark.slow  # every test here starts a process


def test_health_version_models(server, client):
    assert http(f"{server}/health")[0] == 200
    assert json.loads(http(f"{server}/version")[1])["version"]
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_completion_and_usage(client):
    r = client.completions.create(model=MODEL, prompt="The function returns", max_tokens=12,
                                  temperature=0, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert r.usage.completion_tokens == 12
    from transformers import AutoTokenizer
    from shardserve.launch.demo import DEMO_MODEL_DIR
    prompt_ids = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)("The function returns").input_ids
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.total_tokens == len(prompt_ids) + 12


def test_streamed_text_equals_non_streamed(client):
    kwargs = dict(model=MODEL, prompt="A list is", max_tokens=20, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_chat_streamed_equals_non_streamed(client):
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": [{"type": "text", "text": "What is a tuple?"}]}]
    full = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          max_completion_tokens=24)
    text = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant" and text
    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                            max_completion_tokens=24, stream=True)
    deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(deltas) == text


def test_prompt_forms_and_n(client):
    r = client.completions.create(model=MODEL, prompt=["one", "two"], max_tokens=3, n=2,
                                  temperature=1.0, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2, temperature=0)
    assert ids.usage.prompt_tokens == 3
    lists = client.completions.create(model=MODEL, prompt=[[5, 6], [7, 8, 9]], max_tokens=2,
                                      temperature=0)
    assert len(lists.choices) == 2 and lists.usage.prompt_tokens == 5


def test_seed_reproducible_and_sampling_fields(client):
    kwargs = dict(model=MODEL, prompt="Python", max_tokens=16, temperature=1.0, top_p=0.9,
                  seed=1234, extra_body={"top_k": 50, "min_p": 0.05,
                                         "repetition_penalty": 1.1})
    a = client.completions.create(**kwargs).choices[0].text
    b = client.completions.create(**kwargs).choices[0].text
    assert a == b


def test_penalties_change_the_output(client):
    kwargs = dict(model=MODEL, prompt="The the the", max_tokens=24, temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text
    presence = client.completions.create(**kwargs, presence_penalty=2.0).choices[0].text
    frequency = client.completions.create(**kwargs, frequency_penalty=2.0).choices[0].text
    assert presence != plain and frequency != plain
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=24,
        temperature=0, presence_penalty=2.0).choices[0].message.content
    assert chat


def test_stop_and_echo(client):
    base = client.completions.create(model=MODEL, prompt="The", max_tokens=16,
                                     temperature=0).choices[0].text
    word = base.split()[1] if len(base.split()) > 1 else base.strip()[:2]
    stopped = client.completions.create(model=MODEL, prompt="The", max_tokens=16,
                                        temperature=0, stop=[word]).choices[0]
    assert stopped.finish_reason == "stop" and word not in stopped.text
    echoed = client.completions.create(model=MODEL, prompt="The", max_tokens=4,
                                       temperature=0, echo=True).choices[0].text
    assert echoed.startswith("The")


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="A", max_tokens=4, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and chosen == pytest.approx(max(top.values()))  # greedy
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                          "content": "hi"}], max_tokens=3, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_min_tokens_and_ignore_eos(client):
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=30, temperature=0,
                                  extra_body={"min_tokens": 30, "ignore_eos": True})
    assert r.usage.completion_tokens == 30


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 5000}, 400,
     "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": 9}, 400,
     "temperature"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [999999]}, 400, "prompt"),
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages.0.content.0"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
                                                            "content": "hi"}],
                              "max_completion_tokens": 2000}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
                                                            "content": "hi " * 3000}]},
     400, "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "min_tokens": 5},
     400, "min_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stop": [""]}, 400, "stop"),
])
def test_bad_input_is_openai_shaped_and_server_stays_healthy(server, path, body, status,
                                                             param):
    code, data = post(server, path, body)
    assert code == status
    assert set(data["error"]) == {"message", "type", "param", "code"}
    assert data["error"]["param"] == param and data["error"]["message"]
    assert http(f"{server}/health")[0] == 200


def test_malformed_json(server):
    status, text = http(f"{server}/v1/completions", None, AUTH)  # GET: wrong method
    assert status == 405 and json.loads(text)["error"]["code"] == 405
    status, text = http(f"{server}/v1/nothing-here", None, AUTH)
    assert status == 404 and json.loads(text)["error"]["message"] == "Not Found"
    import urllib.request
    request = urllib.request.Request(f"{server}/v1/completions", data=b"not json",
                                     headers={"content-type": "application/json", **AUTH})
    try:
        urllib.request.urlopen(request, timeout=10)
    except urllib.error.HTTPError as e:
        body = json.loads(e.read())
        assert e.code == 400 and body["error"]["message"] == "the request body is not valid JSON"
    else:
        raise AssertionError("malformed JSON was accepted")


def test_stop_string_streaming_sends_no_empty_chunks(client):
    base = client.completions.create(model=MODEL, prompt="The function returns",
                                     max_tokens=24, temperature=0).choices[0].text
    stop = base.strip().split()[-1]
    chunks = [c for c in client.completions.create(
        model=MODEL, prompt="The function returns", max_tokens=24, temperature=0, stop=[stop],
        stream=True) if c.choices]
    assert all(c.choices[0].text or c.choices[0].finish_reason for c in chunks)
    streamed = "".join(c.choices[0].text for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop" and stop not in streamed
    assert base.startswith(streamed)


def test_streamed_logprobs_cover_held_back_tokens(client):
    kwargs = dict(model=MODEL, prompt="The function returns", max_tokens=24, temperature=0,
                  logprobs=2)
    stop = client.completions.create(**kwargs).choices[0].text.strip().split()[-1]
    full = client.completions.create(**kwargs, stop=[stop]).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stop=[stop], stream=True)
              if c.choices]
    assert "".join(c.text for c in chunks) == full.text
    for name in ("tokens", "token_logprobs", "text_offset"):
        assert [x for c in chunks for x in getattr(c.logprobs, name)] == \
            getattr(full.logprobs, name), name


def test_fields_that_ask_for_nothing_are_accepted(server):
    code, data = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "user": "u1",
                                                  "metadata": {"a": 1}, "tools": [], "response_format": None})
    assert code == 200 and data["choices"]
    code, data = post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "response_format": {"type": "text"}, "tool_choice": "none", "store": False})
    assert code == 200 and data["choices"]


@pytest.mark.parametrize("route, field, value", [
    ("/v1/completions", "whatever", True),
])
def test_fields_the_server_cannot_honour_are_refused_by_name(server, route, field, value):
    """Never a 200 with the field silently ignored: a 400 that names it."""
    body = {"model": MODEL, "max_tokens": 2, field: value}
    body |= {"prompt": "hi"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    code, data = post(server, route, body)
    assert code == 400 and data["error"]["param"] == field and field in data["error"]["message"]


def test_auth(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    assert post(server, "/v1/completions", body, headers={})[0] == 401
    code, data = post(server, "/v1/completions", body, headers={"authorization": "Bearer no"})
    assert code == 401 and data["error"]["type"] == "authentication_error"
    assert http(f"{server}/health")[0] == 200  # health needs no key


def test_32_concurrent_streams(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)

        async def one(i):
            stream = await client.completions.create(
                model=MODEL, prompt=f"Item {i} is", max_tokens=16, temperature=0,
                stream=True, extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in stream if c.choices])

        texts = await asyncio.gather(*(one(i) for i in range(32)))
        await client.close()
        return texts

    texts = asyncio.run(main())
    assert len(texts) == 32 and all(texts)


def test_disconnect_frees_blocks(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)
        stream = await client.completions.create(
            model=MODEL, prompt="Once", max_tokens=900, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.close()
        await client.close()

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if (metric(server, "vllm:num_requests_running") == 0
                and metric(server, "vllm:kv_cache_usage_perc") == 0):
            break
        time.sleep(0.2)
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, "vllm:kv_cache_usage_perc") == 0


def test_metrics_count_requests_and_tokens(server, client):
    before = metric(server, "vllm:generation_tokens_total")
    client.completions.create(model=MODEL, prompt="hi", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    assert metric(server, "vllm:generation_tokens_total") == before + 5
    text = http(f"{server}/metrics")[1]
    for name in ("shardserve_requests_total", "vllm:prompt_tokens_total",
                 "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:num_requests_waiting", "vllm:num_preemptions_total"):
        assert name in text, name
    assert 'outcome="rejected"' in text


def test_metrics_carry_vllms_names_types_labels_and_buckets(server, client):
    """What vLLM's dashboards and routers read: the same series, label names and bucket edges."""
    series = (("vllm:request_success_total", '[^}]*finished_reason="length"[^}]*'),
              ("vllm:request_params_n_count", "[^}]*"), ("vllm:inter_token_latency_seconds_count", "[^}]*"),
              ("vllm:time_per_output_token_seconds_count", "[^}]*"))

    def counts() -> list[float]:
        text = http(f"{server}/metrics")[1]
        return [sum(float(v) for v in re.findall(rf"^{name}{{{labels}}} (\S+)$", text, re.M))
                for name, labels in series]

    before = counts()
    client.completions.create(model=MODEL, prompt="hi", max_tokens=4, n=2, temperature=0.5,
                              extra_body={"ignore_eos": True})
    assert [a - b for a, b in zip(counts(), before)] == [2, 1, 3, 3]  # both samples, 4 steps: 3 gaps
    text = http(f"{server}/metrics")[1]
    for name, kind in (("vllm:num_requests_running", "gauge"), ("vllm:kv_cache_usage_perc", "gauge"),
                       ("vllm:prompt_tokens", "counter"), ("vllm:request_success", "counter"),
                       ("vllm:prefix_cache_hits", "counter"), ("vllm:external_prefix_cache_hits", "counter"),
                       ("vllm:external_prefix_cache_queries", "counter"), ("vllm:time_to_first_token_seconds", "histogram"),
                       ("vllm:request_decode_time_seconds", "histogram"),
                       ("vllm:request_generation_tokens", "histogram")):
        assert re.search(rf"^# TYPE {name}(_total)? {kind}$", text, re.M), name
    assert re.search(r'^vllm:num_requests_running\{engine="0",model_name="[^"]+"\} ', text, re.M), text
    edges = re.findall(r'^vllm:time_to_first_token_seconds_bucket\{engine="0",le="([^"]+)"', text, re.M)
    assert edges[:4] == ["0.001", "0.005", "0.01", "0.02"] and edges[-2:] == ["2560.0", "+Inf"], edges


def test_metrics_count_the_tokens_of_every_engine_step(server, client):
    """vllm:iteration_tokens_total, as vLLM counts it: one observation per step, of the tokens it sampled and
    the whole prompt of each request it sampled a first token for."""
    names = ("vllm:iteration_tokens_total_count", "vllm:iteration_tokens_total_sum")

    def settled() -> list[float]:  # the replica's stats arrive twice a second: read until two reads agree
        now = [metric(server, name) for name in names]
        while True:
            time.sleep(0.7)
            again = [metric(server, name) for name in names]
            if again == now:
                return now
            now = again

    before = settled()
    prompt = client.completions.create(model=MODEL, prompt="Steps counted", max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True}).usage.prompt_tokens
    assert [a - b for a, b in zip(settled(), before)] == [5, prompt + 5]  # a prefill and its token, then 4 decodes
    text = http(f"{server}/metrics")[1]
    edges = re.findall(r'^vllm:iteration_tokens_total_bucket\{engine="0",le="([^"]+)"', text, re.M)
    assert edges == ["1.0", "8.0", "16.0", "32.0", "64.0", "128.0", "256.0", "512.0", "1024.0", "2048.0",
                     "4096.0", "8192.0", "16384.0", "+Inf"], edges


def test_metrics_time_the_queue_and_prefill_and_count_prefix_cache_hits(server, client):
    counts = {name: metric(server, name) for name in (
        "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
        "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")}
    prompt = "The function returns a list of the values it was given, " * 4  # several full blocks
    for _ in range(2):  # the second finds the first's blocks in the prefix cache
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, n=2, temperature=0)
    deadline = time.monotonic() + 5  # the replica's stats (prefix cache counts) arrive twice a second
    while True:
        after = {name: metric(server, name) for name in counts}
        hit = after["vllm:prefix_cache_hits_total"] - counts["vllm:prefix_cache_hits_total"]
        if hit > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert after["vllm:request_queue_time_seconds_count"] == counts[
        "vllm:request_queue_time_seconds_count"] + 4  # one per sample
    assert after["vllm:request_prefill_time_seconds_count"] == counts[
        "vllm:request_prefill_time_seconds_count"] + 4
    queried = after["vllm:prefix_cache_queries_total"] - counts["vllm:prefix_cache_queries_total"]
    assert queried > 0 and 0 < hit < queried
