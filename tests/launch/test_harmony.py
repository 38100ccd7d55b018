"""The harmony splitter (--reasoning-parser openai_gptoss): gpt-oss's analysis channel is the reasoning, final
and commentary the content, calls to functions.NAME are split off with the openai tool parser; a stream
splits as the whole text does, however the markers are cut, and no marker reaches either part."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardserve.launch.openai_api.harmony import MARKERS, HarmonySplitter, marker_ids, prompt_tail
from shardserve.launch.openai_api.reasoning import ReasoningMode, Split
from shardserve.launch.openai_api.tool_calls import ToolCallError, ToolPlan, extract_calls, plan_tools

GENERATION_PROMPT = "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant"
ANALYSIS = "<|channel|>analysis<|message|>User asks. Easy.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city":"Paris"}<|call|>')
CASES = [  # output after GENERATION_PROMPT -> (reasoning, content)
    (ANALYSIS + FINAL, ("User asks. Easy.", "It is sunny.")),
    ("<|channel|>final<|message|>It is sunny.<|return|>", (None, "It is sunny.")),
    ("<|channel|>analysis<|message|>cut short by max_to", ("cut short by max_to", None)),
    (ANALYSIS + "<|start|>assistant<|channel|>fin", ("User asks. Easy.", None)),
    (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>", ("User asks. Easy.", None)),
    (ANALYSIS + "<|channel|>analysis<|message|>More.<|end|>" + FINAL, ("User asks. Easy.\nMore.", "It is sunny.")),
    (ANALYSIS + "<|channel|>final<|message|>No <|start|>.<|return|>", ("User asks. Easy.", "No ")),
    ("<|channel|>commentary<|message|>Calling.<|end|>" + FINAL, (None, "Calling.\nIt is sunny.")),
    (ANALYSIS + CALL, ("User asks. Easy.", '{"city":"Paris"}')),  # no tool parser: commentary is content
    ('{"city": "Paris"}', (None, '{"city": "Paris"}')),  # a grammar's output from the first token: no markers
    ("Plain answer, no markers.", (None, "Plain answer, no markers.")),
    ("", (None, None)),
]


def split(output: str, tool_calls: bool = False, prompt: str = GENERATION_PROMPT) -> Split:
    return ReasoningMode.for_prompt("openai_gptoss", prompt, tool_calls).split(output)


def streamed(output: str, cuts: list[int], tool_calls: bool = False,
             prompt: str = GENERATION_PROMPT) -> tuple[str | None, str | None, tuple]:
    splitter, reasoning, content, start = HarmonySplitter(prompt_tail(prompt), tool_calls), "", "", 0
    for cut in cuts * (len(output) + 1):
        if start >= len(output):
            break
        r, c = splitter.feed(output[start:start + cut])
        reasoning, content, start = reasoning + r, content + c, start + cut
    r, c = splitter.finish()
    return (reasoning + r) or None, (content + c) or None, tuple(splitter.calls)


@pytest.mark.parametrize("output, expected", CASES)
def test_whole_outputs_split_by_channel(output, expected):
    assert split(output) == Split(*expected)


@pytest.mark.parametrize("output, expected", CASES)
def test_one_character_at_a_time_splits_as_the_whole(output, expected):
    assert streamed(output, [1]) == (*expected, ())


def test_markers_cut_across_deltas_are_held_back_until_they_complete():
    splitter = HarmonySplitter(prompt_tail(GENERATION_PROMPT))
    pieces = ["<|chan", "nel|>analysis<|mes", "sage|>Hm<", "|end|><|start|>assistant<|channel|>final<|message|>A",
              "<|ret", "urn|>"]
    assert [splitter.feed(piece) for piece in pieces] == [("", ""), ("", ""), ("Hm", ""), ("", "A"), ("", ""),
                                                          ("", "")]
    assert splitter.finish() == ("", "")


def test_calls_to_functions_are_split_off_with_the_openai_tool_parser():
    whole = split(ANALYSIS + CALL, tool_calls=True)
    assert whole == Split("User asks. Easy.", None, (("get_weather", '{"city":"Paris"}'),))
    assert streamed(ANALYSIS + CALL, [1], tool_calls=True) == (whole.reasoning, whole.content, whole.calls)
    in_role = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Oslo"}<|call|>'
    preamble = "<|channel|>commentary<|message|>Checking.<|end|>"
    assert split(preamble + in_role, tool_calls=True) == Split(None, "Checking.", (("get_weather", '{"city":"Oslo"}'),))
    assert split(" to=functions.f<|channel|>commentary<|message|>{}", tool_calls=True).calls == (("f", "{}"),)
    plan = ToolPlan("auto", ("get_weather",), parser="openai")
    content, calls = extract_calls(plan, "Checking.", (("get_weather", '{"city":"Oslo"}'), ("unknown", "{}")))
    assert content == "Checking." and [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city":"Oslo"}'}]
    assert extract_calls(plan, "Just text.", ()) == ("Just text.", [])


def test_the_openai_tool_parser_needs_the_harmony_split():
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert plan_tools(tools, "auto", "openai", True, reasoning_parser="openai_gptoss").parser == "openai"
    with pytest.raises(ToolCallError, match="--reasoning-parser openai_gptoss") as refused:
        plan_tools(tools, "auto", "openai", True, reasoning_parser="qwen3")
    assert refused.value.field == "tool_choice"


def test_where_the_prompt_leaves_off_decides_where_the_output_starts():
    analysis_open = GENERATION_PROMPT + "<|channel|>analysis<|message|>"
    assert split("more steps<|end|>" + FINAL, prompt=analysis_open) == Split("more steps", "It is sunny.")
    mode = ReasoningMode.for_prompt("openai_gptoss", analysis_open)
    assert mode.starts_inside and mode.reasoning_end == "<|channel|>final<|message|>"
    assert not ReasoningMode.for_prompt("openai_gptoss", GENERATION_PROMPT).starts_inside
    final_open = GENERATION_PROMPT + "<|channel|>final<|message|>"
    assert split("go on", prompt=final_open) == Split(None, "go on")
    assert split("<|channel|>final<|message|>x", prompt="no harmony prompt") == Split(None, "x")


def test_the_markers_ids_are_those_the_tokenizer_has(tmp_path):
    from tokenizers import AddedToken

    from tests.runtime.runtime_checkpoints import build_tokenizer

    tokenizer = build_tokenizer(str(tmp_path))
    tokenizer.add_tokens([AddedToken(marker, special=True) for marker in ("<|start|>", "<|end|>")],
                         special_tokens=True)
    assert marker_ids(tokenizer) == tuple(tokenizer.convert_tokens_to_ids(["<|start|>", "<|end|>"]))


WORDS = [*MARKERS, "analysis", "final", "commentary", "assistant", " to=functions.f", "json", " ", "\n", "ab",
         "c d", "<", "|>", "{}"]


@given(st.lists(st.sampled_from(WORDS), max_size=14), st.lists(st.integers(min_value=1, max_value=6), min_size=1,
                                                                 max_size=30),
       st.booleans(), st.sampled_from([GENERATION_PROMPT, "", GENERATION_PROMPT + "<|channel|>analysis<|message|>"]))
def test_a_stream_splits_as_the_whole_text_does_and_no_marker_leaks(words, cuts, tool_calls, prompt):
    output = "".join(words)
    whole = split(output, tool_calls, prompt)
    assert streamed(output, cuts, tool_calls, prompt) == (whole.reasoning, whole.content, whole.calls)
    parts = [whole.reasoning or "", whole.content or "", *(arguments for _, arguments in whole.calls)]
    assert not any(marker in part for marker in MARKERS for part in parts)
