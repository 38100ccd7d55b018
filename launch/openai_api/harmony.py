"""gpt-oss's harmony format (--reasoning-parser openai_gptoss): the output is a run of messages, each a header
naming its channel (and, for a tool call, its recipient) and a body; the prompt ends with "<|start|>assistant".

    <|channel|>analysis<|message|>steps<|end|><|start|>assistant<|channel|>final<|message|>answer<|return|>
    '------ header -----'         '-body'                       '------ header -----'         '-body-'

    analysis            the chain of thought: reasoning
    final, commentary   what the user reads: content (commentary without a recipient is a preamble to calls)
    to=functions.NAME   with --tool-call-parser openai, a tool call whose body is its JSON arguments; without
                        it, routed by its channel like any other message

The markers are special tokens, which a detokenizer drops by default: a request served with this parser keeps
them in its text (SamplingParams.kept_special_token_ids) and the splitter consumes them, so none reaches the
reasoning or the content. NOTE: the split reads that text, not token ids, so it streams as the <think>
parsers do (a tail that may grow into a marker is held back) and honours stop strings as the text has them;
the openai-harmony package parses token ids but fetches its vocabulary from the internet at first use.

An output that writes, where a header belongs, text that no header starts with (no marker, no "to=") is
plain text: content.
"""

from __future__ import annotations

import re

PARSER = "openai_gptoss"  # vLLM's name for it
START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
FINAL_OPENING = CHANNEL + "final" + MESSAGE  # a request's grammar waits for it when the prompt opened analysis
FUNCTIONS = "functions."  # the namespace of the request's tools in a recipient

_MARKER = re.compile("|".join(re.escape(marker) for marker in MARKERS))
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_RECIPIENT = re.compile(r"(?:^|\s|>)to=([^\s<]+)")
# what may stand between <|start|> and a header's first marker: a role, a recipient (or a beginning of one)
_ROLE_PART = re.compile(r"\s*(?:[\w.-]+\s*)?(?:(?:t|to|to=[^\s<]*)\s*)?")
REASONING, CONTENT, TOOL_CALL = "reasoning", "content", "call"  # where a message's body goes


def prompt_tail(prompt: str) -> str:
    """The prompt from its last <|start|>: the message (its header, or its body) that the output continues."""
    where = prompt.rfind(START)
    return prompt[where:] if where >= 0 else ""


def marker_ids(tokenizer) -> tuple[int, ...]:
    """The ids of the markers that are tokens of `tokenizer` (gpt-oss's: 200002 to 200012)."""
    ids = tokenizer.convert_tokens_to_ids(list(MARKERS))
    return tuple(i for marker, i in zip(MARKERS, ids) if i is not None and tokenizer.convert_ids_to_tokens(i) == marker)


def _partial_marker(text: str) -> int:
    """How many characters at the end of `text` could still grow into a marker (every marker starts with
    "<", and has no other)."""
    where = text.rfind("<")
    return len(text) - where if where >= 0 and any(m.startswith(text[where:]) for m in MARKERS) else 0


class HarmonySplitter:
    """Feed each text delta of one sample; get back (reasoning delta, content delta), either may be "". With
    `tool_calls`, the bodies of messages to functions.NAME collect in `calls` as (NAME, arguments)."""

    def __init__(self, prompt_tail: str = "", tool_calls: bool = False):
        self.tool_calls = tool_calls
        self.header = ""  # the open header's text, markers and the prompt's part included
        self.held = ""  # the output's text in the open header: content if it proves to be no header
        self.route: str | None = None  # in a body: where it goes (REASONING, CONTENT, TOOL_CALL); None: a header
        self.pending = ""  # a tail that may be the start of a marker
        self.written: set[str] = set()  # the routes with text so far
        self.separate = False  # the body is a new message of a route with text: "\n" before its first text
        self.call_name, self.call_args = "", list[str]()  # the open call's
        self.calls: list[tuple[str, str]] = []
        self.feed(prompt_tail)  # where the prompt leaves off: what it wrote is not output
        self.held, self.pending, self.written, self.separate = "", "", set(), False
        self.call_args, self.calls = [], []

    @property
    def starts_inside_reasoning(self) -> bool:
        return self.route == REASONING

    def feed(self, delta: str) -> tuple[str, str]:
        text, self.pending = self.pending + delta, ""
        out: dict[str, list[str]] = {REASONING: [], CONTENT: []}
        where = 0
        for found in _MARKER.finditer(text):
            self._text(text[where:found.start()], out)
            self._marker(found.group(), out)
            where = found.end()
        rest = text[where:]
        keep = _partial_marker(rest)
        self._text(rest[:len(rest) - keep], out)
        self.pending = rest[len(rest) - keep:]
        return "".join(out[REASONING]), "".join(out[CONTENT])

    def finish(self) -> tuple[str, str]:
        """What was held back, once the sample has ended: a header never closed by <|message|> is dropped,
        unless the output wrote no marker in it (its text is then content); a call cut short is kept."""
        out: dict[str, list[str]] = {REASONING: [], CONTENT: []}
        text, self.pending = self.pending, ""
        self._text(text, out)
        if self.route is None and self.held.strip() and not self._is_marked():
            self._plain(out)
        self._close()
        return "".join(out[REASONING]), "".join(out[CONTENT])

    def _is_marked(self) -> bool:
        return CHANNEL in self.header or CONSTRAIN in self.header

    def _text(self, text: str, out: dict[str, list[str]]) -> None:
        if not text:
            return
        if self.route is not None:
            self._write(text, out)
            return
        self.header, self.held = self.header + text, self.held + text
        if not self._is_marked() and not _ROLE_PART.fullmatch(self.header):
            self._plain(out)  # no header starts so

    def _plain(self, out: dict[str, list[str]]) -> None:
        """The open header's text is plain text: content."""
        text = self.held
        self._open(CONTENT)
        self._write(text, out)

    def _marker(self, marker: str, out: dict[str, list[str]]) -> None:
        if marker == MESSAGE:
            if self.route is None:  # else a stray marker in a body: dropped
                self._open(self._header_route())
        elif marker in (CHANNEL, CONSTRAIN):
            if self.route is not None:  # a new header without <|end|><|start|>assistant, as gpt-oss may write
                self._close()
            self.header += marker
        else:  # START, END, RETURN, CALL: the message (or the header) is over
            self._close()

    def _header_route(self) -> str:
        recipient = _RECIPIENT.search(self.header)
        if self.tool_calls and recipient and recipient.group(1).startswith(FUNCTIONS):
            self.call_name, self.call_args = recipient.group(1)[len(FUNCTIONS):], []
            return TOOL_CALL
        channel = _CHANNEL_NAME.search(self.header)
        return REASONING if channel and channel.group(1) == "analysis" else CONTENT

    def _open(self, route: str) -> None:
        self.route, self.held = route, ""
        self.separate = route in self.written

    def _write(self, text: str, out: dict[str, list[str]]) -> None:
        if self.route == TOOL_CALL:
            self.call_args.append(text)
            return
        assert self.route is not None  # _write serves an open body
        if self.separate:
            text, self.separate = "\n" + text, False
        self.written.add(self.route)
        out[self.route].append(text)

    def _close(self) -> None:
        if self.route == TOOL_CALL:
            self.calls.append((self.call_name, "".join(self.call_args).strip()))
        self.route, self.header, self.held = None, "", ""
