"""vLLM's request fields on a server with default settings (issue 22, item 3): each is honoured, or refused
by name only where it asks for something this server cannot do; never refused for a false or default value."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from shardserve.launch.demo import DEMO_MODEL_DIR
from tests.launch.conftest import AUTH, HI, MODEL, chat, complete, http, post, refused, stream_chunks

pytestmark = pytest.mark.slow  # every test here starts a process

LONG = "The quick brown fox jumps over the lazy dog. " * 6
PET = {"type": "object", "additionalProperties": False, "required": ["kind"],
       "properties": {"kind": {"enum": ["cat", "dog"]}}}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


def test_structured_outputs_beside_response_format_and_guided_fields(server, client):
    for seed in range(3):
        text = client.completions.create(model=MODEL, prompt="Yes or no:", max_tokens=5, temperature=1.0, seed=seed,
                                         extra_body={"structured_outputs": {"choice": ["yes", "no"]}}).choices[0].text
        assert text in ("yes", "no")
    reply = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=10, temperature=1.0,
                                           extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert re.fullmatch("[0-9]{3}", reply.choices[0].message.content)
    reply = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=30, temperature=1.0, extra_body={
        "structured_outputs": {"json": PET, "disable_any_whitespace": True, "disable_fallback": False}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), PET)
    code, data = complete(server, max_tokens=20, structured_outputs={"json_object": True}, temperature=0)
    assert code == 200 and data["choices"][0]["text"].startswith("{")
    assert complete(server, structured_outputs={"json_object": False})[0] == 200  # asks for nothing
    assert refused(complete(server, structured_outputs={"choice": ["a"], "regex": "a"}), "structured_outputs.choice",
                   "ask for one", "structured_outputs.regex")
    assert refused(complete(server, structured_outputs={"choice": ["a"]}, guided_regex="a"), "structured_outputs.choice",
                   "guided_regex")
    assert refused(chat(server, structured_outputs={"regex": "a"}, response_format={"type": "json_object"}),
                   "structured_outputs.regex", "response_format")
    assert refused(complete(server, structured_outputs={"regex": "a", "bogus": 1}), "structured_outputs.bogus")
    assert refused(complete(server, structured_outputs={"structural_tag": "{}"}), "structured_outputs.structural_tag")
    assert refused(complete(server, structured_outputs={"regex": "([0-9"}), "structured_outputs.regex")


def test_chat_echo_continue_final_message_and_roles(server, tokenizer):
    messages = HI + [{"role": "assistant", "content": "A list is"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True, "temperature": 0}
    code, data = chat(server, **body, echo=True)
    assert code == 200 and data["choices"][0]["message"]["content"].startswith("A list is")
    text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.endswith("A list is") and data["usage"]["prompt_tokens"] == len(tokenizer(text, add_special_tokens=False).input_ids)
    plain = chat(server, **body)[1]["choices"][0]["message"]["content"]
    assert data["choices"][0]["message"]["content"] == "A list is" + plain
    chunks = stream_chunks(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 4, **body, "echo": True})
    contents = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert contents[1] == "A list is" and "".join(x or "" for x in contents) == data["choices"][0]["message"]["content"]
    # the reply's role is the assistant's and the last message the user's: nothing to echo (as vLLM)
    assert chat(server, echo=True, temperature=0)[1]["choices"] == chat(server, temperature=0)[1]["choices"]
    assert refused(chat(server, messages=messages, continue_final_message=True), "continue_final_message",
                   "add_generation_prompt")
    # any role reaches the chat template; the demo's own template takes three, so says no itself
    assert refused(chat(server, messages=[{"role": "narrator", "content": "x"}]), "messages", "roles are system")


def test_token_ids_and_tokens_as_ids(server, tokenizer):
    code, data = complete(server, return_token_ids=True, temperature=0, logprobs=1)
    choice = data["choices"][0]
    assert code == 200 and choice["prompt_token_ids"] == tokenizer("A list is").input_ids
    assert len(choice["token_ids"]) == data["usage"]["completion_tokens"] == 4
    assert tokenizer.decode(choice["token_ids"]) == choice["text"]
    code, as_ids = complete(server, temperature=0, logprobs=1, return_tokens_as_token_ids=True)
    assert as_ids["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert as_ids["choices"][0]["logprobs"]["text_offset"] == choice["logprobs"]["text_offset"]  # into the text
    code, data = chat(server, return_token_ids=True, temperature=0, logprobs=True, top_logprobs=2,
                      return_tokens_as_token_ids=True)
    ids = post(server, "/tokenize", {"model": MODEL, "messages": HI})[1]["tokens"]
    assert code == 200 and data["prompt_token_ids"] == ids and "prompt_token_ids" not in data["choices"][0]
    token_ids = data["choices"][0]["token_ids"]
    assert [e["token"] for e in data["choices"][0]["logprobs"]["content"]] == [f"token_id:{t}" for t in token_ids]
    assert all(top["token"].startswith("token_id:") for e in data["choices"][0]["logprobs"]["content"]
               for top in e["top_logprobs"])
    chunks = stream_chunks(server, "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 4,
                                                            "temperature": 0, "return_token_ids": True})
    assert chunks[0]["prompt_token_ids"] == ids
    assert [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]] == token_ids
    chunks = stream_chunks(server, "/v1/completions", {"model": MODEL, "prompt": "A list is", "max_tokens": 4,
                                                       "temperature": 0, "return_token_ids": True, "echo": True})
    assert chunks[0]["choices"][0]["prompt_token_ids"] == tokenizer("A list is").input_ids
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]


def test_truncate_prompt_tokens_and_beam_search(server, tokenizer):
    ids = tokenizer(LONG).input_ids
    code, data = complete(server, prompt=LONG, truncate_prompt_tokens=5, temperature=0)
    assert code == 200 and data["usage"]["prompt_tokens"] == 5
    assert data["choices"][0]["text"] == complete(server, prompt=ids[-5:], temperature=0)[1]["choices"][0]["text"]
    code, data = complete(server, prompt=ids, truncate_prompt_tokens=5, truncation_side="right", temperature=0,
                          echo=True)
    assert code == 200 and data["choices"][0]["text"].startswith(tokenizer.decode(ids[:5]))
    assert complete(server, prompt=LONG, truncate_prompt_tokens=-1)[1]["usage"]["prompt_tokens"] == len(ids)
    assert refused(complete(server, truncate_prompt_tokens=2000), "truncate_prompt_tokens", "max_model_len=1024")
    assert chat(server, messages=[{"role": "user", "content": LONG}], truncate_prompt_tokens=7)[1]["usage"] == {
        "prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}
    assert complete(server, use_beam_search=False)[0] == 200
    assert refused(chat(server, use_beam_search=True), "use_beam_search")


def test_logprobs_counts_limits_and_prompt_logprobs(server):
    code, data = complete(server, logprobs=0, temperature=0.8, seed=3)
    lp = data["choices"][0]["logprobs"]
    assert code == 200 and [list(top) for top in lp["top_logprobs"]] == [[t] for t in lp["tokens"]]
    assert [top[t] for top, t in zip(lp["top_logprobs"], lp["tokens"])] == lp["token_logprobs"]
    assert data["choices"][0]["prompt_logprobs"] is None  # present as null when not asked (vLLM's shape)
    assert refused(complete(server, logprobs=21), "logprobs", "20")
    assert refused(complete(server, logprobs=-1), "logprobs", "4096", "--max-logprobs")
    assert refused(chat(server, logprobs=True, top_logprobs=21), "top_logprobs", "20")
    assert refused(chat(server, prompt_logprobs=-1), "prompt_logprobs", "4096")
    assert refused(chat(server, top_logprobs=-1), "top_logprobs", "logprobs: true")
    assert refused(complete(server, logprobs=1, logprob_token_ids=list(range(21))), "logprob_token_ids", "20")
    code, data = chat(server)
    assert code == 200 and data["prompt_logprobs"] is None
    code, data = chat(server, prompt_logprobs=1)
    num_prompt = data["usage"]["prompt_tokens"]
    assert code == 200 and len(data["prompt_logprobs"]) == num_prompt and data["prompt_logprobs"][0] is None
    assert all(1 <= len(entry) <= 2 for entry in data["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in data["choices"][0]  # at the top, as vLLM's chat
    assert stream_chunks(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                     "prompt_logprobs": 0})
    assert refused(complete(server, stream=True, prompt_logprobs=1), "prompt_logprobs")


def test_stream_usage_options(server):
    body = {"model": MODEL, "prompt": "A list is", "max_tokens": 5, "temperature": 0}
    assert refused(complete(server, stream_options={"include_usage": True}), "stream_options", "stream")
    assert complete(server, stream_options=None)[0] == 200
    chunks = stream_chunks(server, "/v1/completions", body | {
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    usages = [c["usage"] for c in chunks]
    assert all(u["prompt_tokens"] == usages[-1]["prompt_tokens"] for u in usages) and chunks[-1]["choices"] == []
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[-1] == usages[-2]["completion_tokens"] == 5
    chat_chunks = stream_chunks(server, "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 3,
                                "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert chat_chunks[0]["usage"]["completion_tokens"] == 0 and all("usage" in c for c in chat_chunks)
    # continuous_usage_stats rides on include_usage, as on vLLM; and no usage unless asked
    for options in ({"continuous_usage_stats": True}, None):
        chunks = stream_chunks(server, "/v1/completions", body | ({"stream_options": options} if options else {}))
        assert not any("usage" in c for c in chunks)


def test_tokenize_fields(server, tokenizer):
    messages = HI + [{"role": "assistant", "content": "A list"}]
    code, data = post(server, "/tokenize", {"model": MODEL, "messages": messages, "add_generation_prompt": False,
                                            "continue_final_message": True, "return_token_strs": True})
    text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert code == 200 and data["tokens"] == tokenizer(text, add_special_tokens=False).input_ids
    assert data["token_strs"] == tokenizer.convert_ids_to_tokens(data["tokens"])
    code, data = post(server, "/tokenize", {"model": MODEL, "messages": HI, "add_special_tokens": True})
    text = tokenizer.apply_chat_template(HI, tokenize=False, add_generation_prompt=True)
    assert code == 200 and data["tokens"] == tokenizer(text).input_ids  # the template's BOS, then the tokenizer's
    code, data = post(server, "/tokenize", {"model": MODEL, "prompt": "A list", "return_token_strs": True})
    assert data["token_strs"] == tokenizer.convert_ids_to_tokens(tokenizer("A list").input_ids)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert refused(post(server, "/tokenize", {"model": MODEL, "messages": HI, "tools": tools}), "tools",
                   "does not render tools")
    assert refused(post(server, "/tokenize", {"model": MODEL, "messages": messages, "continue_final_message": True}),
                   "continue_final_message")


def test_models_ping_invocations_and_no_tokenizer_info(server):
    status, text = http(f"{server}/v1/models", headers=AUTH)
    (card,) = json.loads(text)["data"]
    assert status == 200 and card["root"] == MODEL and card["parent"] is None  # (vLLM's is the model's path)
    assert str(DEMO_MODEL_DIR) not in text
    assert card["max_model_len"] == 1024 and card["permission"][0]["allow_logprobs"] is True
    assert http(f"{server}/ping")[0] == 200 and http(f"{server}/ping", {})[0] == 200
    code, data = post(server, "/invocations", {"model": MODEL, "messages": HI, "max_tokens": 2, "temperature": 0})
    assert code == 200 and data["object"] == "chat.completion"
    assert data["choices"] == chat(server, max_tokens=2, temperature=0)[1]["choices"]
    code, data = post(server, "/invocations", {"model": MODEL, "prompt": "A list is", "max_tokens": 2})
    assert code == 200 and data["object"] == "text_completion"
    events = http(f"{server}/invocations", {"prompt": "x", "max_tokens": 2, "stream": True}, AUTH)[1]
    assert events.rstrip().endswith("data: [DONE]")
    assert refused(post(server, "/invocations", {"model": MODEL, "input": "x"}), "messages", "prompt")
    assert refused(post(server, "/invocations", {"model": MODEL, "prompt": "x", "max_tokens": -1}), "max_tokens")
    assert post(server, "/invocations", {"prompt": "x"}, headers={})[0] == 401
    assert http(f"{server}/tokenizer_info", headers=AUTH)[0] == 404  # only with --enable-tokenizer-info-endpoint
