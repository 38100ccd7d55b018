"""OpenAI endpoints: an API request fans out to prompts; their deltas become responses or SSE
(response_builder.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncGenerator

from shardserve.launch.server import tokenization
from shardserve.launch.server.api_error import APIError, as_api_error
from shardserve.launch.server.lora_registry import LoRARegistry
from shardserve.launch.openai_api.chat_render import template_arguments, template_conversation, template_kwargs
from shardserve.launch.openai_api.prepared_request import PreparedRequest, ResponseOptions
from shardserve.launch.openai_api.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from shardserve.launch.openai_api import harmony
from shardserve.launch.openai_api.reasoning import ReasoningMode
from shardserve.launch.server.replicas import ReplicaSet, public_message
from shardserve.launch.openai_api.request_deltas import RequestDeltas
from shardserve.launch.openai_api.response_builder import full_response, stream_events
from shardserve.launch.server.serving_options import ServingOptions
from shardserve.launch.server.tokenization import DetokenizeRequest, TokenizeRequest
from shardserve.launch.openai_api.tool_calls import HARMONY_PARSER, ToolCallError, ToolPlan, plan_tools
from shardserve.runtime.input_processor import InputProcessor, ProcessedPrompt
from shardserve.runtime.core.structured_output import GrammarCompileTimeout
from shardserve.runtime.lora_request import LoRARequest
from shardserve.runtime.sampling_params import SamplingParams

__all__ = ["OpenAIServing", "PreparedRequest"]  # PreparedRequest: where the routes have imported it from
logger = logging.getLogger("shardserve.launch.serving")


class OpenAIServing:
    def __init__(self, replicas: ReplicaSet, served_model_name: str, options: ServingOptions = ServingOptions(),
                 loras: LoRARegistry | None = None):
        self.replicas = replicas
        self.served_model_name = served_model_name
        self.options = options
        self.loras = loras or LoRARegistry(served_model_name, None, False, 0)

    # ---- API request -> prompts ------------------------------------------------------------
    def check_ready(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names (None: the base model); a 404 for a name not served, a 503 while
        the engine is down."""
        lora = self.loras.resolve(model)
        dead = self.replicas.public_dead_reason()
        if dead:
            raise APIError(503, f"the engine is not running ({dead})",
                           error_type="service_unavailable")
        return lora

    def _response_options(self, body: _SamplingFields) -> ResponseOptions:
        # vLLM's --enable-force-include-usage: usage on every chunk of every stream, as continuous_usage_stats
        forced = self.options.enable_force_include_usage
        include_usage = body.stream and (body.include_usage or forced)
        as_ids = body.return_tokens_as_token_ids
        return ResponseOptions(return_token_ids=bool(body.return_token_ids),
                               tokens_as_ids=self.options.return_tokens_as_token_ids if as_ids is None else as_ids,
                               include_usage=include_usage,
                               continuous_usage=include_usage and (forced or body.continuous_usage_stats),
                               prompt_tokens_details=self.options.enable_prompt_tokens_details)

    def _num_logprobs(self, asked: int | None, field: str) -> int | None:
        return self.options.num_logprobs(asked, field, self.replicas.input_processor.vocab_size)

    def prepare_completion(self, body: CompletionRequest) -> PreparedRequest:
        lora = self.check_ready(body.model)
        body.check_fields()
        if body.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if body.best_of not in (None, body.n):
            raise APIError(400, "best_of must equal n (or be left out)", "best_of")
        logprobs = self._num_logprobs(body.logprobs, "logprobs")
        self._num_logprobs(len(body.logprob_token_ids or ()) or None, "logprob_token_ids")  # within --max-logprobs
        # NOTE: a stream shows no prompt logprobs: its 0 (all vLLM takes with stream) asks for nothing
        prompt_logprobs = None if body.stream else self._num_logprobs(body.prompt_logprobs, "prompt_logprobs")
        scored = body.echo and logprobs is not None  # the echoed prompt comes with its logprobs
        processor = self.replicas.input_processor
        with as_api_error("prompt", body.structured_field):
            wanted = max(prompt_logprobs or 0, logprobs or 0) if scored else prompt_logprobs
            params = body.sampling_params(body.max_tokens, logprobs, self.replicas.sampling_defaults, wanted)
            prompts = [processor.process(_truncated(processor, _in_vocabulary(processor, p), body), params)
                       for p in body.prompts()]
        echo_texts = first_texts = None
        if body.echo:
            echo_texts = [p.prompt if p.prompt is not None else processor.decode(p.prompt_token_ids)
                          for p in prompts]
        if scored:
            first_texts = [processor.decode(p.prompt_token_ids[:1]) for p in prompts]
        return PreparedRequest("completion", f"cmpl-{uuid.uuid4().hex}", self._model_name(lora),
                               prompts, params, echo_texts, first_texts, prompt_logprobs,
                               grammar_param=body.structured_field, options=self._response_options(body), lora=lora)

    def _model_name(self, lora: LoRARequest | None) -> str:
        """The model a response names: the adapter's when the request asked for one."""
        return self.served_model_name if lora is None else lora.lora_name

    def tokenize(self, body: TokenizeRequest) -> dict:
        return tokenization.tokenize(self, body)

    def detokenize(self, body: DetokenizeRequest) -> dict:
        return tokenization.detokenize(self, body)

    def prepare_chat(self, body: ChatCompletionRequest) -> PreparedRequest:
        lora = self.check_ready(body.model)
        body.check_fields()
        processor = self.replicas.input_processor
        plan = self._tool_plan(body)
        kwargs = template_kwargs(body.chat_template, body.chat_template_kwargs,
                                 self.options.trust_request_chat_template)
        conversation = template_conversation(body.conversation())
        tools = body.tool_request()[0] if plan else None
        add_generation_prompt, arguments = template_arguments(processor, conversation, tools, body.template_flags(),
                                                              kwargs)
        grammar_param = "tool_choice" if plan and plan.structured else body.structured_field
        logprobs = self._num_logprobs(body.num_logprobs(), "top_logprobs")
        self._num_logprobs(len(body.logprob_token_ids or ()) or None, "logprob_token_ids")  # within --max-logprobs
        prompt_logprobs = None if body.stream else self._num_logprobs(body.prompt_logprobs, "prompt_logprobs")
        with as_api_error("messages", grammar_param):
            params = body.sampling_params(body.requested_max_tokens(), logprobs, self.replicas.sampling_defaults,
                                          prompt_logprobs)
            params = _with_tool_grammar(params, plan, body.structured_field)
            if body.truncate_prompt_tokens is None:
                prompt = processor.process_chat(conversation, params, add_generation_prompt, arguments)
            else:
                text = processor.apply_chat_template(conversation, add_generation_prompt, arguments)
                ids = processor.tokenize(text, add_special_tokens=False)
                prompt = processor.process(_truncated(processor, ids, body), params)
        role = body.response_role
        echo = conversation[-1]["content"] if body.echo and conversation[-1]["role"] == role else ""
        reasoning = self._reasoning(processor, prompt, plan)
        if reasoning is not None and reasoning.starts_inside and params.structured_outputs is not None:
            params = _after_reasoning(processor, params, reasoning.reasoning_end)
        if reasoning is not None and reasoning.parser == harmony.PARSER:  # the split reads the markers
            params = dataclasses.replace(params, kept_special_token_ids=harmony.marker_ids(processor.tokenizer))
        return PreparedRequest("chat", f"chatcmpl-{uuid.uuid4().hex}", self._model_name(lora),
                               [prompt], params, prompt_logprobs=prompt_logprobs, tool_plan=plan, reasoning=reasoning,
                               grammar_param=grammar_param, role=role, echo_message=echo,
                               options=self._response_options(body), lora=lora)

    def _reasoning(self, processor: InputProcessor, prompt: ProcessedPrompt,
                   plan: ToolPlan | None) -> ReasoningMode | None:
        """The reasoning split of a chat request's output, when the server has a parser: where the rendered
        prompt leaves the output (inside <think>, in which harmony message), and whether calls are split off."""
        if self.options.reasoning_parser is None:
            return None
        text = prompt.prompt if prompt.prompt is not None else processor.decode(prompt.prompt_token_ids[-64:])
        tool_calls = plan is not None and plan.parser == HARMONY_PARSER
        return ReasoningMode.for_prompt(self.options.reasoning_parser, text, tool_calls)

    def _tool_plan(self, body: ChatCompletionRequest) -> ToolPlan | None:
        tools, tool_choice = body.tool_request()
        try:
            return plan_tools(tools, tool_choice, self.options.tool_call_parser, self.options.enable_auto_tool_choice,
                              body.parallel_tool_calls is not False, self.options.reasoning_parser)
        except ToolCallError as e:
            raise APIError(400, str(e), e.field) from None

    # ---- running ---------------------------------------------------------------------------
    async def open(self, request: PreparedRequest) -> RequestDeltas:
        """Every prompt of the request handed to a replica, once each has it: a grammar is compiled there (the
        server's process compiles none), and one that fails or takes more than --grammar-compile-timeout is a
        400 here, before any response starts; so is a 503 for a request that found no room on the engines
        (fair_share). The caller closes what it gets back when its response ends."""
        def opener(i: int, prompt):
            return lambda: self.replicas.open(prompt, request.params, request.prompt_id(i), request.session,
                                              request.lora, self.options.grammar_compile_timeout, request.client)

        deltas = RequestDeltas([opener(i, p) for i, p in enumerate(request.prompts)], _engine_error)
        try:
            await deltas.opened()
        except BaseException as error:
            await deltas.aclose()
            if not isinstance(error, Exception):
                raise
            if isinstance(error, GrammarCompileTimeout):
                field = request.grammar_param
                raise APIError(400, f"{field}: {error} (the server's --grammar-compile-timeout); make it smaller or "
                               "simpler", field) from None
            raise _engine_error(error) from None
        return deltas

    async def full_response(self, request: PreparedRequest, deltas: RequestDeltas) -> dict:
        """Accumulate every prompt's deltas (open()'s), then answer once."""
        return await full_response(request, deltas)

    async def stream(self, request: PreparedRequest, deltas: RequestDeltas,
                     include_usage: bool | None = None) -> AsyncGenerator[str, None]:
        """SSE events: a chunk per delta with new text (or a finish), a final usage chunk if asked (by the
        request, or by `include_usage` where given), then [DONE]."""
        if include_usage is not None:
            options = dataclasses.replace(request.options, include_usage=include_usage)
            request = dataclasses.replace(request, options=options)
        async for event in stream_events(request, deltas):
            yield event


def _with_tool_grammar(params: SamplingParams, plan: ToolPlan | None, structured_field: str | None) -> SamplingParams:
    """A required or named tool call is sampled under its grammar; a second grammar asked beside it is refused
    (vLLM lets the tool's replace response_format: here nothing is dropped without a word)."""
    if plan is None or plan.structured is None:
        return params
    if params.structured_outputs is not None:
        raise APIError(400, f"tool_choice {plan.mode} and {structured_field} both constrain the output: ask for one",
                       "tool_choice")
    return dataclasses.replace(params, structured_outputs=plan.structured)


def _after_reasoning(processor: InputProcessor, params: SamplingParams, reasoning_end: str) -> SamplingParams:
    """The request's grammar (response_format, structured outputs, a tool call's) applies after the reasoning
    (</think>, harmony's final channel), as vLLM's reasoning parsers have it: the reasoning is free text."""
    end = tuple(processor.tokenize(reasoning_end, add_special_tokens=False))
    assert params.structured_outputs is not None  # the caller's condition
    outputs = dataclasses.replace(params.structured_outputs, starts_after=end)
    return dataclasses.replace(params, structured_outputs=outputs)


def _truncated(processor: InputProcessor, prompt: str | list[int], body: _SamplingFields) -> str | list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last N tokens (its first N with truncation_side right);
    -1 is max_model_len. A prompt left whole stays as given."""
    num = body.truncate_prompt_tokens
    if num is None:
        return prompt
    limit = processor.max_model_len
    keep = limit if num == -1 else num
    if keep > limit:
        raise APIError(400, f"truncate_prompt_tokens {keep} is more than max_model_len={limit}: ask for at most "
                       f"{limit} (or -1)", "truncate_prompt_tokens")
    ids = processor.tokenize(prompt, add_special_tokens=True) if isinstance(prompt, str) else prompt
    return ids[:keep] if body.truncation_side == "right" else ids[max(0, len(ids) - keep):]


def _in_vocabulary(processor: InputProcessor, prompt: str | list[int]) -> str | list[int]:
    """A prompt of token ids whose every id the model has; else a 400 in vLLM's words (out of vocabulary)."""
    if isinstance(prompt, list):
        outside = next((t for t in prompt if not 0 <= t < processor.vocab_size), None)
        if outside is not None:
            raise APIError(400, f"prompt: token id {outside} is out of vocabulary (the model's ids are 0 to "
                           f"{processor.vocab_size - 1})", "prompt")
    return prompt


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
