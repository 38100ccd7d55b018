"""Tool calls: parsers on known model outputs, and a real server whose chat template renders tools:
a named or required call always carries arguments that validate, tool results go back in, and
tool_choice auto answers in text when the model calls nothing."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from shardserve.launch.openai_api.tool_calls import ToolPlan, extract_calls, plan_tools
from tests.launch.conftest import start_server, stop_server

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 7}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "CET"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TEMPLATE = (
    "{%- if tools %}<|system|>\nTools: {{ tools | tojson }}{{ eos_token }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>\n{% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}{{ eos_token }}"
    "{%- elif m.role == 'tool' %}<|user|>\n<tool_response>{{ m.content }}</tool_response>{{ eos_token }}"
    "{%- else %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}")


def test_parsers_find_the_calls_of_known_formats():
    hermes = ToolPlan("auto", ("get_time",), parser="hermes")
    content, calls = extract_calls(hermes, 'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}'
                                           '\n</tool_call>')
    assert content == "Checking." and calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    llama = ToolPlan("auto", ("get_time",), parser="llama3_json")
    _, calls = extract_calls(llama, '<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}')
    assert json.loads(calls[0]["function"]["arguments"]) == {"zone": "CET"}
    assert extract_calls(hermes, "no calls here") == ("no calls here", [])
    assert extract_calls(hermes, '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>')[1] == []


def test_tool_choice_refusals_name_the_field():
    with pytest.raises(ValueError, match="--enable-auto-tool-choice"):
        plan_tools(TOOLS, "auto", None, False)
    with pytest.raises(ValueError, match="not among the tools"):
        plan_tools(TOOLS, {"type": "function", "function": {"name": "nope"}}, None, False)
    assert plan_tools(TOOLS, "none", None, False) is None and plan_tools([], None, None, False) is None
    with pytest.raises(ValueError, match="needs tools"):
        plan_tools([], "required", None, False)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    template = tmp_path_factory.mktemp("tools") / "tools.jinja"
    template.write_text(TEMPLATE)
    proc, url = start_server("--profile", "demo", "--chat-template", str(template), "--tool-call-parser", "hermes",
                             "--enable-auto-tool-choice")
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    code, out = stop_server(proc)
    assert code == 0, out


ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.mark.slow
def test_named_and_required_calls_always_carry_valid_arguments(client):
    for seed in range(4):
        named = client.chat.completions.create(
            model="shardserve-demo", messages=ASK, tools=TOOLS, max_tokens=40, temperature=1.0, seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
        (call,) = named.message.tool_calls
        assert call.function.name == "get_weather" and named.finish_reason == "stop"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        required = client.chat.completions.create(model="shardserve-demo", messages=ASK, tools=TOOLS, max_tokens=80,
                                                  temperature=1.0, seed=seed, tool_choice="required",
                                                  parallel_tool_calls=False).choices[0]
        assert required.finish_reason == "tool_calls" and required.message.tool_calls
        for call in required.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.slow
def test_results_go_back_in_and_auto_answers_in_text(client):
    first = client.chat.completions.create(model="shardserve-demo", messages=ASK, tools=TOOLS, max_tokens=80,
                                           temperature=0, tool_choice="required",
                                           parallel_tool_calls=False).choices[0].message
    messages = ASK + [first.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny, 21 C"}]
    answer = client.chat.completions.create(model="shardserve-demo", messages=messages, tools=TOOLS, max_tokens=8,
                                            temperature=0).choices[0]
    assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls and answer.message.content
    stream = client.chat.completions.create(model="shardserve-demo", messages=ASK, tools=TOOLS, max_tokens=80,
                                            temperature=0, tool_choice="required", parallel_tool_calls=False,
                                            stream=True)
    calls = [c for chunk in stream if chunk.choices for c in chunk.choices[0].delta.tool_calls or ()]
    assert calls and all(c.index == i for i, c in enumerate(calls))
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[calls[0].function.name])
