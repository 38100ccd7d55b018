"""OpenAI request shapes (completions, chat) and their translation to SamplingParams."""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal, Optional, Union, cast

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from shardserve.launch.server.api_error import APIError, shutting_down as shutting_down
from shardserve.launch.server.request_checks import IGNORED_FIELDS as IGNORED_FIELDS, Items, UnicodeBody, is_neutral, refuse_unknown
from shardserve.launch.openai_api.structured_request import (GUIDED_FIELDS, StructuredOutputsParams, asked_grammars,
                                                  structured_outputs)
from shardserve.runtime.sampling_params import SamplingParams
from shardserve.runtime.core.structured_output import StructuredOutputs

INT64_MAX = 2**63 - 1
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]  # the engine checks it against the vocabulary
NumLogprobs = Optional[Annotated[int, Field(ge=-1)]]  # -1: the whole vocabulary (within --max-logprobs)
_UnicodeBody, _is_neutral, _refuse_unknown = UnicodeBody, is_neutral, refuse_unknown  # their earlier names
logger = logging.getLogger("shardserve.launch.serving")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")  # an unknown option is refused by name (_refuse_unknown)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk (with include_usage)
    include_obfuscation: Optional[bool] = None  # OpenAI's padding of stream events: not done, changes no text


def _string_or(tag: str) -> Discriminator:
    """Tells a string from the union's other member by the value's type, so a bad value gets the one
    error of the member it meant (messages.0.content.parts.0.text), not one per member."""
    return Discriminator(lambda value: "string" if isinstance(value, str) else tag)


# request fields where "not given" (None) lets the model's sampling defaults apply
_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


class _SamplingFields(UnicodeBody):
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
    stop: Optional[Union[str, Items[str]]] = None
    stop_token_ids: Optional[Items[TokenId]] = None
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
    prompt_logprobs: NumLogprobs = None  # vLLM's extra
    response_format: Optional[dict[str, Any]] = None  # {"type": "text" | "json_object" | "json_schema"}
    structured_outputs: Optional[StructuredOutputsParams] = None  # vLLM's structured-output extra
    guided_json: Optional[Union[str, dict[str, Any]]] = None  # vLLM's older structured-output extras
    guided_regex: Optional[str] = None
    guided_choice: Optional[Items[str]] = None
    guided_grammar: Optional[str] = None
    # vLLM's extras: keep the prompt's last N tokens (-1: max_model_len), or its first N (truncation_side right)
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1, le=INT64_MAX)
    truncation_side: Optional[Literal["left", "right"]] = None
    use_beam_search: bool = False  # only false: there is no beam search here
    logprob_token_ids: Optional[Items[TokenId]] = None  # vLLM's: logprobs of these ids in place of the top k
    allowed_token_ids: Optional[Items[TokenId]] = None  # vLLM's: sample only among these token ids
    return_token_ids: Optional[bool] = None  # the choices carry token_ids, the response prompt_token_ids
    return_tokens_as_token_ids: Optional[bool] = None  # logprob tokens as "token_id:N" (None: the server's)

    @property
    def structured_field(self) -> str | None:
        """The field that asks for a grammar, to name in an error."""
        if self.structured_outputs is not None:
            return self.structured_outputs.field
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return "response_format"
        return next((name for name, _ in GUIDED_FIELDS if getattr(self, name) is not None), None)

    def structured_outputs_asked(self) -> StructuredOutputs | None:
        """The one grammar the request asks for (structured_outputs, response_format or guided_*), or None."""
        guided = {name: getattr(self, name) for name, _ in GUIDED_FIELDS}
        return structured_outputs(asked_grammars(guided, self.response_format, self.structured_outputs))

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: dict,
                        prompt_logprobs: int | None) -> SamplingParams:
        """The request's fields over the model's sampling defaults (generation_config.json); a field
        the request leaves out and the defaults lack takes SamplingParams' own default.
        max_tokens None: up to max_model_len; logprobs and prompt_logprobs as counts (-1 resolved)."""
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
                              allowed_token_ids=None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
                              logprob_token_ids=tuple(self.logprob_token_ids or ()) or None,
                              prompt_logprobs=prompt_logprobs, structured_outputs=self.structured_outputs_asked())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage_stats(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def check_extra_fields(self) -> None:
        refuse_unknown(self, "")
        if self.stream_options is not None:
            refuse_unknown(self.stream_options, "stream_options.")

    def check_fields(self) -> None:
        """Extra fields, and the combinations vLLM refuses."""
        self._check_token_id_lists()
        self.check_extra_fields()
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise APIError(400, "stream_options needs stream: true", "stream_options")
        if self.use_beam_search:
            raise APIError(400, "use_beam_search is not supported: this server samples (leave it false)",
                           "use_beam_search")
        if self.stream and self.prompt_logprobs not in (None, 0):
            raise APIError(400, "prompt_logprobs is not supported with stream (0 is: it asks for nothing "
                           "to be shown)", "prompt_logprobs")

    def _check_token_id_lists(self) -> None:
        """vLLM's logprob_token_ids, checked as vLLM checks it: not empty, and with logprobs asked for."""
        ids = self.logprob_token_ids
        if ids is None:
            return
        if not ids:
            raise APIError(400, "`logprob_token_ids` must not be an empty list.", "logprob_token_ids")
        if getattr(self, "logprobs", None) in (None, False):
            raise APIError(400, "when using `logprob_token_ids`, `logprobs` must be set.", "logprob_token_ids")


PromptInput = Union[str, Items[str], Items[int], Items[Items[int]]]


class CompletionRequest(_SamplingFields):
    prompt: Optional[PromptInput] = None  # required: None and "" are refused in vLLM's words (prompts())
    max_tokens: Optional[int] = Field(16, ge=0)  # 0: the prompt alone (echo, prompt logprobs)
    logprobs: NumLogprobs = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a string or a list of token ids."""
        p = self.prompt
        if p is None or p == "":
            raise APIError(400, "Either prompt or prompt_embeds must be provided and non-empty. (This server "
                           "takes prompt: text or token ids; prompt_embeds is not supported.)", "prompt")
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


MessageContent = Annotated[Union[Annotated[str, Tag("string")], Annotated[Items[ContentPart], Tag("parts")]],
                           _string_or("parts")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # an unknown field is refused by name (_refuse_unknown)
    role: Union[Literal["system", "user", "assistant", "tool", "developer"], str]  # or any the template takes
    content: Optional[MessageContent] = None
    name: Optional[str] = None
    tool_calls: Optional[Items[ToolCall]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None  # an assistant turn's reasoning, as --reasoning-parser returned it
    reasoning: Optional[str] = None  # its newer name

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
        self._log_extra_fields(index)
        message: dict[str, Any] = {"role": self.role, "content": self.text(index)}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump(exclude_unset=True) for call in self.tool_calls]
        reasoning = self._reasoning(index)
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return message | {k: v for k in ("tool_call_id", "name") if (v := getattr(self, k)) is not None}

    def _log_extra_fields(self, index: int) -> None:
        """NOTE: a message's fields beyond OpenAI's are accepted, as vLLM accepts them (clients put their own
        bookkeeping there), and named in the server's log: they reach neither the chat template nor the model."""
        extra = sorted(name for name, value in (self.model_extra or {}).items() if not is_neutral(name, value))
        if extra:
            logger.warning("messages.%d: ignored the fields %s (not part of a chat message)", index, ", ".join(extra))

    def _reasoning(self, index: int) -> str | None:
        """reasoning_content, or reasoning (the same text under either name); only an assistant turn has one."""
        given = [(name, value) for name in ("reasoning_content", "reasoning") if (value := getattr(self, name)) is not None]
        if not given:
            return None
        where = f"messages.{index}.{given[0][0]}"
        if self.role != "assistant":
            raise APIError(400, f"{where}: only an assistant message carries reasoning", where)
        if len({value for _, value in given}) > 1:
            raise APIError(400, f"{where}: reasoning_content and reasoning differ; give one", where)
        return given[0][1]


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
    messages: Items[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: NumLogprobs = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the final (assistant) message left open, to continue
    echo: bool = False  # vLLM's: the reply starts with the last message's content when the roles match
    chat_template_kwargs: Optional[dict[str, Any]] = None
    chat_template: Optional[str] = None  # vLLM's: only with --trust-request-chat-template
    tools: Optional[Items[Tool]] = None
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

    @property
    def response_role(self) -> str:
        """The reply's role, as vLLM names it: assistant after a generation prompt, else the last message's."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def template_flags(self) -> dict[str, bool]:
        """How the chat template ends the conversation: a generation prompt, or the final message left open."""
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(400, "continue_final_message needs add_generation_prompt: false (the final message "
                           "is continued, not answered)", "continue_final_message")
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}

    def num_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None
