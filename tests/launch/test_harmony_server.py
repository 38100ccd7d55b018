"""--reasoning-parser openai_gptoss (and --tool-call-parser openai) on a real server over a tiny checkpoint
whose tokenizer has harmony's markers as special tokens and a harmony chat template written here.

The random model never writes harmony of itself: a regex grammar (from the first token, as the generation
prompt leaves the output in a header) writes the text, and a logit bias makes each marker its special token
rather than its characters one by one. The markers' ids come back in token_ids; none in the text."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken

from shardserve.launch.openai_api.harmony import CALL, CHANNEL, CONSTRAIN, END, MARKERS, MESSAGE, RETURN, START
from tests.launch.conftest import API_KEY, post, serving, stream_chunks
from tests.runtime.runtime_checkpoints import save_checkpoint

pytestmark = pytest.mark.slow  # every test here starts a process

NAME = "tiny-harmony"
# a harmony template after the format's description: tools in a developer message, an assistant turn's
# reasoning on the analysis channel, its calls on commentary, its answer on final
TEMPLATE = (
    "{%- if tools %}<|start|>developer<|message|># Tools\nnamespace functions {\n"
    "{%- for tool in tools %}\ntype {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;"
    "{%- endfor %}\n} // namespace functions<|end|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- if m.reasoning_content %}<|start|>assistant<|channel|>analysis<|message|>{{ m.reasoning_content }}<|end|>"
    "{%- endif %}"
    "{%- for call in m.tool_calls or [] %}<|start|>assistant to=functions.{{ call.function.name }}"
    "<|channel|>commentary <|constrain|>json<|message|>{{ call.function.arguments | tojson }}<|call|>{%- endfor %}"
    "{%- if m.content %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{%- endif %}"
    "{%- elif m.role == 'tool' %}<|start|>functions.{{ m.name }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)
ASK = [{"role": "user", "content": "What is a list?"}]
ANSWER = (r"<\|channel\|>analysis<\|message\|>[a-z]{3,6}<\|end\|><\|start\|>assistant<\|channel\|>final"
          r"<\|message\|>[a-z]{2,5}")
CALLING = r'<\|channel\|>commentary to=functions\.get_weather <\|constrain\|>json<\|message\|>\{"city":"[a-z]{3,6}"\}'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def ids(tmp_path_factory) -> tuple[str, dict[str, int]]:
    """A tiny Qwen2 checkpoint with the markers as special tokens (ids 300 to 306 of its 320 rows) and
    <|return|> and <|call|> ending a generation; its folder and the markers' ids."""
    from transformers import AutoTokenizer

    folder = str(tmp_path_factory.mktemp("harmony_model"))
    save_checkpoint(folder, "qwen2", max_position_embeddings=1024)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens([AddedToken(marker, special=True) for marker in MARKERS], special_tokens=True)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    marker_ids = dict(zip(MARKERS, tokenizer.convert_tokens_to_ids(list(MARKERS))))
    with open(f"{folder}/generation_config.json", "w") as f:
        f.write(f'{{"eos_token_id": [{marker_ids[RETURN]}, {marker_ids[CALL]}]}}')
    return folder, marker_ids


@pytest.fixture(scope="module")
def server(ids):
    yield from serving("--model", ids[0], "--served-model-name", NAME, "--api-key", API_KEY,
                       "--reasoning-parser", "openai_gptoss", "--tool-call-parser", "openai",
                       "--enable-auto-tool-choice", "--trust-request-chat-template")


def bias(marker_ids: dict[str, int], *markers: str) -> dict[str, float]:
    return {str(marker_ids[marker]): 100.0 for marker in markers}


def body(marker_ids: dict[str, int], regex: str, last: str, **more) -> dict:
    """A greedy request whose output the regex writes, each marker as its token, `last` ending it."""
    return {"model": NAME, "messages": ASK, "max_tokens": 128, "temperature": 0, "return_token_ids": True,
            "structured_outputs": {"regex": regex},
            "logit_bias": bias(marker_ids, START, END, MESSAGE, CHANNEL, CONSTRAIN, last), **more}


def chat(server: str, request: dict) -> dict:
    status, answer = post(server, "/v1/chat/completions", request)
    assert status == 200, answer
    return answer["choices"][0]


def test_analysis_is_reasoning_and_final_is_content_whole_and_streamed(server, ids):
    request = body(ids[1], ANSWER, RETURN)
    choice = chat(server, request)
    message = choice["message"]
    reasoning, content = message["reasoning"], message["content"]
    assert reasoning.isalpha() and 3 <= len(reasoning) <= 6 and content.isalpha() and len(content) <= 5, message
    assert message["reasoning_content"] == reasoning and choice["finish_reason"] == "stop"
    assert {ids[1][m] for m in (CHANNEL, MESSAGE, END, START, RETURN)} <= set(choice["token_ids"])
    for asked in ({}, {"skip_special_tokens": False}, {"skip_special_tokens": True}):
        chunks = stream_chunks(server, "/v1/chat/completions", request | asked)
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert "".join(d.get("reasoning") or "" for d in deltas) == reasoning, asked
        assert "".join(d.get("content") or "" for d in deltas) == content, asked
        assert all("<|" not in (d.get("content") or "") + (d.get("reasoning") or "") for d in deltas)
        assert chat(server, request | asked)["message"]["content"] == content


def test_a_commentary_call_to_a_function_is_a_tool_call(server, ids):
    request = body(ids[1], CALLING, CALL, tools=TOOLS, tool_choice="auto")
    choice = chat(server, request)
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["function"]["arguments"].startswith('{"city":"')
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (chunk,) = [c for c in stream_chunks(server, "/v1/chat/completions", request) if c["choices"]]
    assert chunk["choices"][0]["delta"]["tool_calls"][0]["function"] == call["function"]
    assert chunk["choices"][0]["finish_reason"] == "tool_calls"


def test_an_assistant_turns_reasoning_renders_on_the_analysis_channel(server, ids):
    from transformers import AutoTokenizer

    turns = ASK + [{"role": "assistant", "content": "A sequence.", "reasoning_content": "Define it."},
                   {"role": "user", "content": "And a set?"}]
    status, answer = post(server, "/tokenize", {"model": NAME, "messages": turns})
    tokenizer = AutoTokenizer.from_pretrained(ids[0])
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert "<|start|>assistant<|channel|>analysis<|message|>Define it.<|end|>" in text
    assert status == 200 and answer["tokens"] == tokenizer(text, add_special_tokens=False).input_ids
    renamed = [turns[0], turns[1] | {"reasoning": turns[1].pop("reasoning_content")}, turns[2]]
    assert post(server, "/tokenize", {"model": NAME, "messages": renamed})[1]["tokens"] == answer["tokens"]


@pytest.mark.parametrize("messages, extra, field", [
    (ASK + [{"role": "assistant", "content": "A.", "reasoning_content": "B."}],
     {"chat_template": "{% if enable_thinking %}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"},
     "messages.1.reasoning_content"),
    ([ASK[0] | {"reasoning_content": "mine"}], {}, "messages.0.reasoning_content"),
    ([{"role": "assistant", "content": "A.", "reasoning_content": "B.", "reasoning": "C."}], {},
     "messages.0.reasoning_content"),
])
def test_reasoning_that_cannot_be_rendered_is_refused_by_name(server, messages, extra, field):
    status, answer = post(server, "/v1/chat/completions", {"model": NAME, "messages": messages, "max_tokens": 2,
                                                           **extra})
    assert status == 400 and answer["error"]["param"] == field, answer
