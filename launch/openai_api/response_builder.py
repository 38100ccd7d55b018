"""A prepared request's deltas as OpenAI responses: one JSON body when all are in, or SSE chunks as they come."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

from shardserve.launch.server.api_error import APIError
from shardserve.launch.openai_api.prepared_request import PreparedRequest
from shardserve.launch.openai_api.harmony import HarmonySplitter
from shardserve.launch.openai_api.reasoning import StreamSplitter
from shardserve.launch.openai_api.response_format import (chat_logprobs, completion_logprobs, error_event, prompt_logprobs_json,
                                               sse, usage)
from shardserve.launch.openai_api.tool_calls import ToolPlan, extract_calls, finish_reason
from shardserve.runtime.outputs import CompletionOutput, PromptDelta, RequestOutput, RequestOutputBuilder, SampleDelta

Deltas = AsyncIterator[tuple[int, PromptDelta]]  # (prompt index, delta), every prompt's, as they come


def _usage(request: PreparedRequest, num_completion_tokens: int, num_cached_tokens: int | None) -> dict:
    details = request.options.prompt_tokens_details
    return usage(request.num_prompt_tokens, num_completion_tokens, (num_cached_tokens or 0) if details else None)


async def full_response(request: PreparedRequest, deltas: Deltas) -> dict:
    """Accumulate every prompt's deltas, then answer once."""
    builders = [RequestOutputBuilder(request.prompt_id(i), prompt, request.params)
                for i, prompt in enumerate(request.prompts)]
    async for prompt_index, delta in deltas:
        builders[prompt_index].add(delta)
    outputs = [b.build() for b in builders]
    choices = [_full_choice(request, i, output, c) for i, output in enumerate(outputs) for c in output.outputs]
    num_completion_tokens = sum(len(c.token_ids) for output in outputs for c in output.outputs)
    num_cached = sum(output.num_cached_tokens or 0 for output in outputs)
    obj = "text_completion" if request.kind == "completion" else "chat.completion"
    response = {"id": request.request_id, "object": obj, "created": request.created, "model": request.model,
                "choices": sorted(choices, key=lambda ch: ch["index"]),
                "usage": _usage(request, num_completion_tokens, num_cached)}
    if request.kind == "chat":  # vLLM's: the one prompt's logprobs and ids at the top
        response["prompt_logprobs"] = (None if request.prompt_logprobs is None
                                       else prompt_logprobs_json(outputs[0].prompt_logprobs))
        if request.options.return_token_ids:
            response["prompt_token_ids"] = outputs[0].prompt_token_ids
    return response


def _full_choice(request: PreparedRequest, prompt_index: int, output: RequestOutput, c: CompletionOutput) -> dict:
    echo = request.echo_texts[prompt_index] if request.echo_texts else ""
    token_ids, logprobs = c.token_ids, list[dict | None](c.logprobs or [])
    first_text = None
    if request.first_token_texts is not None:  # the echoed prompt's tokens lead, the first unscored
        token_ids = output.prompt_token_ids + token_ids
        logprobs = list(output.prompt_logprobs or []) + logprobs
        first_text = request.first_token_texts[prompt_index]
    choice, _ = _choice(request, request.choice_index(prompt_index, c.index), echo + c.text, token_ids,
                        logprobs, 0, c.finish_reason, first_text)
    choice["stop_reason"] = c.stop_reason  # vLLM's: the stop string or stop token id that ended it, else null
    if request.kind == "completion":  # vLLM's: per choice, null when not asked
        choice["prompt_logprobs"] = (None if request.prompt_logprobs is None
                                     else prompt_logprobs_json(output.prompt_logprobs))
    text, harmony_calls = c.text, tuple[tuple[str, str], ...]()
    if request.reasoning is not None:  # the reasoning leaves the content; tool calls are found in the rest
        split = request.reasoning.split(c.text)
        text, harmony_calls = split.content or "", split.calls
        choice["message"] |= {"content": split.content, **_reasoning_fields(split.reasoning)}
    if request.tool_plan is not None:
        _with_tool_calls(choice, request.tool_plan, text, harmony_calls)
    if request.echo_message:
        choice["message"]["content"] = request.echo_message + (choice["message"]["content"] or "")
    if request.options.return_token_ids:
        choice["token_ids"] = list(c.token_ids)
        if request.kind == "completion":
            choice["prompt_token_ids"] = output.prompt_token_ids
    return choice


def _reasoning_fields(reasoning: str | None) -> dict:
    """vLLM's names for a message's reasoning: `reasoning`, and `reasoning_content` as it was first called."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


def _with_tool_calls(choice: dict, plan: ToolPlan, text: str, harmony_calls: tuple[tuple[str, str], ...]) -> None:
    """A chat choice's message with the tool calls found in (or sampled as) its text, or split off as harmony
    messages."""
    content, calls = extract_calls(plan, text, harmony_calls)
    if calls:
        choice["message"] = choice["message"] | {"content": content, "tool_calls": calls}
    choice["finish_reason"] = finish_reason(plan, choice["finish_reason"], bool(calls))


def _choice(request: PreparedRequest, index: int, text: str, token_ids, logprobs, text_offset: int,
            finish: str | None, first_text: str | None = None) -> tuple[dict, int]:
    """A choice in the endpoint's shape, and (completions) the text offset after its logprob tokens."""
    k, as_ids = request.params.logprobs, request.options.tokens_as_ids
    if request.kind == "completion":
        lp, end = None, text_offset
        if k is not None:
            lp, end = completion_logprobs(token_ids, logprobs, k, text_offset, first_text, as_ids)
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}, end
    lp = chat_logprobs(token_ids, logprobs, k, as_ids) if k is not None else None
    return {"index": index, "message": {"role": request.role, "content": text},
            "logprobs": lp, "finish_reason": finish}, text_offset


class _StreamUsage:
    """The usage a stream reports: on its last chunk when asked, and on every chunk with continuous usage."""

    def __init__(self, request: PreparedRequest):
        self.request = request
        self.num_completion_tokens = 0
        self.num_cached: dict[int, int] = {}  # prompt index -> prompt tokens the prefix cache served

    def add(self, prompt_index: int, sample: SampleDelta) -> None:
        self.num_completion_tokens += len(sample.new_token_ids)
        if sample.num_cached_tokens is not None and sample.sample_index == 0:
            self.num_cached[prompt_index] = sample.num_cached_tokens

    def now(self) -> dict:
        return _usage(self.request, self.num_completion_tokens, sum(self.num_cached.values()))

    def on_chunk(self, chunk: dict) -> dict:
        return chunk | {"usage": self.now()} if self.request.options.continuous_usage else chunk


async def stream_events(request: PreparedRequest, deltas: Deltas) -> AsyncGenerator[str, None]:
    """SSE events: a chunk per delta with new text (or a finish), a final usage chunk if asked, then [DONE]."""
    obj = "text_completion" if request.kind == "completion" else "chat.completion.chunk"
    head = {"id": request.request_id, "object": obj, "created": request.created, "model": request.model}
    meter = _StreamUsage(request)
    if request.tool_plan is not None:
        async for event in _stream_tool_calls(request, deltas, head):
            yield event
        return
    for chunk in _opening_chunks(request, head):
        yield sse(meter.on_chunk(chunk))
    chunks = _ChunkMapper(request)
    try:
        async for prompt_index, delta in deltas:
            for sample in delta.samples:
                meter.add(prompt_index, sample)
                choice = chunks.choice(prompt_index, sample)
                if choice is not None:
                    yield sse(meter.on_chunk({**head, "choices": [choice]}))
    except APIError as e:
        yield error_event(e)
    else:
        if request.options.include_usage:
            yield sse({**head, "choices": [], "usage": meter.now()})
    yield "data: [DONE]\n\n"


def _opening_chunks(request: PreparedRequest, head: dict) -> list[dict]:
    """A chat stream opens each choice with its role (and, as vLLM, the prompt's ids when asked), then the
    echoed last message when echo asks for one."""
    if request.kind != "chat":
        return []
    ids = {"prompt_token_ids": list(request.prompts[0].prompt_token_ids)} if request.options.return_token_ids else {}
    opening = [{**head, "choices": [{"index": k, "delta": {"role": request.role, "content": ""}, "logprobs": None,
                                     "finish_reason": None}], **ids} for k in range(request.params.n)]
    if request.echo_message:
        opening += [{**head, "choices": [{"index": k, "delta": {"content": request.echo_message}, "logprobs": None,
                                          "finish_reason": None}]} for k in range(request.params.n)]
    return opening


async def _stream_tool_calls(request: PreparedRequest, deltas: Deltas, head: dict) -> AsyncIterator[str]:
    """NOTE: with tools in play a sample is parsed whole, so its chunk comes when it finishes: the
    content or the tool calls (each with its index), then the finish reason."""
    try:
        full = await full_response(request, deltas)
    except APIError as e:
        yield error_event(e)
        yield "data: [DONE]\n\n"
        return
    continuous = {"usage": full["usage"]} if request.options.continuous_usage else {}
    ids = {"prompt_token_ids": full["prompt_token_ids"]} if request.options.return_token_ids else {}
    for choice in full["choices"]:
        message = choice["message"]
        delta = {"role": message["role"], "content": message.get("content")}
        if "reasoning" in message:
            delta |= _reasoning_fields(message["reasoning"])
        if message.get("tool_calls"):
            delta["tool_calls"] = [call | {"index": i} for i, call in enumerate(message["tool_calls"])]
        extra = {"token_ids": choice["token_ids"]} if "token_ids" in choice else {}
        yield sse({**head, "choices": [{"index": choice["index"], "delta": delta, "logprobs": None,
                                        "finish_reason": choice["finish_reason"], "stop_reason": choice["stop_reason"],
                                        **extra}], **ids, **continuous})
    if request.options.include_usage:
        yield sse({**head, "choices": [], "usage": full["usage"]})
    yield "data: [DONE]\n\n"


class _ChunkMapper:
    """Sample deltas -> streamed choices. Tokens whose text is held back (a stop string may be
    forming) wait, with their logprobs, for the next chunk that carries text."""

    def __init__(self, request: PreparedRequest):
        self.request = request
        self.text_offsets: dict[int, int] = {}  # choice index -> text_offset of its next token
        # choice index -> (tokens its logprobs score, their logprobs, new output tokens) not yet sent
        self.waiting: dict[int, tuple[list[int], list[dict | None], list[int]]] = {}
        # choice index -> its reasoning split, with a parser
        self.splitters: dict[int, StreamSplitter | HarmonySplitter] = {}

    def choice(self, prompt_index: int, sample: SampleDelta) -> dict | None:
        request = self.request
        index = request.choice_index(prompt_index, sample.sample_index)
        is_first = index not in self.text_offsets
        if index not in self.waiting and is_first and request.first_token_texts is not None:
            # echo with logprobs: the prompt's tokens lead, the first unscored; its scores arrive first
            self.waiting[index] = (list(request.prompts[prompt_index].prompt_token_ids), [None], [])
        scored_ids, logprobs, new_ids = self.waiting.setdefault(index, ([], [], []))
        if request.first_token_texts is not None:
            logprobs.extend(sample.new_prompt_logprobs or ())
        scored_ids.extend(sample.new_token_ids)
        new_ids.extend(sample.new_token_ids)
        logprobs.extend(sample.new_logprobs or ())
        if not sample.new_text and sample.finish_reason is None:
            return None
        del self.waiting[index]
        text = sample.new_text
        if request.echo_texts and is_first:
            text = request.echo_texts[prompt_index] + text
        first_text = request.first_token_texts[prompt_index] if request.first_token_texts and is_first else None
        choice, self.text_offsets[index] = _choice(request, index, text, scored_ids, logprobs,
                                                   self.text_offsets.get(index, 0), sample.finish_reason, first_text)
        if sample.finish_reason is not None:
            choice["stop_reason"] = sample.stop_reason
        if request.options.return_token_ids:
            choice["token_ids"] = new_ids
            if request.kind == "completion" and is_first:
                choice["prompt_token_ids"] = list(request.prompts[prompt_index].prompt_token_ids)
        if request.kind == "chat":
            choice["delta"] = self._chat_delta(index, text, sample.finish_reason is not None)
            del choice["message"]
        return choice

    def _chat_delta(self, index: int, text: str, is_last: bool) -> dict:
        """A chat chunk's delta: its text, or with a reasoning parser, the text split into reasoning and content."""
        if self.request.reasoning is None:
            return {"content": text} if text else {}
        splitter = self.splitters.setdefault(index, self.request.reasoning.splitter())
        reasoning, content = splitter.feed(text)
        if is_last:
            more_reasoning, more_content = splitter.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return ({"content": content} if content else {}) | (_reasoning_fields(reasoning) if reasoning else {})
