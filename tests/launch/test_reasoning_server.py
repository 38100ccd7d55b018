"""--reasoning-parser on a real server: chat messages carry `reasoning` (and `reasoning_content`) apart from
the content, whole and streamed alike, the Responses API gives a reasoning item, and a grammar waits for
</think> when the output starts inside the reasoning.

The demo model never writes <think> of itself: a regex grammar makes it (qwen3: the output may open
<think>), and a request's own chat template ending in "<think>\\n" opens the reasoning in the prompt."""

from __future__ import annotations

import openai
import pytest

from tests.launch.conftest import API_KEY, MODEL, post, serving, stream_chunks

pytestmark = pytest.mark.slow  # every test here starts a process

HI = [{"role": "user", "content": "What is a list?"}]
THINKING = {"structured_outputs": {"regex": "<think>[a-z]{3,6}</think>[a-z]{2,5}"}}
OPENS = "{% for m in messages %}{{ m.content }}\n{% endfor %}<think>\n"  # the prompt leaves <think> open


@pytest.fixture(scope="module")
def server():
    yield from serving("--profile", "demo", "--api-key", API_KEY, "--reasoning-parser", "qwen3",
                       "--trust-request-chat-template")


def chat(server: str, **body) -> dict:
    status, answer = post(server, "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 48,
                                                           "temperature": 0, **body})
    assert status == 200, answer
    return answer


def test_reasoning_and_content_are_split_whole_and_streamed(server):
    message = chat(server, **THINKING)["choices"][0]["message"]
    reasoning, content = message["reasoning"], message["content"]
    assert reasoning.isalpha() and 3 <= len(reasoning) <= 6 and content.isalpha(), message
    assert message["reasoning_content"] == reasoning
    chunks = stream_chunks(server, "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 48,
                                                            "temperature": 0, **THINKING})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == reasoning
    assert "".join(d.get("content") or "" for d in deltas) == content
    assert all("<" not in (d.get("content") or "") + (d.get("reasoning") or "") for d in deltas)


def test_an_answer_without_think_is_all_content(server):
    message = chat(server, structured_outputs={"regex": "[a-z]{4}"})["choices"][0]["message"]
    assert message["reasoning"] is None and len(message["content"]) == 4


def test_a_grammar_waits_for_the_end_of_reasoning_a_prompt_opened(server):
    """The prompt opens <think>: the output is reasoning until </think> (which the demo never writes), so
    the grammar has not started and the text is the free one, all reasoning."""
    free = chat(server, chat_template=OPENS)["choices"][0]["message"]
    constrained = chat(server, chat_template=OPENS, structured_outputs={"regex": "[0-9]{3}"})["choices"][0]["message"]
    assert free["content"] is None and free["reasoning"]
    assert constrained == free


def test_the_responses_api_gives_the_reasoning_its_own_item(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY)
    whole = client.responses.create(model=MODEL, input="What is a list?", max_output_tokens=48, temperature=0,
                                    extra_body=THINKING)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    reasoning = whole.output[0].content[0].text
    assert 3 <= len(reasoning) <= 6 and whole.output_text.isalpha()
    with client.responses.stream(model=MODEL, input="What is a list?", max_output_tokens=48, temperature=0,
                                 extra_body=THINKING) as stream:
        deltas = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == reasoning and final.output[0].content[0].text == reasoning
    assert final.output[1].content[0].text == whole.output_text
