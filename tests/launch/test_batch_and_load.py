"""vLLM's /v1/chat/completions/batch (each conversation's answer is the one chat completions gives it) and
/load (the API requests in flight, with --enable-server-load-tracking), against a real server."""

from __future__ import annotations

import json

import openai
import pytest

from tests.launch.conftest import MODEL, http, open_request, post, serving
from tests.launch.test_disconnects import LONG, wait_for

pytestmark = pytest.mark.slow  # every test here starts a process

BATCH = "/v1/chat/completions/batch"
TERSE = "You are terse. " * 4
CONVERSATIONS = [[{"role": "user", "content": "hi"}],
                 [{"role": "system", "content": TERSE}, {"role": "user", "content": "Tell me a story"}],
                 [{"role": "user", "content": "A list is"}]]
ASKED = {"model": MODEL, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 1}


@pytest.fixture(scope="module")
def server():
    yield from serving("--profile", "demo", "--enable-server-load-tracking")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def test_a_batch_answers_each_conversation_as_chat_completions_does(server, client):
    code, data = post(server, BATCH, ASKED | {"messages": CONVERSATIONS, "return_token_ids": True})
    assert code == 200 and data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-"), data
    assert [choice["index"] for choice in data["choices"]] == [0, 1, 2]
    singles = [client.chat.completions.create(messages=conversation, extra_body={"return_token_ids": True}, **ASKED)
               for conversation in CONVERSATIONS]
    for choice, single in zip(data["choices"], singles):
        expected = single.choices[0]
        assert choice["message"]["content"] == expected.message.content
        assert choice["finish_reason"] == expected.finish_reason
        assert choice["token_ids"] == expected.model_extra["token_ids"]
        assert choice["prompt_token_ids"] == single.model_extra["prompt_token_ids"]
        assert [lp["token"] for lp in choice["logprobs"]["content"]] == [lp.token for lp in expected.logprobs.content]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert data["usage"][key] == sum(getattr(single.usage, key) for single in singles)


def test_a_batch_refuses_what_it_cannot_do_by_name(server):
    refused = [({"stream": True}, "stream"), ({"n": 2}, "n"), ({"prompt_logprobs": 1}, "prompt_logprobs"),
               ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
               ({"tool_choice": "required"}, "tool_choice"), ({"foo": 1}, "foo"),
               ({"messages": CONVERSATIONS[0]}, "messages"), ({"messages": []}, "messages"),
               ({"messages": [CONVERSATIONS[0], [{"content": "no role"}]]}, "messages.1.0.role"),
               ({"messages": [CONVERSATIONS[0], [{"role": "user", "content": [{"type": "image_url"}]}]]},
                "messages.1.0.content.0"),
               ({"messages": [CONVERSATIONS[0], [{"role": "user", "content": "hi " * 3000}]],
                 "max_tokens": None}, "messages.1"),
               ({"messages": [CONVERSATIONS[0], [{"role": "user", "content": "hi " * 600}]]}, "max_tokens")]
    for patch, param in refused:
        code, data = post(server, BATCH, {"model": MODEL, "max_tokens": 600, "messages": CONVERSATIONS} | patch)
        assert code == 400 and data["error"]["param"] == param, (patch, data)
        assert data["error"]["param"] in data["error"]["message"], data
    assert data["error"]["message"].startswith("messages.1: ")  # the conversation whose prompt is too long
    code, data = post(server, BATCH, {"model": "nope", "messages": CONVERSATIONS})
    assert code == 404 and data["error"]["param"] == "model"


def load(server: str) -> int:
    status, text = http(f"{server}/load")
    assert status == 200, text
    return json.loads(text)["server_load"]


def test_load_counts_the_api_requests_in_flight(server):
    assert load(server) == 0
    first, second = (open_request(server, "/v1/completions", LONG) for _ in range(2))
    try:
        assert wait_for(lambda: load(server) == 2, 5) < 5
        first.close()
        assert wait_for(lambda: load(server) == 1, 5) < 5
    finally:
        first.close()
        second.close()
    assert wait_for(lambda: load(server) == 0, 5) < 5
