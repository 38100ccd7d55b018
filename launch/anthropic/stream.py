"""Anthropic's Messages server-sent events, re-framed from the chat path's stream of chunks.

    message_start (the Message, no content, input tokens), ping     at once
    content_block_start, thinking_delta ...                         with --reasoning-parser: the reasoning first
    content_block_start, text_delta ...                             at the first text
    content_block_start, input_json_delta                           per tool call (chat sends them whole)
    content_block_stop                                              each block, before the next one starts
    message_delta (stop_reason, stop_sequence, usage), message_stop at the end

An error after the stream has started ends it with Anthropic's `error` event. As for the Responses API,
the chunks are chat's own (serving.stream) read back from their JSON: one generation path for every API.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Iterator

from shardserve.launch.anthropic.output import (error_body, stop_reason, text_block, thinking_block,
                                                tool_use_block)
from shardserve.launch.openai_api.response_format import ErrorEvent


def event(kind: str, **fields) -> str:
    payload = {"type": kind, **fields}
    return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def message_events(chunks: AsyncGenerator[str, None], head: dict, num_prompt_tokens: int,
                         stop_sequences: tuple[str, ...]) -> AsyncIterator[str]:
    """`chunks`: chat's SSE events for one choice, with usage; `head`: the Message's id, type, role, model."""
    yield event("message_start", message=head | {"content": [], "stop_reason": None, "stop_sequence": None,
                                                 "usage": {"input_tokens": num_prompt_tokens, "output_tokens": 0}})
    yield event("ping")
    blocks = _Blocks()
    async with contextlib.aclosing(chunks):  # a client's departure closes chat's stream (its abort) too
        async for chunk in chunks:
            if isinstance(chunk, ErrorEvent):
                yield _error(chunk)
                return
            if chunk.startswith("data: [DONE]"):
                break
            for text in blocks.add(json.loads(chunk.removeprefix("data: "))):
                yield text
    for text in blocks.finish(stop_sequences):
        yield text


def _error(chunk: ErrorEvent) -> ErrorEvent:
    """Chat's error event as Anthropic's `error` event (the anthropic SDK raises it by its status)."""
    error = json.loads(chunk.removeprefix("data: "))["error"]
    out = ErrorEvent(event("error", error=error_body(error["code"], error["message"])["error"]))
    out.outcome = chunk.outcome
    return out


class _Blocks:
    """The content blocks of one streamed Message, indexed as they open; one is open at a time."""

    def __init__(self) -> None:
        self.num_blocks = 0
        self.open: str | None = None  # the type of the block open now (index num_blocks - 1)
        self.has_tool_use = False
        self.finish_reason: str | None = None
        self.matched: int | str | None = None  # chat's stop_reason: the stop string or token id that ended it
        self.usage: dict | None = None

    def add(self, chunk: dict) -> Iterator[str]:
        self.usage = chunk.get("usage") or self.usage
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if choice["finish_reason"] is not None:
                self.finish_reason, self.matched = choice["finish_reason"], choice.get("stop_reason")
            if delta.get("reasoning"):
                yield from self._delta(thinking_block(""), {"type": "thinking_delta", "thinking": delta["reasoning"]})
            if delta.get("content"):
                yield from self._delta(text_block(""), {"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or ():
                yield from self._tool_use(call)

    def _delta(self, block: dict, delta: dict) -> Iterator[str]:
        """`delta` to the open block of `block`'s type, opening it (and closing another) first if needed."""
        if self.open != block["type"]:
            yield from self._start(block)
        yield event("content_block_delta", index=self.num_blocks - 1, delta=delta)

    def _start(self, block: dict) -> Iterator[str]:
        yield from self._stop()
        self.open, self.num_blocks = block["type"], self.num_blocks + 1
        yield event("content_block_start", index=self.num_blocks - 1, content_block=block)

    def _stop(self) -> Iterator[str]:
        if self.open is not None:
            yield event("content_block_stop", index=self.num_blocks - 1)
            self.open = None

    def _tool_use(self, call: dict) -> Iterator[str]:
        """A tool call as a tool_use block whose input comes as one input_json_delta; a call cut short (its
        arguments not yet an object) as text, as in the whole Message."""
        block = tool_use_block(call)
        if block is None:
            yield from self._delta(text_block(""), {"type": "text_delta", "text": call["function"]["arguments"]})
            return
        self.has_tool_use = True
        yield from self._start(block | {"input": {}})
        yield event("content_block_delta", index=self.num_blocks - 1,
                    delta={"type": "input_json_delta", "partial_json": call["function"]["arguments"]})
        yield from self._stop()

    def finish(self, stop_sequences: tuple[str, ...]) -> Iterator[str]:
        yield from self._stop()
        assert self.usage is not None, "chat's stream ends with its usage when asked"
        reason, sequence = stop_reason(self.finish_reason, self.matched, self.has_tool_use, stop_sequences)
        yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                    usage={"input_tokens": self.usage["prompt_tokens"], "output_tokens": self.usage["completion_tokens"]})
        yield event("message_stop")
