"""Anthropic's Messages API (POST /v1/messages) through the anthropic SDK against a real server: the same text,
stop, tool calls and reasoning as chat completions gives for the same greedy request, whole or streamed; what
the server cannot honour is refused by name, every error in Anthropic's shape; x-api-key is taken here."""

from __future__ import annotations

import asyncio
import json

import anthropic
import jsonschema
import openai
import pytest

from shardserve.launch.anthropic.output import from_completion
from shardserve.launch.anthropic.stream import message_events
from shardserve.launch.openai_api.response_format import ErrorEvent
from tests.launch.conftest import API_KEY, chat_stream_cut_by_an_error, AUTH, MODEL, http, metric, post, serving
from tests.launch.test_tool_calls import TEMPLATE, WEATHER

GENERATION_PROMPT = "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
# the tool template, whose generation prompt opens <think> when chat_template_kwargs.open_think says so
THINKING_TEMPLATE = TEMPLATE.replace(GENERATION_PROMPT, "{%- if add_generation_prompt %}<|assistant|>\n"
                                     "{% if open_think %}<think>\n{% endif %}{% endif %}")
TOOLS = [{"name": "get_weather", "description": "The weather", "input_schema": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                                "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
TERSE = "You are terse. " * 12
GREEDY = {"temperature": 0}
STOP_REASONS = {"length": "max_tokens", "stop": "end_turn", "tool_calls": "tool_use"}
BASE = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    assert THINKING_TEMPLATE != TEMPLATE
    template = tmp_path_factory.mktemp("messages") / "tools.jinja"
    template.write_text(THINKING_TEMPLATE)
    yield from serving("--profile", "demo", "--api-key", API_KEY, "--chat-template", str(template),
                       "--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--reasoning-parser", "qwen3",
                       "--max-request-body-bytes", "65536")


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


def chat(client, messages: list[dict], **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


def texts(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


@pytest.mark.slow
def test_text_whole_and_streamed_is_chats_text(claude, client, server):
    asked = dict(model=MODEL, max_tokens=12, metadata={"user_id": "u1"}, extra_body=GREEDY,
                 system=[{"type": "text", "text": TERSE, "cache_control": {"type": "ephemeral"}}],
                 messages=[{"role": "user", "content": [{"type": "text", "text": "Tell me"},
                                                        {"type": "text", "text": " a story"}]}])
    reply = claude.messages.create(**asked)
    same = chat(client, [{"role": "system", "content": TERSE}, {"role": "user", "content": "Tell me a story"}],
                max_tokens=12)
    assert reply.id.startswith("msg_") and (reply.type, reply.role, reply.model) == ("message", "assistant", MODEL)
    assert texts(reply) == same.choices[0].message.content and len(reply.content) == 1
    assert reply.stop_reason == STOP_REASONS[same.choices[0].finish_reason] and reply.stop_sequence is None
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (same.usage.prompt_tokens,
                                                                     same.usage.completion_tokens)
    events = list(claude.messages.create(stream=True, **asked))
    types = [e.type for e in events]
    assert types[:2] == ["message_start", "content_block_start"] and types[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == texts(reply)
    assert events[0].message.usage.input_tokens == reply.usage.input_tokens
    assert (events[-2].delta.stop_reason, events[-2].usage.output_tokens) == (reply.stop_reason,
                                                                              reply.usage.output_tokens)
    with claude.messages.stream(**asked) as stream:
        assert texts(stream.get_final_message()) == texts(reply)
    status, raw = http(f"{server}/v1/messages", {**BASE, "stream": True}, {"x-api-key": API_KEY})
    assert status == 200 and raw.split("\n\n")[1] == 'event: ping\ndata: {"type":"ping"}'


@pytest.mark.slow
def test_a_final_assistant_message_is_continued(claude, client):
    prefill = [{"role": "user", "content": "Tell me a story"}, {"role": "assistant", "content": "Once upon"}]
    reply = claude.messages.create(model=MODEL, max_tokens=8, messages=prefill, extra_body=GREEDY)
    same = chat(client, prefill, max_tokens=8, extra_body={"add_generation_prompt": False,
                                                           "continue_final_message": True})
    assert texts(reply) == same.choices[0].message.content


@pytest.mark.slow
def test_a_stop_sequence_ends_the_message_as_chats_stop_does(claude, client):
    text = chat(client, ASK, max_tokens=12).choices[0].message.content
    stop = next(word for word in text.split()[1:] if text.find(word) > 0)
    asked = dict(model=MODEL, max_tokens=12, messages=ASK, stop_sequences=["never there", stop], extra_body=GREEDY)
    reply = claude.messages.create(**asked)
    same = chat(client, ASK, max_tokens=12, stop=[stop]).choices[0]
    assert (same.finish_reason, same.model_extra["stop_reason"]) == ("stop", stop)
    assert texts(reply) == same.message.content == text[:text.find(stop)]
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", stop)
    final = list(claude.messages.create(stream=True, **asked))[-2]
    assert (final.delta.stop_reason, final.delta.stop_sequence) == ("stop_sequence", stop)


@pytest.mark.slow
def test_tool_use_round_trips_as_chats_tool_calls(claude, client):
    named = dict(model=MODEL, max_tokens=40, messages=ASK, tools=TOOLS, extra_body=GREEDY,
                 tool_choice={"type": "tool", "name": "get_weather"})
    reply = claude.messages.create(**named)
    (block,) = reply.content
    assert (block.type, block.name, reply.stop_reason) == ("tool_use", "get_weather", "tool_use")
    jsonschema.validate(block.input, WEATHER)
    call = chat(client, ASK, tools=CHAT_TOOLS, max_tokens=40,
                tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0].message.tool_calls[0]
    assert block.input == json.loads(call.function.arguments)
    events = list(claude.messages.create(stream=True, **named))
    assert [e.type for e in events[1:4]] == ["content_block_start", "content_block_delta", "content_block_stop"]
    assert json.loads(events[2].delta.partial_json) == block.input and events[1].content_block.id.startswith("call_")
    with claude.messages.stream(**named) as stream:
        final = stream.get_final_message()
    assert (final.content[0].input, final.stop_reason) == (block.input, "tool_use")

    result = [{"type": "tool_result", "tool_use_id": block.id, "content": [{"type": "text", "text": "sunny, 21 C"}]}]
    follow = ASK + [{"role": "assistant", "content": [block.model_dump(exclude_none=True)]},
                    {"role": "user", "content": result}]
    answer = claude.messages.create(model=MODEL, max_tokens=8, messages=follow, tools=TOOLS, extra_body=GREEDY)
    as_chat = {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": json.dumps(block.input)}}
    same = chat(client, ASK + [{"role": "assistant", "tool_calls": [as_chat]},
                               {"role": "tool", "tool_call_id": block.id, "content": "sunny, 21 C"}],
                tools=CHAT_TOOLS, max_tokens=8).choices[0]
    assert texts(answer) == (same.message.content or "") and answer.stop_reason == STOP_REASONS[same.finish_reason]

    one = claude.messages.create(model=MODEL, max_tokens=80, messages=ASK, tools=TOOLS, extra_body=GREEDY,
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True})
    required = chat(client, ASK, tools=CHAT_TOOLS, max_tokens=80, tool_choice="required",
                    parallel_tool_calls=False).choices[0].message.tool_calls
    assert [(b.name, b.input) for b in one.content] == [(c.function.name, json.loads(c.function.arguments))
                                                       for c in required]


@pytest.mark.slow
def test_reasoning_comes_back_as_a_thinking_block(claude, client):
    opened = {"chat_template_kwargs": {"open_think": True}}  # the prompt opens <think>: qwen3 reads reasoning
    asked = dict(model=MODEL, max_tokens=10, messages=ASK, extra_body=GREEDY | opened)
    reply = claude.messages.create(**asked)
    message = chat(client, ASK, max_tokens=10, extra_body=opened).choices[0].message
    reasoning = message.model_extra["reasoning"]
    assert reasoning and (reply.content[0].type, reply.content[0].thinking) == ("thinking", reasoning)
    assert texts(reply) == (message.content or "")
    events = list(claude.messages.create(stream=True, **asked))
    assert events[1].content_block.type == "thinking"
    assert "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                   and e.delta.type == "thinking_delta") == reasoning


@pytest.mark.slow
def test_what_cannot_be_honoured_is_refused_by_name(server):
    refused = [({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
               ({"output_config": {"effort": "low"}}, "output_config"), ({"foo": 1}, "foo"),
               ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
               ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
               ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                "messages.0.content.0.type"),
               ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}]},
                "messages.0.content.0.tool_use_id"),
               ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
               ({"messages": [{"role": "user", "content": "hi", "name": "x"}]}, "messages.0.name"),
               ({"messages": []}, "messages"), ({"temperature": 1.5}, "temperature"), ({"max_tokens": 0}, "max_tokens"),
               ({"stop_sequences": [""]}, "stop_sequences"), ({"tool_choice": {"type": "any"}}, "tool_choice"),
               ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
               ({"tool_choice": {"type": "required"}}, "tool_choice.type")]
    for patch, name in refused:
        code, data = post(server, "/v1/messages", BASE | patch)
        assert code == 400 and data["type"] == "error" and data["error"]["type"] == "invalid_request_error", data
        assert name in data["error"]["message"] and set(data) == {"type", "error"}, (patch, data)
    code, data = post(server, "/v1/messages", {k: v for k, v in BASE.items() if k != "max_tokens"})
    assert code == 400 and "max_tokens" in data["error"]["message"]
    code, data = post(server, "/v1/messages", BASE | {"model": "nope"})
    assert code == 404 and data["error"]["type"] == "not_found_error"
    code, data = post(server, "/v1/messages", BASE | {"metadata": {"user_id": "u"}, "service_tier": "auto",
                                                      "cache_control": {"type": "ephemeral"}, "tools": [], "top_k": 1})
    assert code == 200 and data["type"] == "message", data


@pytest.mark.slow
def test_x_api_key_and_every_error_in_anthropics_shape(server):
    assert post(server, "/v1/messages", BASE, headers={"x-api-key": API_KEY})[0] == 200
    assert post(server, "/v1/messages", BASE, headers=AUTH)[0] == 200
    code, data = post(server, "/v1/messages", BASE, headers={"x-api-key": "wrong"})
    assert code == 401 and data["error"]["type"] == "authentication_error" and "x-api-key" in data["error"]["message"]
    chat_body = {"model": MODEL, "max_tokens": 2, "messages": BASE["messages"]}
    assert post(server, "/v1/chat/completions", chat_body, headers={"x-api-key": API_KEY})[0] == 401  # Bearer there
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.create(**BASE)
    code, data = post(server, "/v1/messages", BASE | {"system": "x" * 70000})
    assert code == 413 and data["error"]["type"] == "request_too_large"
    code, text = http(f"{server}/v1/messages", None, {"x-api-key": API_KEY})  # a GET
    assert code == 405 and json.loads(text)["type"] == "error"
    before = metric(server, "shardserve_requests_total")
    assert post(server, "/v1/messages", BASE)[0] == 200 and post(server, "/v1/messages", BASE | {"foo": 1})[0] == 400
    status, text = http(f"{server}/v1/messages", BASE | {"stream": True}, AUTH)
    assert status == 200 and text.rstrip().endswith('data: {"type":"message_stop"}')
    assert metric(server, "shardserve_requests_total") == before + 3
    assert http(f"{server}/load")[0] == 404  # served only with --enable-server-load-tracking


def test_an_error_mid_stream_ends_it_with_anthropics_error_event():
    closed = []

    async def read() -> list[str]:
        return [event async for event in message_events(chat_stream_cut_by_an_error(closed), {"id": "msg_1"}, 3, ())]

    events = asyncio.run(read())
    assert isinstance(events[-1], ErrorEvent) and events[-1].outcome == "unavailable" and closed == [True]
    kinds = [event.split("\n", 1)[0] for event in events]
    assert kinds == ["event: message_start", "event: ping", "event: content_block_start",
                     "event: content_block_delta", "event: error"]
    error = json.loads(events[-1].split("data: ", 1)[1])
    assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"  # the SDK raises it


def test_a_call_cut_short_by_max_tokens_comes_back_as_text():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Pa'}}
    completion = {"choices": [{"message": {"role": "assistant", "content": "", "tool_calls": [call]},
                               "finish_reason": "length", "stop_reason": None}],
                  "usage": {"prompt_tokens": 5, "completion_tokens": 4}}
    message = from_completion({"id": "msg_1"}, completion, ())
    assert message["content"] == [{"type": "text", "text": '{"city": "Pa'}] and message["stop_reason"] == "max_tokens"
