"""The reasoning splitter: whole outputs as vLLM's deepseek_r1 and qwen3 parsers split them, and any
streaming of the same text split the same way."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardserve.launch.openai_api.reasoning import THINK_PARSERS, Split, StreamSplitter, opens_reasoning, split_reasoning

CASES = [  # (parser, prompt opens <think>, output) -> (reasoning, content)
    ("deepseek_r1", False, "<think>\nsteps\n</think>\n\nanswer", ("\nsteps\n", "\n\nanswer")),
    ("deepseek_r1", False, "steps</think>answer", ("steps", "answer")),
    ("deepseek_r1", False, "cut short by max_tokens", ("cut short by max_tokens", None)),
    ("qwen3", False, "<think>steps</think>answer", ("steps", "answer")),
    ("qwen3", False, "plain answer, enable_thinking off", (None, "plain answer, enable_thinking off")),
    ("qwen3", False, "a stray </think> in an answer", (None, "a stray </think> in an answer")),
    ("qwen3", True, "steps</think>answer", ("steps", "answer")),
    ("qwen3", True, "still thinking", ("still thinking", None)),
    ("qwen3", False, "", (None, None)),
]


@pytest.mark.parametrize("parser, prompt_opens, text, expected", CASES)
def test_whole_outputs_split_as_vllm_does(parser, prompt_opens, text, expected):
    assert split_reasoning(parser, text, prompt_opens) == Split(*expected)


def test_a_prompt_opens_reasoning_when_its_last_think_is_unclosed():
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_reasoning("<|im_start|>assistant\n")


def test_an_unknown_parser_is_refused_by_name():
    with pytest.raises(ValueError, match="granite"):
        StreamSplitter("granite")


def _streamed(parser: str, prompt_opens: bool, pieces: list[str]) -> tuple[str | None, str | None]:
    splitter, reasoning, content = StreamSplitter(parser, prompt_opens), "", ""
    for piece in pieces + [None]:
        r, c = splitter.finish() if piece is None else splitter.feed(piece)
        reasoning, content = reasoning + r, content + c
    return reasoning or None, content or None


@given(st.sampled_from(THINK_PARSERS), st.booleans(),
       st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "\n", " ", "a", "b</th"]),
                max_size=12),
       st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=40))
def test_a_stream_splits_as_the_whole_text_does(parser, prompt_opens, words, cuts):
    text = "".join(words)
    pieces, start = [], 0
    for cut in cuts * (len(text) + 1):
        if start >= len(text):
            break
        pieces.append(text[start:start + cut])
        start += cut
    whole = split_reasoning(parser, text, prompt_opens)
    assert _streamed(parser, prompt_opens, pieces) == (whole.reasoning, whole.content)
    assert (whole.reasoning or "") + (whole.content or "") in _text_less_tags(text)


def _text_less_tags(text: str) -> set[str]:
    """The output with its leading <think> (and the space before it) and its first </think> dropped or
    kept: nothing else may go missing between the two parts."""
    starts = {text}
    if text.lstrip().startswith("<think>"):
        starts.add(text.lstrip()[len("<think>"):])
    return starts | {s.replace("</think>", "", 1) for s in starts}
