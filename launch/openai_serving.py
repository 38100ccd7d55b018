"""OpenAI endpoints: an API request fans out to prompts; their deltas become responses or SSE."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from shardserve.launch.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                        TokenizeRequest)
from shardserve.launch.replicas import ReplicaSet, public_message
from shardserve.launch.tool_calls import ToolCallError, ToolPlan, extract_calls, plan_tools, template_messages
from shardserve.launch.response_format import (chat_logprobs, completion_logprobs, error_event, prompt_logprobs_json,
                                               sse, usage)
from shardserve.planner.settings import BY_NAME
from shardserve.runtime.input_processor import InvalidPromptError, ProcessedPrompt
from shardserve.runtime.outputs import PromptDelta, RequestOutputBuilder, SampleDelta
from shardserve.runtime.sampling_params import SamplingParams

logger = logging.getLogger("shardserve.launch.serving")


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
    # per prompt, the text of its first token, when echo comes with logprobs (that token has no score)
    first_token_texts: list[str] | None = None
    prompt_logprobs: int | None = None  # vLLM's extra: the choices carry the prompt's logprobs
    tool_plan: ToolPlan | None = None  # a chat request whose tools are in play
    grammar_param: str | None = None  # the field that asked for params.structured_outputs, for errors
    created: int = field(default_factory=lambda: int(time.time()))

    def prompt_id(self, prompt_index: int) -> str:
        return f"{self.request_id}-{prompt_index}"

    def choice_index(self, prompt_index: int, sample_index: int) -> int:
        return prompt_index * self.params.n + sample_index


@contextmanager
def _as_api_error(prompt_param: str, structured_param: str | None = None) -> Iterator[None]:
    """The runtime's refusals as 400s; `prompt_param` names the prompt in this endpoint and
    `structured_param` the field that asked for a grammar."""
    try:
        yield
    except InvalidPromptError as e:
        names = {"prompt": prompt_param, "response_format": structured_param or "response_format"}
        raise APIError(400, str(e), names.get(e.field, e.field)) from None
    except ValueError as e:  # SamplingParams' own checks (InvalidSamplingParamsError names its field)
        raise APIError(400, str(e), getattr(e, "field", None)) from None


class OpenAIServing:
    def __init__(self, replicas: ReplicaSet, served_model_name: str, tool_call_parser: str | None = None,
                 enable_auto_tool_choice: bool = False,
                 grammar_compile_timeout: float = BY_NAME["grammar_compile_timeout"].default,
                 trust_request_chat_template: bool = BY_NAME["trust_request_chat_template"].default):
        self.replicas = replicas
        self.served_model_name = served_model_name
        self.tool_call_parser, self.enable_auto_tool_choice = tool_call_parser, enable_auto_tool_choice
        self.grammar_compile_timeout = grammar_compile_timeout
        self.trust_request_chat_template = trust_request_chat_template

    # ---- API request -> prompts ------------------------------------------------------------
    def check_ready(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                           f"{self.served_model_name!r}", "model", "not_found_error")
        dead = self.replicas.public_dead_reason()
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
        if body.stream and body.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs is not supported with stream: use echo with logprobs",
                           "prompt_logprobs")
        scored = body.echo and body.logprobs is not None  # the echoed prompt comes with its logprobs
        processor = self.replicas.input_processor
        with _as_api_error("prompt", body.structured_field):
            wanted = max(body.prompt_logprobs or 0, body.logprobs or 0) if scored else body.prompt_logprobs
            params = body.sampling_params(body.max_tokens, body.logprobs, self.replicas.sampling_defaults, wanted)
            prompts = [processor.process(p, params) for p in body.prompts()]
        echo_texts = first_texts = None
        if body.echo:
            echo_texts = [p.prompt if p.prompt is not None else processor.decode(p.prompt_token_ids)
                          for p in prompts]
        if scored:
            first_texts = [processor.decode(p.prompt_token_ids[:1]) for p in prompts]
        return PreparedRequest("completion", f"cmpl-{uuid.uuid4().hex}", self.served_model_name,
                               prompts, params, echo_texts, first_texts, body.prompt_logprobs,
                               grammar_param=body.structured_field)

    def tokenize(self, body: TokenizeRequest) -> dict:
        self.check_ready(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", "prompt")
        processor = self.replicas.input_processor
        with _as_api_error("prompt" if body.messages is None else "messages"):
            if body.prompt is not None:
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
        if body.stream and body.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs is not supported with stream", "prompt_logprobs")
        processor = self.replicas.input_processor
        tools, tool_choice = body.tool_request()
        try:
            plan = plan_tools(tools, tool_choice, self.tool_call_parser, self.enable_auto_tool_choice,
                              body.parallel_tool_calls is not False)
            conversation = template_messages(body.conversation())
        except ToolCallError as e:
            raise APIError(400, str(e), e.field) from None
        kwargs = self._template_kwargs(body)
        self._check_template_renders(conversation, plan, kwargs.get("chat_template"))
        kwargs |= ({"tools": tools} if plan else {})
        grammar_param = "tool_choice" if plan and plan.structured else body.structured_field
        with _as_api_error("messages", grammar_param):
            params = body.sampling_params(body.requested_max_tokens(), body.num_logprobs(),
                                          self.replicas.sampling_defaults)
            if plan is not None and plan.structured is not None:
                if params.structured_outputs is not None:
                    raise APIError(400, f"tool_choice {plan.mode} and {body.structured_field} both constrain "
                                   "the output: ask for one", "tool_choice")
                params = dataclasses.replace(params, structured_outputs=plan.structured)
            prompt = processor.process_chat(conversation, params, body.add_generation_prompt, kwargs)
        return PreparedRequest("chat", f"chatcmpl-{uuid.uuid4().hex}", self.served_model_name,
                               [prompt], params, prompt_logprobs=body.prompt_logprobs, tool_plan=plan,
                               grammar_param=grammar_param)

    def _template_kwargs(self, body: ChatCompletionRequest) -> dict:
        """The request's chat_template_kwargs, its own template among them. NOTE: a template is code the
        server runs (a loop in one holds the event loop for seconds): a request's own runs only on a server
        started with --trust-request-chat-template, as on vLLM."""
        kwargs = dict(body.chat_template_kwargs or {})
        field = "chat_template_kwargs.chat_template" if "chat_template" in kwargs else None
        if body.chat_template is not None:
            kwargs["chat_template"], field = body.chat_template, "chat_template"
        if field is not None and not self.trust_request_chat_template:
            raise APIError(400, f"{field}: this server runs only its own chat template; start it with "
                           "--trust-request-chat-template to let requests bring theirs", field)
        return kwargs

    async def compile_grammar(self, request: PreparedRequest) -> None:
        """The request's grammar compiled before any engine sees it: off the event loop (other streams go
        on), within grammar_compile_timeout; the replica's process compiles it again from its own cache."""
        if request.params.structured_outputs is None:
            return
        try:
            await asyncio.wait_for(self.replicas.input_processor.compile_grammar(request.params.structured_outputs),
                                   self.grammar_compile_timeout)
        except asyncio.TimeoutError:
            field = request.grammar_param
            raise APIError(400, f"{field}: the grammar takes more than {self.grammar_compile_timeout:g} s to "
                           "compile (the server's --grammar-compile-timeout); make it smaller or simpler",
                           field) from None

    def _check_template_renders(self, conversation: list[dict], plan: ToolPlan | None,
                                request_template: str | None = None) -> None:
        """Tools or tool calls that the chat template never reads would be dropped without a word."""
        template = request_template or getattr(self.replicas.input_processor.tokenizer, "chat_template", None) or ""
        needs = (["tools"] if plan else []) + (["tool_calls"] if any("tool_calls" in m for m in conversation) else [])
        for name in needs:
            if name not in template:
                raise APIError(400, f"this model's chat template does not render {name}: start the server with a "
                               "--chat-template that does", "tools" if name == "tools" else "messages")

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
                token_ids, logprobs = c.token_ids, list[dict | None](c.logprobs or [])
                first_text = None
                if request.first_token_texts is not None:  # the echoed prompt's tokens lead, the first unscored
                    token_ids = output.prompt_token_ids + token_ids
                    logprobs = list(output.prompt_logprobs or []) + logprobs
                    first_text = request.first_token_texts[prompt_index]
                choice = _choice(request, request.choice_index(prompt_index, c.index), echo + c.text, token_ids,
                                 logprobs, 0, c.finish_reason, first_text)
                if request.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs)
                if request.tool_plan is not None:
                    _with_tool_calls(choice, request.tool_plan, c.text)
                choices.append(choice)
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
        if request.tool_plan is not None:
            async for event in _stream_tool_calls(self, request, head, include_usage):
                yield event
            return
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
            yield error_event(e)
        else:
            if include_usage:
                num_prompt_tokens = sum(p.num_prompt_tokens for p in request.prompts)
                yield sse({**head, "choices": [],
                           "usage": usage(num_prompt_tokens, chunks.num_completion_tokens)})
        yield "data: [DONE]\n\n"


async def _stream_tool_calls(serving, request: PreparedRequest, head: dict, include_usage: bool):
    """NOTE: with tools in play a sample is parsed whole, so its chunk comes when it finishes: the
    content or the tool calls (each with its index), then the finish reason."""
    try:
        full = await serving.full_response(request)
    except APIError as e:
        yield error_event(e)
        yield "data: [DONE]\n\n"
        return
    for choice in full["choices"]:
        message = choice["message"]
        delta = {"role": "assistant", "content": message.get("content")}
        if message.get("tool_calls"):
            delta["tool_calls"] = [call | {"index": i} for i, call in enumerate(message["tool_calls"])]
        yield sse({**head, "choices": [{"index": choice["index"], "delta": delta, "logprobs": None,
                                        "finish_reason": choice["finish_reason"]}]})
    if include_usage:
        yield sse({**head, "choices": [], "usage": full["usage"]})
    yield "data: [DONE]\n\n"


def _with_tool_calls(choice: dict, plan: ToolPlan, text: str) -> None:
    """A chat choice's message with the tool calls found in (or sampled as) its text."""
    content, calls = extract_calls(plan, text)
    if calls:
        choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
        choice["finish_reason"] = "stop" if plan.mode == "named" else "tool_calls"


class _ChunkMapper:
    """Sample deltas -> streamed choices. Tokens whose text is held back (a stop string may be
    forming) wait, with their logprobs, for the next chunk that carries text."""

    def __init__(self, request: PreparedRequest):
        self.request = request
        self.num_completion_tokens = 0
        self.text_offsets: dict[int, int] = {}  # choice index -> text_offset of its next token
        self.waiting: dict[int, tuple[list[int], list[dict | None]]] = {}  # index -> tokens, logprobs

    def choice(self, prompt_index: int, sample: SampleDelta) -> dict | None:
        request = self.request
        self.num_completion_tokens += len(sample.new_token_ids)
        index = request.choice_index(prompt_index, sample.sample_index)
        is_first = index not in self.text_offsets
        if index not in self.waiting and is_first and request.first_token_texts is not None:
            # echo with logprobs: the prompt's tokens lead, the first unscored; its scores arrive first
            self.waiting[index] = (list(request.prompts[prompt_index].prompt_token_ids), [None])
        token_ids, logprobs = self.waiting.setdefault(index, ([], []))
        if request.first_token_texts is not None:
            logprobs.extend(sample.new_prompt_logprobs or ())
        token_ids.extend(sample.new_token_ids)
        logprobs.extend(sample.new_logprobs or ())
        if not sample.new_text and sample.finish_reason is None:
            return None
        del self.waiting[index]
        text = sample.new_text
        if request.echo_texts and index not in self.text_offsets:
            text = request.echo_texts[prompt_index] + text
        offset = self.text_offsets.get(index, 0)
        first_text = request.first_token_texts[prompt_index] if request.first_token_texts and is_first else None
        choice = _choice(request, index, text, token_ids, logprobs, offset, sample.finish_reason, first_text)
        lp = choice["logprobs"]
        if request.kind == "completion" and lp and lp["tokens"]:
            offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
        self.text_offsets[index] = offset
        if request.kind == "chat":
            choice["delta"] = {"content": text} if text else {}
            del choice["message"]
        return choice


def _choice(request: PreparedRequest, index: int, text: str, token_ids, logprobs,
            text_offset: int, finish: str | None, first_text: str | None = None) -> dict:
    k = request.params.logprobs
    if request.kind == "completion":
        lp = completion_logprobs(token_ids, logprobs, k, text_offset, first_text) if k is not None else None
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
    lp = chat_logprobs(token_ids, logprobs, k) if k is not None else None
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": lp, "finish_reason": finish}


def _engine_error(error: BaseException) -> BaseException:
    if isinstance(error, APIError):
        return error
    if isinstance(error, (ValueError, TypeError)):
        return APIError(400, str(error))
    if isinstance(error, asyncio.CancelledError):
        return error
    logger.error("the engine failed on a request: %s: %s", type(error).__name__, error)
    return APIError(503, f"the engine failed: {public_message(f'{type(error).__name__}: {error}')}",
                    error_type="service_unavailable")
