"""Every bad input is a 400 in OpenAI's shape that names the field: never a 5xx, never taken in silence."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

from tests.launch.conftest import MODEL, http

pytestmark = pytest.mark.slow  # every test here starts a process

SURROGATE = "ab\ud800cd"  # json.dumps writes it as JSON's "\ud800" escape: an unpaired surrogate
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def chat(**fields) -> tuple[str, dict]:
    return "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                    "max_tokens": 2} | fields


def complete(**fields) -> tuple[str, dict]:
    return "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2} | fields


def after_call(tool_calls) -> tuple[str, dict]:
    """A chat whose second message is an assistant's with these tool_calls."""
    return chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": tool_calls}])


# issue 21, item 6: malformed content parts, tools and tool calls, text that is not valid Unicode, numbers that
# are not finite or out of range, unknown keys inside a message or stream_options. Each is a case name ->
# (route and body, the field the error must name); NaN and Infinity go out as JSON's NaN and Infinity.
BAD = {
    "text part not a string": (chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
                               "messages.0.content.parts.0.text"),
    "surrogate in a prompt": (complete(prompt=SURROGATE), "prompt"),
    "surrogate in a message": (chat(messages=[{"role": "user", "content": SURROGATE}]), "messages.0.content"),
    "surrogate in a text part": (chat(messages=[{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]),
                                 "messages.0.content.0.text"),
    "surrogate in a key": (complete(metadata={SURROGATE: "x"}), "metadata"),
    "surrogate in /tokenize's prompt": (("/tokenize", {"model": MODEL, "prompt": SURROGATE}), "prompt"),
    "surrogate in /tokenize's messages": (("/tokenize", {"model": MODEL, "messages": [
        {"role": "user", "content": SURROGATE}]}), "messages.0.content"),
    "tool without function": (chat(tools=[{"type": "function"}], tool_choice="required"), "tools.0.function"),
    "tool function not a mapping": (chat(tools=[{"type": "function", "function": "f"}], tool_choice="required"),
                                    "tools.0.function"),
    "tool name not a string": (chat(tools=[{"type": "function", "function": {"name": 5}}], tool_choice="required"),
                               "tools.0.function.name"),
    "tool_choice function not a mapping": (chat(tools=TOOLS, tool_choice={"type": "function", "function": "f"}),
                                           "tool_choice"),
    "tool_calls not a list": (after_call("x"), "messages.1.tool_calls"),
    "tool call not a mapping": (after_call([1]), "messages.1.tool_calls.0"),
    "tool call without function": (after_call([{}]), "messages.1.tool_calls.0.function"),
    "tool call arguments not an object": (after_call([{"id": "c1", "type": "function", "function": {
        "name": "f", "arguments": "[1]"}}]), "messages.1.tool_calls.0.function.arguments"),
    "repetition_penalty Infinity": (complete(repetition_penalty=float("inf")), "repetition_penalty"),
    "logit_bias NaN": (complete(logit_bias={"5": float("nan")}), "logit_bias"),
    "stop_token_ids negative": (complete(stop_token_ids=[-1]), "stop_token_ids"),
    "stop_token_ids beyond int64": (complete(stop_token_ids=[10**20]), "stop_token_ids"),
    "stop_token_ids beyond the vocabulary": (complete(stop_token_ids=[1_000_000]), "stop_token_ids"),
    "min_tokens beyond max_tokens": (complete(min_tokens=10**12), "min_tokens"),  # a 400 before: kept
    "min_tokens beyond max_model_len": (chat(min_tokens=10**12, max_tokens=None), "min_tokens"),
    "unknown key in stream_options": (complete(stream=True, stream_options={"include_usage": True, "bogus": 1}),
                                      "stream_options.bogus"),
    "seed beyond int64": (complete(seed=2**63), "seed"),
    "seed below int64": (complete(seed=-(2**63) - 1), "seed"),
    # issue 40: each was a 500
    "response_format json_schema not an object": (chat(response_format={"type": "json_schema", "json_schema": "x"}),
                                                  "response_format"),
    "guided_json as text nested 5,000 deep": (chat(guided_json="[" * 5000 + "]" * 5000), "guided_json"),
    "guided_json as text, not an object": (chat(guided_json="[1, 2]"), "guided_json"),
    "chat_template_kwargs naming the template's own argument": (chat(chat_template_kwargs={"messages": 1}),
                                                                "chat_template_kwargs"),
}

# the same shapes done right: still served
GOOD = {
    "text parts": chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                               {"type": "text", "text": " there"}]}]),
    # as vLLM: a message's unknown fields are accepted, and named in the server's log
    "unknown key in a message": chat(messages=[{"role": "user", "content": "hi", "bogus": 1}]),
    "neutral extras in a message": chat(messages=[{"role": "user", "content": "hi", "name": "bob", "refusal": None}]),
    "stream_options of OpenAI's": complete(stream=True, stream_options={"include_usage": True,
                                                                       "include_obfuscation": False}),
    "edge numbers": complete(seed=2**63 - 1, stop_token_ids=[0], logit_bias={"5": -100}, repetition_penalty=1.2),
    "an assistant turn": chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes",
                                                                           "tool_calls": []},
                                        {"role": "user", "content": [{"type": "text", "text": "go on"}]}]),
    "tool_choice none with tools": chat(tools=TOOLS, tool_choice="none"),
    "paired surrogates (an emoji)": complete(prompt="ab\U0001F600cd"),
}


@pytest.fixture(scope="module")
def server(open_server):
    return open_server


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_a_400_naming_the_field(server, case):
    (route, body), field = BAD[case]
    status, text = http(f"{server}{route}", body)
    assert status == 400, (status, text[:300])
    error = json.loads(text)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400
    assert error["type"] == "invalid_request_error"
    assert field in f"{error['param']} {error['message']}", error


@pytest.mark.parametrize("case", GOOD)
def test_the_same_shapes_done_right_are_served(server, case):
    route, body = GOOD[case]
    status, text = http(f"{server}{route}", body)
    assert status == 200, (status, text[:300])


@pytest.mark.parametrize("route", ["/invocations", "/v1/chat/completions/batch", "/v1/chat/completions"])
def test_a_body_nested_a_thousand_deep_is_a_400(server, route):
    """(Parsed by the route itself, /invocations and the batch route answered 500: Python's recursion limit.)"""
    status, text = raw_post(f"{server}{route}", '{"messages": ' + "[" * 1000 + "]" * 1000 + "}")
    assert status == 400, (status, text[:300])
    assert json.loads(text)["error"]["code"] == 400


LEAKY = {  # a 400 whose text came from a library: its source files and Python's names stay out of it
    "xgrammar's regex error": (complete(guided_regex="(a"), "parenthesis is not closed"),
    "xgrammar's grammar error": (complete(guided_grammar="root ::= foo"), 'is not defined'),
    "a chat template's keyword clash": (chat(chat_template_kwargs={"add_generation_prompt": 1}),
                                        "chat_template_kwargs.add_generation_prompt"),
}


@pytest.mark.parametrize("case", LEAKY)
def test_a_400_says_what_is_wrong_without_library_internals(server, case):
    (route, body), words = LEAKY[case]
    status, text = http(f"{server}{route}", body)
    assert status == 400 and words in text, text[:300]
    assert not re.search(r"\.(?:cc|cpp|py):\d+|/project/|render\(\)|\[\d\d:\d\d:\d\d\]", text), text


def raw_post(url: str, text: str) -> tuple[int, str]:
    request = urllib.request.Request(url, data=text.encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_the_server_stays_healthy(server):
    for (route, body), _ in BAD.values():
        http(f"{server}{route}", body)
    assert http(f"{server}/health")[0] == 200
