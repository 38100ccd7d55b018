"""Split a reasoning model's output into its reasoning (between <think> and </think>) and its answer.

The parsers, named as vLLM's `--reasoning-parser` names them:
    deepseek_r1    the output starts inside the reasoning: everything before </think> is reasoning, and
                   with no </think> (yet), all of it is.
    qwen3          reasoning is optional (chat_template_kwargs.enable_thinking=False turns it off): the
                   output is reasoning only when it opens with <think>, or when the prompt already opened
                   one (newer Qwen chat templates end the generation prompt with "<think>\n").
    openai_gptoss  gpt-oss's harmony channels: analysis is reasoning, final is content (harmony.py).

    output:  [<think>] reasoning ... </think> answer ...
             '------ reasoning ------'        '-- content --'

A stream cannot tell "</thi" from the answer until the next delta comes, so the splitter holds back any
tail that could still become a tag and releases it with the next delta or at the end. A whole output is
split by the same splitter fed once, so streamed and whole answers always agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardserve.launch.openai_api import harmony
from shardserve.launch.openai_api.harmony import HarmonySplitter
from shardserve.planner.settings import BY_NAME

START, END = "<think>", "</think>"
PARSERS: tuple[str, ...] = BY_NAME["reasoning_parser"].choices or ()  # the setting's choices
THINK_PARSERS = tuple(parser for parser in PARSERS if parser != harmony.PARSER)


@dataclass(frozen=True)
class Split:
    reasoning: str | None
    content: str | None
    calls: tuple[tuple[str, str], ...] = ()  # openai_gptoss with tool calls: (function name, arguments)


@dataclass(frozen=True)
class ReasoningMode:
    """How one chat request's output splits: the server's parser, and where the prompt left the output:
    inside <think> (prompt_opens), or in which harmony message (prompt_tail, harmony.prompt_tail)."""

    parser: str
    prompt_opens: bool = False
    prompt_tail: str = ""
    tool_calls: bool = False  # openai_gptoss: messages to functions.NAME are tool calls (--tool-call-parser openai)

    @classmethod
    def for_prompt(cls, parser: str, prompt: str, tool_calls: bool = False) -> ReasoningMode:
        """The split of the output of a rendered prompt (its text with the special tokens)."""
        if parser == harmony.PARSER:
            return cls(parser, prompt_tail=harmony.prompt_tail(prompt), tool_calls=tool_calls)
        return cls(parser, opens_reasoning(prompt))

    @property
    def starts_inside(self) -> bool:
        """Whether the output starts inside the reasoning (a grammar must then wait for its end)."""
        if self.parser == harmony.PARSER:
            return HarmonySplitter(self.prompt_tail).starts_inside_reasoning
        return self.parser == "deepseek_r1" or self.prompt_opens

    @property
    def reasoning_end(self) -> str:
        """The text that ends the reasoning, where a grammar starts when the output starts inside it."""
        return harmony.FINAL_OPENING if self.parser == harmony.PARSER else END

    def split(self, text: str) -> Split:
        """The whole output's reasoning and content (None where there is none), and its tool calls."""
        splitter = self.splitter()
        reasoning, content = splitter.feed(text)
        more_reasoning, more_content = splitter.finish()
        calls = tuple(splitter.calls) if isinstance(splitter, HarmonySplitter) else ()
        return Split((reasoning + more_reasoning) or None, (content + more_content) or None, calls)

    def splitter(self) -> StreamSplitter | HarmonySplitter:
        if self.parser == harmony.PARSER:
            return HarmonySplitter(self.prompt_tail, self.tool_calls)
        return StreamSplitter(self.parser, self.prompt_opens)


def opens_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt leaves a <think> open, so that the output starts inside it."""
    return prompt.rfind(START) > prompt.rfind(END)


def split_reasoning(parser: str, text: str, prompt_opens: bool = False) -> Split:
    """The whole output's reasoning and content (None where there is none)."""
    return ReasoningMode(parser, prompt_opens).split(text)


def _held_back(text: str, tags: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could still grow into one of `tags`."""
    longest = 0
    for tag in tags:
        for size in range(min(len(tag) - 1, len(text)), 0, -1):
            if tag.startswith(text[-size:]):
                longest = max(longest, size)
                break
    return longest


class StreamSplitter:
    """Feed each text delta of one sample; get back (reasoning delta, content delta), either may be ""."""

    def __init__(self, parser: str, prompt_opens: bool = False):
        if parser not in THINK_PARSERS:
            raise ValueError(f"unknown <think> reasoning parser {parser!r} (one of: {', '.join(THINK_PARSERS)})")
        self.is_reasoning = parser == "deepseek_r1" or prompt_opens  # else: only if the output opens <think>
        self.is_at_start = True  # no text released yet: a leading <think> is still to be dropped
        self.is_after_end = False
        self.pending = ""  # text held back: it may be the start of a tag

    def feed(self, delta: str) -> tuple[str, str]:
        text, self.pending = self.pending + delta, ""
        if self.is_after_end:
            return "", text
        if self.is_at_start:
            stripped = text.lstrip()
            if START.startswith(stripped):  # "", "<th": could still be "<think>"
                self.pending = text
                return "", ""
            self.is_at_start = False
            if stripped.startswith(START):
                self.is_reasoning, text = True, stripped[len(START):]
        if not self.is_reasoning:
            return "", text
        head, found, tail = text.partition(END)
        if found:
            self.is_after_end = True
            return head, tail
        keep = _held_back(text, (END,))
        self.pending = text[len(text) - keep:]
        return text[:len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        """What was held back, once the sample has ended."""
        text, self.pending = self.pending, ""
        if self.is_after_end or not self.is_reasoning:
            return "", text
        return text, ""
