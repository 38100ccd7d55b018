"""vLLM's server flags for the OpenAI routes, and tool calls vLLM takes, against one server started with them:
--max-logprobs -1 (whole-vocabulary logprobs), --return-tokens-as-token-ids, --enable-force-include-usage,
--enable-prompt-tokens-details, --enable-tokenizer-info-endpoint, --root-path, --trust-request-chat-template."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest

from shardserve.launch.demo import DEMO_MODEL_DIR
from tests.launch.conftest import API_KEY, AUTH, MODEL, http, post, serving, stream_chunks

pytestmark = pytest.mark.slow  # every test here starts a process

HI = [{"role": "user", "content": "hi"}]
LONG = "The quick brown fox jumps over the lazy dog. " * 6
VOCAB = 4096  # the demo model's
# a chat template that renders tools and any role
TEMPLATE = ("{%- if tools %}<|system|>\nTools: {{ tools | tojson }}{{ eos_token }}{% endif %}"
            "{%- for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}{% endfor %}"
            "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}")
CITY = {"enum": ["Paris", "Oslo", "Lima"]}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"], "$defs": {"City": CITY},
           "properties": {"city": {"$ref": "#/$defs/City"}}}
TRIP = {"type": "object", "additionalProperties": False, "required": ["to", "days"], "$defs": {"City": CITY},
        "properties": {"to": {"$ref": "#/$defs/City"}, "days": {"type": "integer", "minimum": 1, "maximum": 9}}}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "trip", "parameters": TRIP}}]
SCHEMAS = {"weather": WEATHER, "trip": TRIP}
NAMED = {"type": "function", "function": {"name": "weather"}}


@pytest.fixture(scope="module")
def server():
    yield from serving("--profile", "demo", "--api-key", API_KEY, "--max-logprobs", "-1", "--return-tokens-as-token-ids",
                       "--enable-force-include-usage", "--enable-prompt-tokens-details",
                       "--enable-tokenizer-info-endpoint", "--root-path", "/llm", "--trust-request-chat-template")


def complete(server: str, **fields) -> tuple[int, dict]:
    return post(server, "/v1/completions", {"model": MODEL, "prompt": "A list is", "max_tokens": 2} | fields)


def chat(server: str, **fields) -> tuple[int, dict]:
    return post(server, "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 4,
                                                 "chat_template": TEMPLATE} | fields)


def refused(reply: tuple[int, dict], param: str, *words: str) -> bool:
    code, data = reply
    return code == 400 and data["error"]["param"] == param and all(w in data["error"]["message"] for w in words)


def test_minus_one_is_the_whole_vocabulary(server):
    code, data = complete(server, logprobs=-1, prompt_logprobs=-1)
    choice = data["choices"][0]
    tops = choice["logprobs"]["top_logprobs"]
    assert code == 200 and [len(top) for top in tops] == [VOCAB, VOCAB]  # keys "token_id:N": one per token
    assert all(math.fsum(math.exp(lp) for lp in top.values()) == pytest.approx(1.0, abs=1e-3) for top in tops)
    assert [len(entry) for entry in choice["prompt_logprobs"][1:]] == [VOCAB] * (data["usage"]["prompt_tokens"] - 1)
    code, data = chat(server, logprobs=True, top_logprobs=-1, return_tokens_as_token_ids=False)
    content = data["choices"][0]["logprobs"]["content"]
    assert code == 200 and all(len(e["top_logprobs"]) == VOCAB for e in content)
    assert not content[0]["token"].startswith("token_id:")  # the request's false over the server's default
    assert complete(server, logprobs=2)[1]["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")
    assert refused(complete(server, logprobs=VOCAB + 1), "logprobs", str(VOCAB))


def test_forced_usage_and_cached_prompt_tokens(server):
    chunks = stream_chunks(server, "/v1/completions", {"model": MODEL, "prompt": "A list", "max_tokens": 2})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2  # as if include_usage
    first = complete(server, prompt=LONG)[1]["usage"]
    again = complete(server, prompt=LONG)[1]["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0} and first["prompt_tokens"] == again["prompt_tokens"]
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < again["prompt_tokens"] and cached % 16 == 0  # whole blocks of the prefix cache
    usage = stream_chunks(server, "/v1/completions", {"model": MODEL, "prompt": LONG, "max_tokens": 2})[-1]["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": cached}
    messages = [{"role": "user", "content": LONG}]
    chat(server, messages=messages)
    usage = stream_chunks(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2,
                                                           "chat_template": TEMPLATE})[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_tokenizer_info_and_root_path(server):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    status, text = http(f"{server}/tokenizer_info", headers=AUTH)
    info = json.loads(text)
    assert status == 200 and info["chat_template"] == tokenizer.chat_template
    assert info["tokenizer_class"] == type(tokenizer).__name__ and info["eos_token"] == tokenizer.eos_token
    assert json.loads(http(f"{server}/openapi.json")[1])["servers"] == [{"url": "/llm"}]
    for path in ("/v1/models", "/llm/v1/models"):  # behind a proxy that strips the prefix, or one that keeps it
        assert http(f"{server}{path}", headers=AUTH)[0] == 200 and http(f"{server}{path}")[0] == 401


def test_required_and_named_calls_with_shared_definitions(server):
    for seed in range(3):
        code, data = chat(server, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=1.0, seed=seed,
                          parallel_tool_calls=False)
        choice = data["choices"][0]
        assert code == 200 and choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == ""
        for call in choice["message"]["tool_calls"]:
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    code, data = chat(server, tools=TOOLS, tool_choice=NAMED, max_tokens=40, temperature=0)
    choice = data["choices"][0]
    assert code == 200 and choice["finish_reason"] == "stop" and choice["message"]["content"] == ""
    jsonschema.validate(json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]), WEATHER)
    full = choice["message"]["tool_calls"][0]["function"]["arguments"]
    code, data = chat(server, tools=TOOLS, tool_choice=NAMED, max_tokens=2, temperature=0)
    cut = data["choices"][0]
    assert cut["finish_reason"] == "length" and full.startswith(cut["message"]["tool_calls"][0]["function"]["arguments"])
    chunks = stream_chunks(server, "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 40,
                                                            "temperature": 0, "tools": TOOLS, "tool_choice": NAMED,
                                                            "chat_template": TEMPLATE})
    (delta,) = [c["choices"][0] for c in chunks if c["choices"]]
    assert delta["finish_reason"] == "stop" and delta["delta"]["tool_calls"][0]["function"]["arguments"] == full


def test_tool_requests_vllm_refuses(server):
    assert refused(chat(server, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
                   "tool_choice", "'nope'")
    assert refused(chat(server, tool_choice="required"), "tool_choice", "needs tools")
    assert refused(chat(server, tool_choice=NAMED), "tool_choice", "needs tools")
    assert chat(server, tool_choice="none")[0] == 200
    assert refused(chat(server, tools=TOOLS, tool_choice=NAMED, structured_outputs={"regex": "a"}), "tool_choice")
    # vLLM lets a required call's grammar replace response_format's; here neither is dropped without a word
    assert refused(chat(server, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
                   "tool_choice", "response_format")
    other = [TOOLS[0], {"type": "function", "function": {"name": "trip", "parameters": {
        "type": "object", "$defs": {"City": {"type": "string"}}, "properties": {"to": {"$ref": "#/$defs/City"}}}}}]
    assert refused(chat(server, tools=other, tool_choice="required"), "tools", "$defs.City")


def test_custom_roles_and_tokenize_with_tools(server):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    messages = [{"role": "narrator", "content": "Once"}]
    code, data = chat(server, messages=messages, add_generation_prompt=False)
    assert code == 200 and data["choices"][0]["message"]["role"] == "narrator"  # the last message's, as vLLM
    code, data = post(server, "/tokenize", {"model": MODEL, "messages": messages, "tools": TOOLS,
                                            "chat_template": TEMPLATE, "return_token_strs": True})
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, chat_template=TEMPLATE, tokenize=False,
                                         add_generation_prompt=True)
    assert code == 200 and data["tokens"] == tokenizer(text, add_special_tokens=False).input_ids
    assert "narr" in "".join(data["token_strs"]) and "Tools" in text
