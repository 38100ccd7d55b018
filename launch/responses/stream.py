"""The Responses API's server-sent events, re-framed from the chat path's stream of chunks.

    response.created, response.in_progress                 at once
    output_item.added, reasoning_text.delta, ...           with --reasoning-parser: the reasoning item first
    output_item.added, content_part.added                  at the first text (the message item, index 0)
    output_text.delta                                      per chunk with text
    output_text.done, content_part.done, output_item.done  at the end
    output_item.added, function_call_arguments.delta/.done, output_item.done   per tool call, at the end
    response.completed (or response.incomplete)            the whole Response, with usage

NOTE: the chunks are the chat stream's own (serving.stream), read back from their JSON: one generation
path for both APIs, at the cost of decoding a small JSON object per chunk. With tools in play chat sends
a sample whole when it ends, so its text and calls come at the end here too.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator

from shardserve.launch.openai_api.response_format import ErrorEvent
from shardserve.launch.responses.output import finished, function_call_item, message_item, reasoning_item


class _Numbered:
    """One stream's events, each with the next sequence_number."""

    def __init__(self):
        self.sequence_number = 0

    def __call__(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def response_events(chunks: AsyncGenerator[str, None], head: dict) -> AsyncIterator[str]:
    """`chunks`: chat's SSE events for one choice, with usage; `head`: the Response in progress."""
    event = _Numbered()
    yield event("response.created", response=head)
    yield event("response.in_progress", response=head)
    output = _StreamedOutput(event)
    async with contextlib.aclosing(chunks):  # a client's departure closes chat's stream (its abort) too
        async for chunk in chunks:
            if isinstance(chunk, ErrorEvent):
                yield _error(event, chunk)
                return
            if chunk.startswith("data: [DONE]"):
                break
            for text in output.add(json.loads(chunk.removeprefix("data: "))):
                yield text
    for text in output.finish(head):
        yield text


def _error(event: _Numbered, chunk: ErrorEvent) -> ErrorEvent:
    """Chat's error event as the Responses `error` event. It keeps chat's {"error": {...}} beside the
    Responses fields, so a client reads it as it reads the other endpoints' (the openai SDK raises it)."""
    error = json.loads(chunk.removeprefix("data: "))["error"]
    out = ErrorEvent(event("error", code=error["type"], message=error["message"], param=error["param"],
                           error=error))
    out.outcome = chunk.outcome
    return out


class _StreamedOutput:
    """The output items of one streamed Response, numbered as they open: the reasoning (with a reasoning
    parser) at its first text, the message at its first text; tool calls, which chat sends whole, at the end."""

    def __init__(self, event: _Numbered):
        self.event = event
        self.num_items = 0
        self.reasoning: tuple[str, int] | None = None  # (item id, output index) once opened
        self.reasoning_texts: list[str] = []
        self.message: tuple[str, int] | None = None
        self.texts: list[str] = []
        self.logprobs: list[dict] = []
        self.calls: list[dict] = []
        self.finish_reason: str | None = None
        self.usage: dict | None = None

    def add(self, chunk: dict) -> Iterator[str]:
        self.usage = chunk.get("usage") or self.usage
        for choice in chunk["choices"]:
            delta, logprobs = choice["delta"], (choice.get("logprobs") or {}).get("content") or []
            self.logprobs += logprobs
            self.calls += delta.get("tool_calls") or []
            self.finish_reason = choice["finish_reason"] or self.finish_reason
            if delta.get("reasoning"):
                yield from self._open_reasoning()
                self.reasoning_texts.append(delta["reasoning"])
                item_id, index = self.reasoning  # type: ignore[misc]  # opened just above
                yield self.event("response.reasoning_text.delta", item_id=item_id, output_index=index,
                                 content_index=0, delta=delta["reasoning"])
            if delta.get("content"):
                yield from self._open_message()
                self.texts.append(delta["content"])
                item_id, index = self.message  # type: ignore[misc]
                yield self.event("response.output_text.delta", item_id=item_id, output_index=index,
                                 content_index=0, delta=delta["content"], logprobs=logprobs)

    def _open_reasoning(self) -> Iterator[str]:
        if self.reasoning is None:
            self.reasoning, self.num_items = (f"rs_{uuid.uuid4().hex}", self.num_items), self.num_items + 1
            item = reasoning_item(self.reasoning[0], "", "in_progress")
            part = item["content"].pop()
            yield self.event("response.output_item.added", output_index=self.reasoning[1], item=item)
            yield self.event("response.content_part.added", item_id=self.reasoning[0],
                             output_index=self.reasoning[1], content_index=0, part=part)

    def _open_message(self) -> Iterator[str]:
        if self.message is None:
            self.message, self.num_items = (f"msg_{uuid.uuid4().hex}", self.num_items), self.num_items + 1
            item = message_item(self.message[0], "", [], "in_progress")
            part = item["content"].pop()
            yield self.event("response.output_item.added", output_index=self.message[1], item=item)
            yield self.event("response.content_part.added", item_id=self.message[0], output_index=self.message[1],
                             content_index=0, part=part)

    def finish(self, head: dict) -> Iterator[str]:
        """The items' closing events, then the whole Response. A reply with neither text nor calls is
        an empty message, as in the whole (non-streamed) Response."""
        status = "incomplete" if self.finish_reason == "length" else "completed"
        output = []
        if self.reasoning is not None:
            (item_id, index), text = self.reasoning, "".join(self.reasoning_texts)
            item = reasoning_item(item_id, text, status)
            where = {"item_id": item_id, "output_index": index, "content_index": 0}
            yield self.event("response.reasoning_text.done", **where, text=text)
            yield self.event("response.content_part.done", **where, part=item["content"][0])
            yield self.event("response.output_item.done", output_index=index, item=item)
            output.append(item)
        if not self.calls:
            yield from self._open_message()
        if self.message is not None:
            (item_id, index), text = self.message, "".join(self.texts)
            item = message_item(item_id, text, self.logprobs, status)
            where = {"item_id": item_id, "output_index": index, "content_index": 0}
            yield self.event("response.output_text.done", **where, text=text, logprobs=self.logprobs)
            yield self.event("response.content_part.done", **where, part=item["content"][0])
            yield self.event("response.output_item.done", output_index=index, item=item)
            output.append(item)
        yield from self._calls(output)
        assert self.usage is not None, "chat's stream ends with its usage when asked"
        response = finished(head, output, self.finish_reason, self.usage)
        yield self.event(f"response.{response['status']}", response=response)

    def _calls(self, output: list[dict]) -> Iterator[str]:
        for call in self.calls:
            index, item = len(output), function_call_item(f"fc_{uuid.uuid4().hex}", call)
            yield self.event("response.output_item.added", output_index=index,
                             item=item | {"arguments": "", "status": "in_progress"})
            where = {"item_id": item["id"], "output_index": index}
            yield self.event("response.function_call_arguments.delta", **where, delta=item["arguments"])
            yield self.event("response.function_call_arguments.done", **where, name=item["name"],
                             arguments=item["arguments"])
            yield self.event("response.output_item.done", output_index=index, item=item)
            output.append(item)
