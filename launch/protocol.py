"""OpenAI request shapes (completions, chat) and their translation to SamplingParams."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union, cast

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from shardserve.runtime.sampling_params import SamplingParams
from shardserve.runtime.structured_output import StructuredOutputs

MAX_LOGPROBS = 20
INT64_MAX = 2**63 - 1
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]  # the engine checks it against the vocabulary


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

    @property
    def outcome(self) -> str:
        """The request's outcome label in shardserve_requests_total."""
        if self.status < 500:
            return "rejected"
        return "unavailable" if self.error_type == "service_unavailable" else "error"


def shutting_down() -> APIError:
    """The 503 of a server that is draining (SIGTERM): for new requests, and those its drain ended."""
    return APIError(503, "the server is shutting down; send the request to another server",
                    error_type="service_unavailable")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")  # an unknown option is refused by name (_refuse_unknown)
    include_usage: bool = False
    include_obfuscation: Optional[bool] = None  # OpenAI's padding of stream events: not done, changes no text


# Fields OpenAI clients send that change nothing in what is generated: accepted and not used.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
def _is_neutral(name: str, value: Any) -> bool:
    """An extra field whose value asks for nothing (None, an empty list or mapping)."""
    return name in IGNORED_FIELDS or value is None or value == [] or value == {}


def _refuse_unknown(model: BaseModel, where: str) -> None:
    """An extra field of `model` (at path `where`) is refused by name unless it asks for nothing."""
    for name, value in (model.model_extra or {}).items():
        if not _is_neutral(name, value):
            raise APIError(400, f"{where}{name} is not supported: this server does not know it", f"{where}{name}")


def _string_or(tag: str) -> Discriminator:
    """Tells a string from the union's other member by the value's type, so a bad value gets the one
    error of the member it meant (messages.0.content.parts.0.text), not one per member."""
    return Discriminator(lambda value: "string" if isinstance(value, str) else tag)


def _invalid_unicode_at(data: Any) -> str | None:
    """The path (messages.0.content) of the first string or key that is not valid Unicode, or None.
    NOTE: JSON's \\ud800 escapes decode to unpaired surrogates, which no UTF-8 encoder (the tokenizer,
    the response) takes; a bad key is reported as its mapping, so no message carries the bad text."""
    stack: list[tuple[tuple[str, ...], Any]] = [((), data)]
    while stack:  # NOTE: a loop, not recursion: the body may nest as deep as the JSON parser allowed
        path, value = stack.pop()
        if isinstance(value, str) and not _is_unicode(value):
            return ".".join(path) or "body"
        if isinstance(value, dict):
            if not all(_is_unicode(str(key)) for key in value):
                return ".".join(path) or "body"
            items = list(value.items())
        elif isinstance(value, list):
            items = list(enumerate(value))
        else:
            continue
        stack.extend(reversed([(path + (str(key),), item) for key, item in items
                               if isinstance(item, (str, dict, list))]))  # numbers: nothing to check
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _UnicodeBody(BaseModel):
    """A request body whose every string and key is valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _check_unicode(cls, data: Any) -> Any:
        # NOTE: an APIError, not a ValueError: pydantic lets it through untouched, so the 400 names the
        # field (a ValueError here would be reported at the body's root)
        where = _invalid_unicode_at(data)
        if where is not None:
            raise APIError(400, f"{where}: the text is not valid Unicode (UTF-8): it holds an unpaired "
                           "surrogate", where)
        return data


_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))
# request fields where "not given" (None) lets the model's sampling defaults apply
_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


class _SamplingFields(_UnicodeBody):
    """Fields both endpoints share. An extra field is accepted only where it asks for nothing
    (IGNORED_FIELDS, or an empty value): anything else is refused by name, never ignored."""

    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    n: int = Field(1, ge=1, le=128)
    temperature: Optional[float] = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: Optional[float] = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: Optional[int] = None
    min_p: Optional[float] = Field(None, ge=0, le=1, allow_inf_nan=False)
    seed: Optional[int] = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[TokenId]] = None
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: Optional[float] = Field(None, gt=0, allow_inf_nan=False)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logit_bias: Optional[dict[int, FiniteFloat]] = None  # OpenAI sends token ids as JSON strings
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
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(**{**defaults, **given}, n=self.n, seed=self.seed, stop=stop,
                              stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                              include_stop_str_in_output=self.include_stop_str_in_output, max_tokens=max_tokens,
                              min_tokens=self.min_tokens, logprobs=logprobs,
                              skip_special_tokens=self.skip_special_tokens,
                              logit_bias=tuple((self.logit_bias or {}).items()),
                              prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
                              structured_outputs=self.structured_outputs())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_extra_fields(self) -> None:
        _refuse_unknown(self, "")
        if self.stream_options is not None:
            _refuse_unknown(self.stream_options, "stream_options.")


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
            return [cast(list[int], list(p))]  # (all() narrows nothing for the checker)
        return [x if isinstance(x, str) else cast(list[int], list(x)) for x in cast(list, p)]


class ContentPart(BaseModel):
    """One part of a message's content. Only text parts are read; others (image_url) are refused by type."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: Optional[str] = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"  # OpenAI sends JSON text; a mapping is taken too


class ToolCall(BaseModel):
    """A call in an assistant message, in OpenAI's shape."""

    model_config = ConfigDict(extra="allow")
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


MessageContent = Annotated[Union[Annotated[str, Tag("string")], Annotated[list[ContentPart], Tag("parts")]],
                           _string_or("parts")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # an unknown field is refused by name (_refuse_unknown)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Optional[MessageContent] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None

    def text(self, index: int) -> str:
        """The content as one text; `index` is the message's place in messages, for errors."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for j, part in enumerate(self.content):
            where = f"messages.{index}.content.{j}"
            if part.type != "text":
                raise APIError(400, f"{where}: content part type {part.type!r} is not supported: only text parts",
                               where)
            if part.text is None:
                raise APIError(400, f"{where}.text: a text part needs its text", f"{where}.text")
        return "".join(part.text or "" for part in self.content)

    def template_message(self, index: int) -> dict:
        """The message as the chat template reads it: text content, tool calls and tool results as mappings."""
        _refuse_unknown(self, f"messages.{index}.")
        message: dict[str, Any] = {"role": self.role, "content": self.text(index)}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump(exclude_unset=True) for call in self.tool_calls]
        return message | {k: v for k in ("tool_call_id", "name") if (v := getattr(self, k)) is not None}


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON Schema


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Annotated[Union[Annotated[str, Tag("string")], Annotated[NamedToolChoice, Tag("named")]],
                       _string_or("named")]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    chat_template: Optional[str] = None  # vLLM's: only with --trust-request-chat-template
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None  # none | auto | required | a named function
    parallel_tool_calls: Optional[bool] = None  # False: one call at most

    def conversation(self) -> list[dict]:
        """The messages for the chat template, tool calls and tool results included."""
        return [m.template_message(i) for i, m in enumerate(self.messages)]

    def tool_request(self) -> tuple[list[dict], str | dict | None]:
        """(tools, tool_choice) as the mappings the client sent, for plan_tools and the chat template."""
        choice = self.tool_choice
        return ([tool.model_dump(exclude_unset=True) for tool in self.tools or ()],
                choice.model_dump() if isinstance(choice, BaseModel) else choice)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_UnicodeBody):
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""

    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def conversation(self) -> list[dict]:
        """Each message's role and text, checked as chat checks them."""
        messages = [m.template_message(i) for i, m in enumerate(self.messages or ())]
        return [{"role": m["role"], "content": m["content"]} for m in messages]


class DetokenizeRequest(_UnicodeBody):
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    tokens: list[int]
