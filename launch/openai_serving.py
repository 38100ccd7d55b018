"""OpenAI endpoints: an API request fans out to prompts; their deltas become responses or SSE."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from shardserve.launch.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                        TokenizeRequest)
from shardserve.launch.replicas import ReplicaSet
from shardserve.launch.response_format import chat_logprobs, completion_logprobs, sse, usage
from shardserve.runtime.input_processor import InvalidPromptError, ProcessedPrompt
from shardserve.runtime.outputs import PromptDelta, RequestOutputBuilder, SampleDelta
from shardserve.runtime.sampling_params import SamplingParams


@dataclass
class PreparedRequest:
    """One API request, ready to run: its prompts as the runtime processed them, and what the
    response needs."""

    kind: str                     # "completion" | "chat"
    request_id: str
    model: str
    prompts: list[ProcessedPrompt]
    params: SamplingParams
    echo_texts: list[str] | None = None  # per prompt, when the completion echoes its prompt
    created: int = field(default_factory=lambda: int(time.time()))

    def prompt_id(self, prompt_index: int) -> str:
        return f"{self.request_id}-{prompt_index}"

    def choice_index(self, prompt_index: int, sample_index: int) -> int:
        return prompt_index * self.params.n + sample_index


@contextmanager
def _as_api_error(prompt_param: str) -> Iterator[None]:
    """The runtime's refusals as 400s; `prompt_param` names the prompt in this endpoint."""
    try:
        yield
    except InvalidPromptError as e:
        raise APIError(400, str(e), prompt_param if e.field == "prompt" else e.field) from None
    except ValueError as e:  # SamplingParams' own checks
        raise APIError(400, str(e)) from None


class OpenAIServing:
    def __init__(self, replicas: ReplicaSet, served_model_name: str):
        self.replicas = replicas
        self.served_model_name = served_model_name

    # ---- API request -> prompts ------------------------------------------------------------
    def check_ready(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                           f"{self.served_model_name!r}", "model", "not_found_error")
        dead = self.replicas.dead_reason()
        if dead:
            raise APIError(503, f"the engine is not running ({dead})",
                           error_type="service_unavailable")

    def prepare_completion(self, body: CompletionRequest) -> PreparedRequest:
        self.check_ready(body.model)
        body.check_extra_fields()
        if body.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if body.best_of not in (None, body.n):
            raise APIError(400, "best_of must equal n (or be left out)", "best_of")
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs (prompt logprobs) is not supported",
                           "logprobs")
        processor = self.replicas.input_processor
        with _as_api_error("prompt"):
            params = body.sampling_params(body.max_tokens, body.logprobs, self.replicas.sampling_defaults)
            prompts = [processor.process(p, params) for p in body.prompts()]
        echo_texts = None
        if body.echo:
            echo_texts = [p.prompt if p.prompt is not None else processor.decode(p.prompt_token_ids)
                          for p in prompts]
        return PreparedRequest("completion", f"cmpl-{uuid.uuid4().hex}", self.served_model_name,
                               prompts, params, echo_texts)

    def tokenize(self, body: TokenizeRequest) -> dict:
        self.check_ready(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", "prompt")
        processor = self.replicas.input_processor
        with _as_api_error("prompt" if body.messages is None else "messages"):
            if body.messages is None:
                ids = processor.tokenize(body.prompt, body.add_special_tokens)
            else:
                text = processor.apply_chat_template(body.conversation(), body.add_generation_prompt)
                ids = processor.tokenize(text, add_special_tokens=False)
        return {"count": len(ids), "max_model_len": processor.max_model_len, "tokens": ids}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_ready(body.model)
        processor = self.replicas.input_processor
        with _as_api_error("tokens"):
            processor.check_token_ids(body.tokens)
        return {"prompt": processor.decode(body.tokens)}

    def prepare_chat(self, body: ChatCompletionRequest) -> PreparedRequest:
        self.check_ready(body.model)
        body.check_extra_fields()
        with _as_api_error("messages"):
            params = body.sampling_params(body.requested_max_tokens(), body.num_logprobs(),
                                          self.replicas.sampling_defaults)
            prompt = self.replicas.input_processor.process_chat(
                body.conversation(), params, body.add_generation_prompt, body.chat_template_kwargs)
        return PreparedRequest("chat", f"chatcmpl-{uuid.uuid4().hex}", self.served_model_name,
                               [prompt], params)

    # ---- running ---------------------------------------------------------------------------
    async def _deltas(self, request: PreparedRequest) -> AsyncIterator[tuple[int, PromptDelta]]:
        """Every prompt's deltas, tagged with the prompt's index, interleaved as they come."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(prompt_index: int, prompt: ProcessedPrompt) -> None:
            try:
                async for delta in self.replicas.generate(prompt, request.params,
                                                          request.prompt_id(prompt_index)):
                    queue.put_nowait((prompt_index, delta))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait(e)
            finally:
                queue.put_nowait(done)

        tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(request.prompts)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise _engine_error(item)
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    async def full_response(self, request: PreparedRequest) -> dict:
        """Accumulate every prompt's deltas, then answer once."""
        builders = [RequestOutputBuilder(request.prompt_id(i), prompt, request.params)
                    for i, prompt in enumerate(request.prompts)]
        async for prompt_index, delta in self._deltas(request):
            builders[prompt_index].add(delta)
        choices, num_completion_tokens = [], 0
        for prompt_index, output in enumerate(b.build() for b in builders):
            echo = request.echo_texts[prompt_index] if request.echo_texts else ""
            for c in output.outputs:
                num_completion_tokens += len(c.token_ids)
                choices.append(_choice(request, request.choice_index(prompt_index, c.index),
                                       echo + c.text, c.token_ids, c.logprobs or [], 0,
                                       c.finish_reason))
        num_prompt_tokens = sum(p.num_prompt_tokens for p in request.prompts)
        obj = "text_completion" if request.kind == "completion" else "chat.completion"
        return {"id": request.request_id, "object": obj, "created": request.created,
                "model": request.model,
                "choices": sorted(choices, key=lambda ch: ch["index"]),
                "usage": usage(num_prompt_tokens, num_completion_tokens)}

    async def stream(self, request: PreparedRequest, include_usage: bool) -> AsyncIterator[str]:
        """SSE events: a chunk per delta with new text (or a finish), a final usage chunk if
        asked, then [DONE]."""
        obj = "text_completion" if request.kind == "completion" else "chat.completion.chunk"
        head = {"id": request.request_id, "object": obj, "created": request.created,
                "model": request.model}
        chunks = _ChunkMapper(request)
        if request.kind == "chat":
            for k in range(request.params.n):
                yield sse({**head, "choices": [{"index": k, "delta": {"role": "assistant",
                                                                      "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
        try:
            async for prompt_index, delta in self._deltas(request):
                for sample in delta.samples:
                    choice = chunks.choice(prompt_index, sample)
                    if choice is not None:
                        yield sse({**head, "choices": [choice]})
        except APIError as e:
            yield sse(e.body())
        else:
            if include_usage:
                num_prompt_tokens = sum(p.num_prompt_tokens for p in request.prompts)
                yield sse({**head, "choices": [],
                           "usage": usage(num_prompt_tokens, chunks.num_completion_tokens)})
        yield "data: [DONE]\n\n"


class _ChunkMapper:
    """Sample deltas -> streamed choices. Tokens whose text is held back (a stop string may be
    forming) wait, with their logprobs, for the next chunk that carries text."""

    def __init__(self, request: PreparedRequest):
        self.request = request
        self.num_completion_tokens = 0
        self.text_offsets: dict[int, int] = {}  # choice index -> text_offset of its next token
        self.waiting: dict[int, tuple[list[int], list[dict]]] = {}  # index -> tokens, logprobs

    def choice(self, prompt_index: int, sample: SampleDelta) -> dict | None:
        request = self.request
        self.num_completion_tokens += len(sample.new_token_ids)
        index = request.choice_index(prompt_index, sample.sample_index)
        token_ids, logprobs = self.waiting.setdefault(index, ([], []))
        token_ids.extend(sample.new_token_ids)
        logprobs.extend(sample.new_logprobs or ())
        if not sample.new_text and sample.finish_reason is None:
            return None
        del self.waiting[index]
        text = sample.new_text
        if request.echo_texts and index not in self.text_offsets:
            text = request.echo_texts[prompt_index] + text
        offset = self.text_offsets.get(index, 0)
        choice = _choice(request, index, text, token_ids, logprobs, offset, sample.finish_reason)
        lp = choice["logprobs"]
        if request.kind == "completion" and lp and lp["tokens"]:
            offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
        self.text_offsets[index] = offset
        if request.kind == "chat":
            choice["delta"] = {"content": text} if text else {}
            del choice["message"]
        return choice


def _choice(request: PreparedRequest, index: int, text: str, token_ids, logprobs,
            text_offset: int, finish: str | None) -> dict:
    k = request.params.logprobs
    if request.kind == "completion":
        lp = completion_logprobs(token_ids, logprobs, k, text_offset) if k is not None else None
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
    lp = chat_logprobs(token_ids, logprobs, k) if k is not None else None
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": lp, "finish_reason": finish}


def _engine_error(error: BaseException) -> Exception:
    if isinstance(error, APIError):
        return error
    if isinstance(error, (ValueError, TypeError)):
        return APIError(400, str(error))
    if isinstance(error, asyncio.CancelledError):
        return error
    return APIError(503, f"the engine failed: {type(error).__name__}: {error}",
                    error_type="service_unavailable")
