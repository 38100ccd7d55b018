"""The OpenAI endpoints' logic: prompts in, engine outputs out as responses or SSE chunks."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from shardserve.launch.protocol import APIError, ChatCompletionRequest, CompletionRequest
from shardserve.launch.replicas import ReplicaSet
from shardserve.launch.response_format import (chat_logprobs, completion_logprobs, sse,
                                               usage)
from shardserve.runtime.outputs import RequestOutput


@dataclass
class _Job:
    """One API request: its prompts (each a runtime request) and what the response needs."""

    kind: str                     # "completion" | "chat"
    request_id: str
    model: str
    prompts: list[dict]           # {"prompt": text or None, "prompt_token_ids": [...]}
    params: object                # SamplingParams
    echo: bool = False
    created: int = field(default_factory=lambda: int(time.time()))


class OpenAIServing:
    def __init__(self, replicas: ReplicaSet, served_model_name: str):
        self.replicas = replicas
        self.served_model_name = served_model_name

    # ---- request preparation -------------------------------------------------------------
    def check_ready(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                           f"{self.served_model_name!r}", "model", "not_found_error")
        dead = self.replicas.dead_reason()
        if dead:
            raise APIError(503, f"the engine is not running ({dead})",
                           error_type="service_unavailable")

    def _tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> dict:
        if isinstance(prompt, str):
            tokenizer = self.replicas.tokenizer
            if tokenizer is None:
                raise APIError(400, "this server has no tokenizer: send token ids", "prompt")
            ids = tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids
            return {"prompt": prompt, "prompt_token_ids": ids}
        vocab = self.replicas.vocab_size
        if not prompt or any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be non-empty and in [0, {vocab})",
                           "prompt")
        return {"prompt": None, "prompt_token_ids": list(prompt)}

    def _max_tokens(self, requested: int | None, prompt_len: int, field_name: str) -> int:
        limit = self.replicas.max_model_len
        if prompt_len == 0:
            raise APIError(400, "the prompt is empty", "prompt")
        if requested is None:
            if prompt_len >= limit:
                raise APIError(400, f"the prompt has {prompt_len} tokens; this model's maximum "
                               f"context length is {limit}", "messages")
            return limit - prompt_len
        if prompt_len + requested > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens, but "
                           f"the request asks for {prompt_len + requested} ({prompt_len} in the "
                           f"prompt, {requested} to generate): shorten the prompt or lower "
                           f"{field_name}", field_name)
        return requested

    def completion_job(self, req: CompletionRequest) -> _Job:
        self.check_ready(req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if req.best_of not in (None, req.n):
            raise APIError(400, "best_of must equal n (or be left out)", "best_of")
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo with logprobs (prompt logprobs) is not supported",
                           "logprobs")
        prompts = [self._tokenize(p) for p in req.prompts()]
        longest = max(len(p["prompt_token_ids"]) for p in prompts)
        max_tokens = self._max_tokens(req.max_tokens, longest, "max_tokens")
        return _Job("completion", f"cmpl-{uuid.uuid4().hex}", self.served_model_name, prompts,
                    req.sampling_params(max_tokens, req.logprobs), echo=req.echo)

    def chat_job(self, req: ChatCompletionRequest) -> _Job:
        self.check_ready(req.model)
        tokenizer = self.replicas.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template: use /v1/completions",
                           "messages")
        try:
            text = tokenizer.apply_chat_template(
                req.conversation(), tokenize=False,
                add_generation_prompt=req.add_generation_prompt,
                **(req.chat_template_kwargs or {}))
        except Exception as e:  # jinja's errors (raise_exception in templates) are the client's
            raise APIError(400, f"the chat template rejected the messages: {e}",
                           "messages") from None
        prompt = self._tokenize(text, add_special_tokens=False)
        max_tokens = self._max_tokens(req.requested_max_tokens(),
                                      len(prompt["prompt_token_ids"]), "max_tokens")
        return _Job("chat", f"chatcmpl-{uuid.uuid4().hex}", self.served_model_name, [prompt],
                    req.sampling_params(max_tokens, req.num_logprobs()))

    # ---- running ---------------------------------------------------------------------------
    async def _outputs(self, job: _Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every prompt's cumulative outputs, interleaved as they come."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, prompt: dict) -> None:
            try:
                async for out in self.replicas.generate(prompt, job.params,
                                                        f"{job.request_id}-{i}"):
                    queue.put_nowait((i, out))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait(e)
            finally:
                queue.put_nowait(done)

        tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(job.prompts)]
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

    async def full_response(self, job: _Job) -> dict:
        final: dict[int, RequestOutput] = {}
        async for i, out in self._outputs(job):
            final[i] = out
        results = [final[i] for i in range(len(job.prompts))]
        choices = []
        for i, res in enumerate(results):
            for c in res.outputs:
                index = i * job.params.n + c.index
                choices.append(self._choice(job, res, c, index, c.text, c.token_ids,
                                            c.logprobs or [], 0, c.finish_reason))
        body = {"id": job.request_id, "object": "text_completion" if job.kind == "completion"
                else "chat.completion", "created": job.created, "model": job.model,
                "choices": sorted(choices, key=lambda ch: ch["index"]),
                "usage": usage(results)}
        return body

    def _choice(self, job, res, c, index, text, token_ids, logprobs, offset, finish) -> dict:
        tokenizer = self.replicas.tokenizer
        if job.kind == "completion":
            if job.echo and offset == 0:
                text = _prompt_text(res, tokenizer) + text
            lp = (completion_logprobs(token_ids, logprobs, job.params.logprobs, tokenizer,
                                      offset) if job.params.logprobs is not None else None)
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        lp = (chat_logprobs(token_ids, logprobs, job.params.logprobs, tokenizer)
              if job.params.logprobs is not None else None)
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": lp, "finish_reason": finish}

    async def stream(self, job: _Job, include_usage: bool) -> AsyncIterator[str]:
        """SSE events: a chunk per new text, a final usage chunk if asked, then [DONE]."""
        obj = "text_completion" if job.kind == "completion" else "chat.completion.chunk"
        head = {"id": job.request_id, "object": obj, "created": job.created, "model": job.model}
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        final: dict[int, RequestOutput] = {}
        if job.kind == "chat":
            for k in range(job.params.n):
                yield sse({**head, "choices": [{"index": k, "delta": {"role": "assistant",
                                                                      "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
        try:
            async for i, res in self._outputs(job):
                final[i] = res
                for c in res.outputs:
                    index = i * job.params.n + c.index
                    t0, n0 = sent_text.get(index, 0), sent_tokens.get(index, 0)
                    delta, new_ids = c.text[t0:], c.token_ids[n0:]
                    if not delta and c.finish_reason is None:
                        continue  # text held back (a stop string may be forming): wait
                    sent_text[index], sent_tokens[index] = len(c.text), len(c.token_ids)
                    choice = self._choice(job, res, c, index, delta, new_ids,
                                          (c.logprobs or [])[n0:], t0 if n0 else 0,
                                          c.finish_reason)
                    if job.kind == "chat":
                        choice["delta"] = {"content": delta} if delta else {}
                        del choice["message"]
                    yield sse({**head, "choices": [choice]})
        except APIError as e:
            yield sse(e.body())
        else:
            if include_usage:
                results = [final[i] for i in sorted(final)]
                yield sse({**head, "choices": [], "usage": usage(results)})
        yield "data: [DONE]\n\n"


def _prompt_text(res: RequestOutput, tokenizer) -> str:
    if res.prompt is not None:
        return res.prompt
    return tokenizer.decode(res.prompt_token_ids) if tokenizer is not None else ""


def _engine_error(error: BaseException) -> Exception:
    if isinstance(error, APIError):
        return error
    if isinstance(error, (ValueError, TypeError)):
        return APIError(400, str(error))
    if isinstance(error, asyncio.CancelledError):
        return error
    return APIError(503, f"the engine failed: {type(error).__name__}: {error}",
                    error_type="service_unavailable")
