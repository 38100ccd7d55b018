"""The Responses API (POST /v1/responses) through the openai SDK against a real server: the same text,
tokens, logprobs and tool calls as chat completions gives for the same greedy request, whole or streamed;
what the server cannot honour is refused by name; auth, body limit and metrics apply as to chat."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from shardserve.launch.openai_api.response_format import ErrorEvent
from shardserve.launch.responses.stream import response_events
from tests.launch.conftest import API_KEY, chat_stream_cut_by_an_error, MODEL, http, metric, post, serving
from tests.launch.test_tool_calls import TEMPLATE, WEATHER

TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather", "parameters": WEATHER,
          "strict": True}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = "Weather in Paris?"
TERSE = "You are terse. " * 12  # a prefix of several KV blocks, cached after its first request
STORY = {"model": MODEL, "max_output_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    size: Literal["small", "large"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("responses") / "tools.jinja"
    template.write_text(TEMPLATE)  # renders tools, tool calls and any role (developer too)
    yield from serving("--profile", "demo", "--api-key", API_KEY, "--chat-template", str(template),
                       "--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--max-request-body-bytes", "65536")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


def chat_text(client, messages: list[dict], **kwargs) -> tuple[str, object]:
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)
    return reply.choices[0].message.content or "", reply


@pytest.mark.slow
def test_text_whole_and_streamed_is_chats_text(client):
    asked = dict(input="Tell me a story", instructions=TERSE, **STORY)
    reply = client.responses.create(**asked)
    text, chat = chat_text(client, [{"role": "system", "content": TERSE},
                                    {"role": "user", "content": "Tell me a story"}],
                           max_completion_tokens=12, extra_body={"ignore_eos": True})
    assert reply.id.startswith("resp_") and reply.object == "response" and reply.model == MODEL
    assert reply.output_text == text and reply.status == "incomplete"
    assert reply.incomplete_details.reason == "max_output_tokens" and reply.instructions == TERSE
    usage = reply.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (chat.usage.prompt_tokens, 12,
                                                                             chat.usage.total_tokens)
    (message,) = reply.output
    assert (message.type, message.role, message.status) == ("message", "assistant", "incomplete")

    events = list(client.responses.create(stream=True, **asked))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    final = events[-1].response
    assert final.output_text == text and (final.usage.input_tokens, final.usage.output_tokens) == (
        usage.input_tokens, usage.output_tokens)
    assert final.usage.input_tokens_details.cached_tokens >= 32  # the same long prefix twice before
    assert events[2].item.id == events[-2].item.id == final.output[0].id and final.id == events[0].response.id


@pytest.mark.slow
def test_input_items_become_chats_messages(client):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]},
             {"role": "developer", "content": "Be kind."}, {"role": "user", "content": "Again"}]
    reply = client.responses.create(input=items, **STORY)
    text, _ = chat_text(client, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                                 {"role": "developer", "content": "Be kind."}, {"role": "user", "content": "Again"}],
                        max_completion_tokens=12, extra_body={"ignore_eos": True})
    assert reply.output_text == text


@pytest.mark.slow
def test_json_schema_and_json_object_formats(client):
    schema = Pet.model_json_schema() | {"additionalProperties": False}
    text_format = {"format": {"type": "json_schema", "name": "pet", "schema": schema, "strict": True}}
    reply = client.responses.create(model=MODEL, input="A pet?", text=text_format, max_output_tokens=60,
                                    temperature=0)
    text, _ = chat_text(client, [{"role": "user", "content": "A pet?"}], max_completion_tokens=60,
                        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}})
    assert reply.status == "completed" and reply.output_text == text and reply.text.format.type == "json_schema"
    jsonschema.validate(json.loads(text), schema)
    parsed = client.responses.parse(model=MODEL, input="A pet?", text_format=Pet, max_output_tokens=60, temperature=1,
                                    extra_body={"seed": 3})
    assert isinstance(parsed.output_parsed, Pet)
    with client.responses.stream(model=MODEL, input="A pet?", text_format=Pet, max_output_tokens=60,
                                 temperature=0) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and isinstance(final.output_parsed, Pet)
    obj = client.responses.create(model=MODEL, input="x", text={"format": {"type": "json_object"}},
                                  max_output_tokens=30, temperature=0)
    assert obj.output_text.startswith("{")


@pytest.mark.slow
def test_logprobs_are_chats(client):
    asked = dict(input="Hi", include=["message.output_text.logprobs"], top_logprobs=2, **STORY)
    reply = client.responses.create(**asked)
    logprobs = reply.output[0].content[0].logprobs
    _, chat = chat_text(client, [{"role": "user", "content": "Hi"}], max_completion_tokens=12, logprobs=True,
                        top_logprobs=2, extra_body={"ignore_eos": True})
    expected = chat.choices[0].logprobs.content
    assert [(lp.token, len(lp.top_logprobs)) for lp in logprobs] == [(lp.token, 2) for lp in expected]
    assert [lp.logprob for lp in logprobs] == pytest.approx([lp.logprob for lp in expected], abs=1e-4)
    done = [e for e in client.responses.create(stream=True, **asked) if e.type == "response.output_text.done"]
    assert [lp.token for lp in done[0].logprobs] == [lp.token for lp in expected]


@pytest.mark.slow
def test_function_calls_and_their_outputs_round_trip(client):
    named = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, max_output_tokens=40, temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"})
    (call,) = named.output
    assert (call.type, call.name, named.status) == ("function_call", "get_weather", "completed")
    chat_call = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ASK}], tools=CHAT_TOOLS, max_tokens=40, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0].message.tool_calls[0]
    assert json.loads(call.arguments) == json.loads(chat_call.function.arguments)
    jsonschema.validate(json.loads(call.arguments), WEATHER)

    follow = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    answer = client.responses.create(model=MODEL, input=follow, tools=TOOLS, max_output_tokens=8, temperature=0)
    as_chat = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    text, _ = chat_text(client, [{"role": "user", "content": ASK}, {"role": "assistant", "tool_calls": [as_chat]},
                                 {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}],
                        tools=CHAT_TOOLS, max_tokens=8)
    assert answer.output_text == text and answer.output[0].type == "message"

    required = dict(model=MODEL, input=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                    max_output_tokens=80, temperature=0)
    events = list(client.responses.create(stream=True, **required))
    types = [e.type for e in events]
    assert types[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    (streamed,) = events[-1].response.output
    (whole,) = client.responses.create(**required).output
    assert (streamed.name, streamed.arguments) == (whole.name, whole.arguments) == (events[2].item.name,
                                                                                     events[3].delta)
    assert events[4].arguments == events[3].delta and events[2].item.call_id == streamed.call_id


@pytest.mark.slow
def test_what_cannot_be_honoured_is_refused_by_name(server):
    base = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
    refused = [({"previous_response_id": "resp_1"}, "previous_response_id"), ({"background": True}, "background"),
               ({"truncation": "auto"}, "truncation"), ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
               ({"include": ["file_search_call.results"]}, "include"), ({"top_logprobs": 2}, "top_logprobs"),
               ({"n": 2}, "n"), ({"max_tool_calls": 1}, "max_tool_calls"),
               ({"max_output_tokens": 0}, "max_output_tokens"),
               ({"input": []}, "input"), ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
                                          "input.0.content.0.type"),
               ({"input": [{"type": "function_call_output", "call_id": "x", "output": "1"}]}, "input.0.call_id"),
               ({"input": [{"type": "function_call", "call_id": "x", "name": "f", "arguments": "[1]"}]},
                "input.0.arguments"),
               ({"tools": [{"type": "web_search"}]}, "tools.0.type"), ({"tools": CHAT_TOOLS}, "tools.0.name"),
               ({"tool_choice": "required"}, "tool_choice"),
               ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
               ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
               ({"text": {"format": {"type": "json_object"}}, "tools": TOOLS, "tool_choice": "required"},
                "tool_choice"),
               ({"text": {"verbosity": "low"}}, "text.verbosity"), ({"stop": 5}, "stop"), ({"model": "nope"}, "model"),
               ({"stream": True, "stream_options": {"continuous_usage_stats": True}},
                "stream_options.continuous_usage_stats")]
    for patch, param in refused:
        code, data = post(server, "/v1/responses", base | patch)
        assert code in (400, 404) and data["error"]["param"] == param, (patch, data)
    code, data = post(server, "/v1/responses", base | {"input": "hi " * 3000})  # past max_model_len
    assert data["error"]["param"] == "max_output_tokens" and "max_output_tokens" in data["error"]["message"], data
    code, data = post(server, "/v1/responses", {"model": MODEL, "input": "hi " * 3000})
    assert code == 400 and data["error"]["param"] == "input", data  # longer than max_model_len by itself
    code, data = post(server, "/v1/responses", base | {"text": {"format": {"type": "json_object"}}, "tools": TOOLS,
                                                       "tool_choice": "required"})
    assert "text.format" in data["error"]["message"] and "response_format" not in data["error"]["message"]
    code, data = post(server, "/v1/responses", base | {"store": True, "metadata": {"k": "v"}, "user": "u",
                                                       "include": ["reasoning.encrypted_content"]})
    assert code == 200 and (data["store"], data["metadata"], data["user"]) == (False, {"k": "v"}, "u"), data


@pytest.mark.slow
def test_auth_body_limit_and_metrics_apply(server):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, "ignore_eos": True}
    assert post(server, "/v1/responses", body, headers={})[0] == 401
    assert post(server, "/v1/responses", body | {"input": "x" * 70000})[0] == 413
    before = metric(server, "shardserve_requests_total")
    assert post(server, "/v1/responses", body)[0] == 200
    status, text = http(f"{server}/v1/responses", body | {"stream": True},
                        {"authorization": f"Bearer {API_KEY}"})
    assert status == 200 and text.rstrip().split("\n")[-2] == "event: response.incomplete"
    assert post(server, "/v1/responses", body | {"background": True})[0] == 400
    assert metric(server, "shardserve_requests_total") == before + 3


def test_an_error_mid_stream_ends_it_as_chats_error_events_do():
    closed = []

    async def read(limit: int | None = None) -> list[str]:
        events, out = response_events(chat_stream_cut_by_an_error(closed), {"id": "resp_1"}), []
        async for event in events:
            out.append(event)
            if len(out) == limit:
                await events.aclose()
        return out

    events = asyncio.run(read())
    last = events[-1]
    assert isinstance(last, ErrorEvent) and last.outcome == "unavailable" and closed == [True]
    payloads = [json.loads(e.split("data: ", 1)[1]) for e in events]
    assert [p["sequence_number"] for p in payloads] == list(range(len(events)))
    assert payloads[-1]["type"] == "error" and payloads[-1]["error"]["code"] == 503  # the SDK raises on "error"
    assert payloads[-2]["type"] == "response.output_text.delta" and payloads[-2]["delta"] == "Hel"
    closed.clear()
    assert len(asyncio.run(read(limit=4))) == 4 and closed == [True]  # the client left: chat's stream is closed
