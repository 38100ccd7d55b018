"""OpenAI request shapes (completions, chat) and their translation to SamplingParams."""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from shardserve.runtime.sampling_params import SamplingParams
from shardserve.runtime.structured_output import StructuredOutputs

MAX_LOGPROBS = 20


class APIError(Exception):
    """An error the client caused (or an overload): becomes an OpenAI-shaped JSON response."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 error_type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.error_type = error_type or {400: "invalid_request_error",
                                         401: "authentication_error",
                                         404: "not_found_error"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


# Fields OpenAI clients send that change nothing in what is generated: accepted and not used.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
def _is_neutral(name: str, value: Any) -> bool:
    """An extra field whose value asks for nothing (None, an empty list or mapping)."""
    return name in IGNORED_FIELDS or value is None or value == [] or value == {}


_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))
# request fields where "not given" (None) lets the model's sampling defaults apply
_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


class _SamplingFields(BaseModel):
    """Fields both endpoints share. An extra field is accepted only where it asks for nothing
    (IGNORED_FIELDS, or an empty value): anything else is refused by name, never ignored."""

    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    n: int = Field(1, ge=1, le=128)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = None
    min_p: Optional[float] = Field(None, ge=0, le=1)
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logit_bias: Optional[dict[int, float]] = None  # OpenAI sends token ids as JSON strings
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's extra
    response_format: Optional[dict[str, Any]] = None  # {"type": "text" | "json_object" | "json_schema"}
    guided_json: Optional[Union[str, dict[str, Any]]] = None  # vLLM's structured-output extras
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None

    @property
    def structured_field(self) -> str | None:
        """The field that asks for a grammar, to name in an error."""
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return "response_format"
        return next((name for name, _ in _GUIDED if getattr(self, name) is not None), None)

    def structured_outputs(self) -> StructuredOutputs | None:
        """The one grammar the request asks for (response_format or a guided_* extra), or None."""
        asked = [(name, kind, getattr(self, name)) for name, kind in _GUIDED if getattr(self, name) is not None]
        form = self.response_format or {}
        if form.get("type") == "json_object":
            asked.append(("response_format", "json_object", None))
        elif form.get("type") == "json_schema":
            schema = (form.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise APIError(400, "response_format json_schema needs json_schema.schema", "response_format")
            asked.append(("response_format", "json", schema))
        elif form.get("type") not in (None, "text"):
            raise APIError(400, f"response_format type {form.get('type')!r}: use text, json_object or json_schema",
                           "response_format")
        if len(asked) > 1:
            raise APIError(400, f"ask for one structured output, not {' and '.join(a[0] for a in asked)}", asked[1][0])
        if not asked:
            return None
        name, kind, spec = asked[0]
        try:
            return StructuredOutputs(kind, json.loads(spec) if kind == "json" and isinstance(spec, str) else spec)
        except ValueError as error:
            raise APIError(400, f"{name}: {error}", name) from None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: dict,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The request's fields over the model's sampling defaults (generation_config.json); a field
        the request leaves out and the defaults lack takes SamplingParams' own default.
        max_tokens None: up to max_model_len."""
        given = {name: getattr(self, name) for name in _DEFAULTED if getattr(self, name) is not None}
        if max_tokens is None:
            max_tokens = defaults.get("max_tokens")
        return SamplingParams(**{**defaults, **given}, n=self.n, seed=self.seed, stop=self.stop,
                              stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                              include_stop_str_in_output=self.include_stop_str_in_output, max_tokens=max_tokens,
                              min_tokens=self.min_tokens, logprobs=logprobs,
                              skip_special_tokens=self.skip_special_tokens, logit_bias=self.logit_bias,
                              prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
                              structured_outputs=self.structured_outputs())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_extra_fields(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if not _is_neutral(name, value):
                raise APIError(400, f"{name} is not supported: this server does not know it", name)


PromptInput = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    max_tokens: Optional[int] = Field(16, ge=0)  # 0: the prompt alone (echo, prompt logprobs)
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return [x if isinstance(x, str) else list(x) for x in p]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise APIError(400, f"content part type {part.get('type')!r} is not "
                               "supported: only text parts", "messages")
            parts.append(part.get("text", ""))
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None  # False: one call at most

    def conversation(self) -> list[dict]:
        """The messages for the chat template, tool calls and tool results included."""
        extras = ("tool_calls", "tool_call_id", "name")
        return [{"role": m.role, "content": m.text(),
                 **{k: v for k, v in (m.model_extra or {}).items() if k in extras and v is not None}}
                for m in self.messages]

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""

    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def conversation(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages or ()]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    tokens: list[int]
