"""Text in: apply the chat template, tokenize and check each prompt once, for LLM and the server alike."""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Union

from jinja2 import TemplateError

from shardserve.runtime.pooling_params import PoolingParams
from shardserve.runtime.sampling_params import SamplingParams
from shardserve.runtime.tokenizer import longest_token_chars

if TYPE_CHECKING:
    from shardserve.runtime.config import ModelConfig

# text, token ids, {"prompt": text} or {"prompt_token_ids": [...], "prompt": optional text}
PromptType = Union[str, list[int], dict]


class InvalidPromptError(ValueError):
    """A prompt the engine cannot take. `field` names what to change: "prompt", "max_tokens", "min_tokens", "stop",
    "stop_token_ids", "logit_bias", "response_format", or "model" (served for generation or for pooling)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


_TEMPLATE_INPUTS = {"tools", "documents", "chat_template", "continue_final_message"}  # given through kwargs


@dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    """A prompt checked against the model and its SamplingParams: token ids in the vocabulary,
    room for max_tokens within max_model_len. Only InputProcessor makes these."""

    prompt: str | None  # the text (after the chat template), or None when given as token ids
    prompt_token_ids: tuple[int, ...]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class InputProcessor:
    """NOTE: every check of a prompt against the model happens here and only here (the scheduler
    adds the one check that depends on its pool: enough KV blocks); the engine trusts a ProcessedPrompt."""

    def __init__(self, model_config: ModelConfig, tokenizer, async_scheduling: bool = False):
        self.tokenizer = tokenizer  # None with skip_tokenizer_init
        self.async_scheduling = async_scheduling
        self.model_config = model_config
        self.vocab_size = model_config.vocab_size
        self.max_model_len = model_config.max_model_len

    def process(self, prompt: PromptType, params: SamplingParams | PoolingParams) -> ProcessedPrompt:
        if isinstance(prompt, str):
            return self._check(prompt, self._tokenize_prompt(prompt, add_special_tokens=True), params)
        if isinstance(prompt, list):
            return self._check(None, prompt, params)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return self._check(prompt.get("prompt"), prompt["prompt_token_ids"], params)
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return self.process(prompt["prompt"], params)
        raise InvalidPromptError("a prompt is a str, a list of token ids, {'prompt': str} or "
                                 f"{{'prompt_token_ids': [int, ...]}}; got {type(prompt).__name__}", "prompt")

    def process_chat(self, conversation: list[dict], params: SamplingParams, add_generation_prompt: bool = True,
                     chat_template_kwargs: dict[str, Any] | None = None) -> ProcessedPrompt:
        """One conversation (OpenAI messages: role and text content) through the chat template."""
        text = self.apply_chat_template(conversation, add_generation_prompt, chat_template_kwargs)
        return self._check(text, self._tokenize_prompt(text, add_special_tokens=False), params)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True,
                            chat_template_kwargs: dict[str, Any] | None = None) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidPromptError("this model's tokenizer has no chat_template: give plain prompts, "
                                     "not messages (or start with --chat-template)", "prompt")
        kwargs = chat_template_kwargs or {}
        taken = sorted(set(kwargs) & self._template_arguments)
        if taken:
            raise InvalidPromptError(f"chat_template_kwargs.{taken[0]} is an argument the server gives the chat "
                                     "template itself: leave it out", "chat_template_kwargs")
        try:
            return self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **kwargs)
        except TemplateError as error:  # jinja's errors (raise_exception in templates) are the caller's
            raise InvalidPromptError(f"the chat template rejected the messages: {error}", "prompt") from None
        except Exception:  # NOTE: not its text (Python's names and internals)
            raise InvalidPromptError("the chat template could not render these messages", "prompt") from None

    @cached_property
    def _template_arguments(self) -> frozenset[str]:
        """Names a caller's template arguments may not use: apply_chat_template's own parameters (but the
        template inputs it takes as such) and what it gives the template itself (messages, special tokens)."""
        own = set(inspect.signature(self.tokenizer.apply_chat_template).parameters) - _TEMPLATE_INPUTS - {"kwargs"}
        return frozenset(own | {"messages"} | set(getattr(self.tokenizer, "special_tokens_map", {})))

    def check_token_ids(self, token_ids: list[int]) -> None:
        if not all(0 <= t < self.vocab_size for t in token_ids):
            raise InvalidPromptError(f"token ids must be integers in [0, {self.vocab_size})", "prompt")

    def decode(self, token_ids: tuple[int, ...] | list[int]) -> str:
        """A prompt's text from its token ids (for echo), or "" without a tokenizer."""
        return "" if self.tokenizer is None else self.tokenizer.decode(list(token_ids))

    def _check_structured_outputs(self, outputs) -> None:
        if self.tokenizer is None:
            raise InvalidPromptError("structured outputs need a tokenizer (this engine skipped it)", "response_format")
        try:
            outputs.grammar()
        except ValueError as error:
            raise InvalidPromptError(str(error), "response_format") from None

    @cached_property
    def longest_token_chars(self) -> int | None:
        return None if self.tokenizer is None else longest_token_chars(self.tokenizer)

    def _tokenize_prompt(self, text: str, add_special_tokens: bool) -> list[int]:
        """tokenize, but a text that cannot fit max_model_len is refused untokenized (NOTE: tokenizing
        megabytes takes seconds; no token covers more than longest_token_chars characters)."""
        chars = self.longest_token_chars
        if chars is not None and len(text) > self.max_model_len * chars:
            raise InvalidPromptError(f"the prompt has {len(text)} characters, so more than max_model_len="
                                     f"{self.max_model_len} tokens (no token of this tokenizer covers more than "
                                     f"{chars} characters); shorten the prompt", "prompt")
        return self.tokenize(text, add_special_tokens)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise InvalidPromptError("this engine was started with skip_tokenizer_init=True; "
                                     "give prompts as {'prompt_token_ids': [...]}", "prompt")
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def _check(self, text: str | None, token_ids: list[int],
               params: SamplingParams | PoolingParams) -> ProcessedPrompt:
        check_runner(self.model_config.runner, params)
        if isinstance(params, PoolingParams):  # the prompt alone: it may fill max_model_len
            ids = self._checked_ids(token_ids)
            if len(ids) > self.max_model_len:
                raise InvalidPromptError(f"the prompt has {len(ids)} tokens, more than max_model_len="
                                         f"{self.max_model_len}; shorten the prompt", "prompt")
            return ProcessedPrompt(text, ids)
        if params.stop and self.tokenizer is None:
            raise InvalidPromptError("stop strings need a tokenizer; use stop_token_ids with "
                                     "skip_tokenizer_init=True", "stop")
        vocab, limit = self.vocab_size, self.max_model_len
        if self.async_scheduling:
            _check_async_scheduling(params)
        if params.structured_outputs is not None:
            self._check_structured_outputs(params.structured_outputs)
        if any(token >= vocab for token, _ in params.logit_bias):
            raise InvalidPromptError(f"logit_bias token ids must lie in [0, {vocab})", "logit_bias")
        if any(token >= vocab for token in params.logprob_token_ids or ()):
            raise InvalidPromptError(f"logprob_token_ids must lie in [0, {vocab})", "logprob_token_ids")
        if any(token >= vocab for token in params.allowed_token_ids or ()):
            raise InvalidPromptError("allowed_token_ids contains out-of-vocab token id", "allowed_token_ids")
        if any(token >= vocab for token in params.stop_token_ids):
            raise InvalidPromptError(f"stop_token_ids must lie in [0, {vocab})", "stop_token_ids")
        ids = self._checked_ids(token_ids)
        num_tokens = len(ids)
        if params.max_tokens is None and num_tokens >= limit:
            raise InvalidPromptError(f"the prompt has {num_tokens} tokens, which leaves no room to generate "
                                     f"within max_model_len={limit}; shorten the prompt", "prompt")
        if params.max_tokens is not None and num_tokens + params.max_tokens > limit:
            raise InvalidPromptError(f"prompt ({num_tokens} tokens) + max_tokens ({params.max_tokens}) exceeds "
                                     f"max_model_len={limit}; shorten the prompt or lower max_tokens",
                                     "max_tokens")
        if num_tokens + params.min_tokens > limit:
            raise InvalidPromptError(f"prompt ({num_tokens} tokens) + min_tokens ({params.min_tokens}) exceeds "
                                     f"max_model_len={limit}; lower min_tokens", "min_tokens")
        return ProcessedPrompt(text, ids)


    def _checked_ids(self, token_ids: list[int]) -> tuple[int, ...]:
        """The prompt's ids as a tuple of ints in the vocabulary; not empty."""
        vocab = self.vocab_size
        try:
            ids = tuple(operator.index(t) for t in token_ids)
        except TypeError:
            ids = None
        if ids is None or not all(0 <= t < vocab for t in ids):
            raise InvalidPromptError(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        if not ids:
            raise InvalidPromptError("the prompt is empty", "prompt")
        return ids


def check_runner(runner: str, params: SamplingParams | PoolingParams) -> None:
    """Generation on a generating engine, pooling on a pooling one (vLLM's --runner); refused by the flag
    that would serve it (field "model": the model is served for the other kind)."""
    if runner == "pooling" and not isinstance(params, PoolingParams):
        raise InvalidPromptError("this model is served for embeddings (--runner pooling): it generates no text; "
                                 "start it with --runner generate to generate", "model")
    if runner != "pooling" and isinstance(params, PoolingParams):
        raise InvalidPromptError("this model is served for generation: embeddings need it started with "
                                 "--runner pooling", "model")


def _check_async_scheduling(params: SamplingParams) -> None:
    """What async scheduling cannot honour: each needs the previous step's token on the host before
    the next step is sampled (a grammar's matcher, the penalties' counts) or scores the prompt."""
    if params.structured_outputs is not None:
        raise InvalidPromptError("structured outputs (response_format) cannot run with async_scheduling: "
                                 "start the engine without it", "response_format")
    if params.prompt_logprobs is not None:
        raise InvalidPromptError("prompt_logprobs cannot run with async_scheduling: start the engine without it",
                                 "prompt_logprobs")
    if params.has_penalties:
        name = next(name for name, value, neutral in (("repetition_penalty", params.repetition_penalty, 1.0),
                                                      ("presence_penalty", params.presence_penalty, 0.0),
                                                      ("frequency_penalty", params.frequency_penalty, 0.0))
                    if value != neutral)
        raise InvalidPromptError(f"{name} cannot run with async_scheduling: start the engine without it", name)
