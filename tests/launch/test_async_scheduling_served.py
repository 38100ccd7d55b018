"""`launch --async-scheduling`: the server holds requests to the rules of the engine it serves (the
EngineInfo its replica sends), so what async scheduling cannot honour gets the offline LLM's refusal as
a 400, and what it can is served with the tokens of the server without it."""

import json

import pytest

from tests.launch.conftest import http, serving

pytestmark = pytest.mark.slow  # a server of its own

MODEL = "shardserve-demo"


@pytest.fixture(scope="module")
def async_server():
    yield from serving("--profile", "demo", "--async-scheduling")


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
])
def test_what_async_scheduling_cannot_honour_is_a_400_naming_it(async_server, extra, param):
    body = {"model": MODEL, "prompt": "The function", "max_tokens": 8, **extra}
    status, text = http(f"{async_server}/v1/completions", body)
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["param"] == param and "cannot run with async_scheduling" in error["message"], error


def test_chat_refusals_hold_on_the_server_path_too(async_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
            "response_format": {"type": "json_object"}}
    status, text = http(f"{async_server}/v1/chat/completions", body)
    assert status == 400 and json.loads(text)["error"]["param"] == "response_format", text


def test_what_it_can_honour_gets_the_tokens_of_the_server_without_it(async_server, open_server):
    body = {"model": MODEL, "prompt": ["The function returns", "Once upon a time"], "max_tokens": 16,
            "temperature": 0.0, "ignore_eos": True}
    answers = []
    for url in (async_server, open_server):
        status, text = http(f"{url}/v1/completions", body)
        assert status == 200, text
        answers.append([choice["text"] for choice in json.loads(text)["choices"]])
    assert answers[0] == answers[1]
