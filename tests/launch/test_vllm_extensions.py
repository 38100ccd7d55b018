"""vLLM's OpenAI extensions as vLLM's own entrypoint tests use them (issue 43, item 3): each served as vLLM
defines it, or refused with a 400 that says why."""

from __future__ import annotations

import json
import logging
import time

import jsonschema
import pytest

from shardserve.launch.anthropic.request import output_format
from shardserve.launch.demo import DEMO_MODEL_DIR
from shardserve.launch.openai_api.protocol import ChatCompletionRequest
from shardserve.launch.server.api_error import APIError
from tests.launch.conftest import (API_KEY, HI, MODEL, chat, complete, http, metric, open_request, post, refused,
                                   serving, stream_chunks)

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["a"], "properties": {"a": {"enum": [1, 2]}}}


@pytest.fixture(scope="module")
def server():
    yield from serving("--profile", "demo", "--api-key", API_KEY, "--enable-force-include-usage")


@pytest.mark.slow
def test_completion_top_logprobs_lead_with_the_token_itself(server):
    """vLLM's test_return_tokens_as_ids: each position's top_logprobs starts with its own token."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    code, data = complete(server, prompt="Say 'Hello, world!'", echo=True, temperature=0, max_tokens=6, logprobs=1,
                          return_tokens_as_token_ids=True)
    choice = data["choices"][0]
    tokens, tops = choice["logprobs"]["tokens"], choice["logprobs"]["top_logprobs"]
    assert code == 200 and tokens[1:] == [next(iter(top)) for top in tops[1:]]
    ids = [int(token.removeprefix("token_id:")) for token in tokens]
    assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=True)
    code, data = complete(server, temperature=1.5, seed=3, logprobs=1, max_tokens=6)
    lp = data["choices"][0]["logprobs"]
    assert all(next(iter(top)) == token and 1 <= len(top) <= 2 for token, top in zip(lp["tokens"], lp["top_logprobs"]))


@pytest.mark.slow
def test_allowed_token_ids_restrict_the_sample_as_vllm_does(server):
    """vLLM's allowed_token_ids: every sampled token among them, greedy or not; empty or out of the vocabulary
    is refused in vLLM's words."""
    for fields in ({"temperature": 0}, {"temperature": 1.5, "seed": 7}):
        code, data = complete(server, allowed_token_ids=[5, 6, 70], max_tokens=8, return_token_ids=True,
                              ignore_eos=True, **fields)
        assert code == 200 and set(data["choices"][0]["token_ids"]) <= {5, 6, 70}, data
    code, data = chat(server, allowed_token_ids=[9], max_tokens=3, return_token_ids=True, ignore_eos=True)
    assert code == 200 and data["choices"][0]["token_ids"] == [9, 9, 9]
    assert refused(complete(server, allowed_token_ids=[]), "allowed_token_ids", "not allowed to be empty")
    assert refused(complete(server, allowed_token_ids=[10**6]), "allowed_token_ids", "out-of-vocab")


@pytest.mark.slow
def test_logprob_token_ids_give_those_ids_logprobs_at_each_position(server):
    """vLLM's logprob_token_ids: each position's top_logprobs are the listed ids' (in their order), scored in the
    whole distribution: the greedy token's entry is its own logprob; checked in vLLM's words."""
    code, data = chat(server, temperature=0, max_tokens=3, return_token_ids=True)
    first = data["choices"][0]["token_ids"][0]  # greedy: the most likely token at position 0
    listed = [5, first, 7]
    code, data = chat(server, logprobs=True, logprob_token_ids=listed, temperature=0, max_tokens=3,
                      return_tokens_as_token_ids=True)
    content = data["choices"][0]["logprobs"]["content"]
    names = [f"token_id:{i}" for i in listed]
    for position in content:  # the listed ids in their order, and the sampled token where it is not one of them
        shown = [e["token"] for e in position["top_logprobs"]]
        assert [t for t in shown if t in names] == names and set(shown) - set(names) <= {position["token"]}
    assert code == 200 and content[0]["token"] == f"token_id:{first}"
    assert abs(content[0]["top_logprobs"][1]["logprob"] - content[0]["logprob"]) < 1e-6
    assert content[0]["top_logprobs"][1]["logprob"] > max(content[0]["top_logprobs"][0]["logprob"],
                                                          content[0]["top_logprobs"][2]["logprob"])
    assert refused(complete(server, logprob_token_ids=[]), "logprob_token_ids", "must not be an empty list")
    assert refused(chat(server, logprob_token_ids=[5]), "logprob_token_ids", "`logprobs` must be set")
    assert refused(complete(server, logprobs=1, logprob_token_ids=[10**6]), "logprob_token_ids", "[0,")


@pytest.mark.slow
def test_prompt_and_seed_errors_in_vllms_words(server):
    for fields in ({"prompt": ""}, {"prompt": None, "prompt_embeds": []}):
        assert refused(complete(server, **fields), "prompt", "Either prompt or prompt_embeds must be provided and "
                       "non-empty.")
    assert refused(complete(server, prompt=[999999]), "prompt", "out of vocabulary")
    for seed in (2**63 - 1, -(2**63)):
        assert complete(server, seed=seed)[0] == 200 and chat(server, seed=seed)[0] == 200
    assert refused(chat(server, seed=2**63), "seed", "less than or equal to 9223372036854775807")
    assert refused(complete(server, seed=-(2**63) - 1), "seed", "greater than or equal to -9223372036854775808")
    assert refused(chat(server, use_beam_search=True), "use_beam_search", "samples")


@pytest.mark.slow
def test_forced_usage_rides_on_every_chunk(server):
    """vLLM's test_enable_force_include_usage: usage on each chunk, counts rising, the last chunk usage alone."""
    chunks = stream_chunks(server, "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 5,
                                                            "min_tokens": 5, "temperature": 0})
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in chunks)
    assert counts[0] == 0 and counts[1:-1] == list(range(1, 6)) and counts[-1] == 5 and chunks[-1]["choices"] == []


@pytest.mark.slow
def test_an_abort_counts_its_prompt_and_its_reason(server):
    """vLLM's test_abort_metrics_reset, and the counters vLLM keeps for an aborted request."""
    success, prompt_tokens = metric(server, "vllm:request_success_total"), metric(server, "vllm:prompt_tokens_total")
    sock = open_request(server, "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7, 8, 9], "max_tokens": 1000,
                                                    "ignore_eos": True}, API_KEY)
    deadline = time.monotonic() + 30
    while metric(server, "vllm:num_requests_running") == 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    sock.close()
    while metric(server, "vllm:num_requests_running") or metric(server, "vllm:kv_cache_usage_perc"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert metric(server, "vllm:request_success_total") == success + 1
    assert metric(server, "vllm:prompt_tokens_total") == prompt_tokens + 5
    assert 'finished_reason="abort"' in http(f"{server}/metrics")[1]  # vLLM's label for it
    before = metric(server, "vllm:request_inference_time_seconds_count")
    complete(server)
    assert metric(server, "vllm:request_inference_time_seconds_count") == before + 1


@pytest.mark.slow
def test_anthropic_output_config(server):
    body = {"model": MODEL, "max_tokens": 30, "messages": HI, "temperature": 1}
    code, data = post(server, "/v1/messages", body | {"output_config": {"format": {"type": "json_schema",
                                                                                   "schema": SCHEMA}}})
    assert code == 200 and data["stop_reason"] == "end_turn"
    jsonschema.validate(json.loads(data["content"][0]["text"]), SCHEMA)
    code, data = post(server, "/v1/messages", body | {"output_config": {"effort": "low"}})
    assert code == 400 and "output_config.effort" in data["error"]["message"]


def test_output_config_translation():
    assert output_format({"format": {"type": "json_schema", "schema": SCHEMA}}) == {
        "type": "json_schema", "json_schema": {"name": "output", "schema": SCHEMA}}
    assert output_format(None) is None and output_format({"effort": None}) is None
    for config, field in (({"format": {"type": "text"}}, "output_config.format"),
                          ({"format": {"schema": 1}}, "output_config.format.schema"), ({"bogus": 1}, "output_config.bogus")):
        with pytest.raises(APIError) as error:
            output_format(config)
        assert error.value.body()["error"]["param"] == field


def test_extra_fields_in_a_message_are_accepted_and_logged(caplog):
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi", "weight": 1,
                                                               "refusal": None}]})
    with caplog.at_level(logging.WARNING, logger="shardserve.launch.serving"):
        assert body.conversation() == [{"role": "user", "content": "hi"}]
    assert "messages.0: ignored the fields weight" in caplog.text and "refusal" not in caplog.text
