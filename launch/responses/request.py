"""OpenAI's Responses request (POST /v1/responses) and its translation into a chat completions request.

    instructions                     a system message, first
    input: a string                  one user message
    input: message items             messages (text parts only)
    input: function_call items       an assistant message's tool_calls (calls in a row share one message)
    input: function_call_output      a tool message answering its call_id
    tools {type: function, name}     chat's {type: function, function: {name, ...}}
    text.format                      chat's response_format
    include [...logprobs], top_logprobs   chat's logprobs and top_logprobs

What the server cannot do (stored responses, background runs, hosted tools, reasoning settings) is a 400
that names the field; nothing is dropped without a word.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, ValidationError

from shardserve.launch.server.api_error import APIError
from shardserve.launch.openai_api.protocol import ChatCompletionRequest, StreamOptions
from shardserve.launch.server.request_checks import Items, UnicodeBody, check_keys, is_neutral, refuse_unknown, required_string

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# NOTE: accepted because it asks for nothing here: reasoning items (--reasoning-parser) carry their text, never
# encrypted (agents that run with store=false send it on every request)
_EMPTY_INCLUDES = frozenset({"reasoning.encrypted_content"})
# vLLM's sampling extras, passed on to the chat request (which checks them as it checks its own)
CHAT_EXTRAS = frozenset({"top_k", "min_p", "seed", "stop", "stop_token_ids", "repetition_penalty", "presence_penalty",
                         "frequency_penalty", "ignore_eos", "min_tokens", "logit_bias", "skip_special_tokens",
                         "include_stop_str_in_output", "chat_template_kwargs", "structured_outputs"})
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")


def _string_or(tag: str) -> Discriminator:
    """One error for a bad value (that of the member it meant), not one per member of the union."""
    return Discriminator(lambda value: "string" if isinstance(value, str) else tag)


Input = Annotated[Union[Annotated[str, Tag("string")], Annotated[Items[dict[str, Any]], Tag("items")]],
                  _string_or("items")]
ToolChoice = Annotated[Union[Annotated[str, Tag("string")], Annotated[dict[str, Any], Tag("object")]],
                       _string_or("object")]


class ResponsesRequest(UnicodeBody):
    model_config = ConfigDict(extra="allow")  # CHAT_EXTRAS go on to chat; any other extra is refused by name

    model: Optional[str] = None
    input: Input
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: Optional[float] = Field(None, gt=0, le=1, allow_inf_nan=False)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    tools: Optional[Items[dict[str, Any]]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict[str, Any]] = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    include: Optional[Items[str]] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    metadata: Optional[dict[str, str]] = None  # returned as given
    user: Optional[str] = None  # returned as given
    store: Optional[bool] = None  # nothing is stored, whatever it says: the response says store false
    # asked of a server that keeps state or runs hosted features: refused unless they ask for nothing
    previous_response_id: Optional[str] = None
    conversation: Optional[Union[str, dict[str, Any]]] = None
    background: Optional[bool] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    reasoning: Optional[dict[str, Any]] = None
    max_tool_calls: Optional[int] = None
    prompt: Optional[dict[str, Any]] = None

    def chat_request(self) -> ChatCompletionRequest:
        """The same request as chat completions takes it; a field chat cannot honour is refused first."""
        self._refuse_unsupported()
        logprobs = self._wants_logprobs()
        tools = chat_tools(self.tools)
        fields = {"model": self.model, "messages": conversation(self.instructions, self.input),
                  "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
                  "top_p": self.top_p, "stream": self.stream, "tools": tools,
                  "tool_choice": chat_tool_choice(self.tool_choice, tools),
                  "parallel_tool_calls": self.parallel_tool_calls,
                  "response_format": response_format(self.text), "logprobs": logprobs,
                  "top_logprobs": self.top_logprobs if logprobs else None,
                  **{name: value for name, value in (self.model_extra or {}).items() if name in CHAT_EXTRAS}}
        try:
            return ChatCompletionRequest.model_validate(fields)
        except ValidationError as e:  # only the passed-on extras can fail here: they keep their names
            error = e.errors()[0]
            where = ".".join(str(p) for p in error["loc"])
            raise APIError(400, f"{where}: {error['msg']}", str(error["loc"][0])) from None

    def _refuse_unsupported(self) -> None:
        refusals = (
            (self.previous_response_id is not None, "previous_response_id",
             "this server stores no responses: send the whole conversation in input"),
            (self.conversation is not None, "conversation",
             "this server stores no conversations: send the whole conversation in input"),
            (bool(self.background), "background", "background responses need a stored response to poll"),
            (self.truncation == "auto", "truncation",
             "truncation auto is not supported: an input longer than the context is refused"),
            (self.max_tool_calls is not None, "max_tool_calls",
             "max_tool_calls is not supported: use parallel_tool_calls false for one call at most"),
            (self.prompt is not None, "prompt", "stored prompt templates are not supported: send input"))
        for refused, name, why in refusals:
            if refused:
                raise APIError(400, f"{name}: {why}", name)
        for key, value in (self.reasoning or {}).items():
            if value is not None:
                raise APIError(400, f"reasoning.{key} is not supported: this server applies no reasoning settings",
                               f"reasoning.{key}")
        for name, value in (self.model_extra or {}).items():
            if name not in CHAT_EXTRAS and not is_neutral(name, value):
                raise APIError(400, f"{name} is not supported: this server does not know it", name)
        if self.stream_options is not None:
            refuse_unknown(self.stream_options, "stream_options.")
            if self.stream_options.continuous_usage_stats:  # usage comes once, in the last event's Response
                raise APIError(400, "stream_options.continuous_usage_stats is not supported by the Responses API",
                               "stream_options.continuous_usage_stats")

    def _wants_logprobs(self) -> bool:
        include = set(self.include or ())
        unknown = sorted(include - _EMPTY_INCLUDES - {LOGPROBS_INCLUDE})
        if unknown:
            raise APIError(400, f"include {unknown[0]!r} is not supported: only {LOGPROBS_INCLUDE!r}", "include")
        wanted = LOGPROBS_INCLUDE in include
        if self.top_logprobs and not wanted:
            raise APIError(400, f"top_logprobs needs include [{LOGPROBS_INCLUDE!r}]", "top_logprobs")
        return wanted


def conversation(instructions: str | None, items: str | list[dict[str, Any]]) -> list[dict]:
    """The chat messages of `instructions` and `input`, each input item checked where it stands."""
    messages: list[dict] = [] if instructions is None else [{"role": "system", "content": instructions}]
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    if not items:
        raise APIError(400, "input must not be empty", "input")
    call_ids: set[str] = set()
    for i, item in enumerate(items):
        where, kind = f"input.{i}", item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            call_ids.add(call["id"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # parallel calls, or text and then calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(_function_call_output(item, where, call_ids))
        else:
            raise APIError(400, f"{where}.type: input items of type {kind!r} are not supported: use message, "
                           "function_call or function_call_output", f"{where}.type")
    return messages


def _message(item: dict, where: str) -> dict:
    check_keys(item, ("type", "role", "content", "id", "status", "phase"), where)
    role = item.get("role")
    if role not in _ROLES:
        raise APIError(400, f"{where}.role: {role!r} is not one of {', '.join(_ROLES)}", f"{where}.role")
    return {"role": role, "content": _text(item.get("content"), f"{where}.content")}


def _text(content: Any, where: str) -> str:
    """A content's text: a string, or text parts (input_text, output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: a string or a list of text parts is required", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise APIError(400, f"{where}.{j}.type: content part type {kind!r} is not supported: only text parts "
                           f"({', '.join(_TEXT_PARTS)})", f"{where}.{j}.type")
        check_keys(part, ("type", "text", "annotations", "logprobs"), f"{where}.{j}")
        texts.append(required_string(part, "text", f"{where}.{j}"))
    return "".join(texts)


def _function_call(item: dict, where: str) -> dict:
    """A function_call item as a chat tool call; its arguments must be a JSON object."""
    check_keys(item, ("type", "call_id", "name", "arguments", "id", "status"), where)
    call_id, name, arguments = (required_string(item, key, where) for key in ("call_id", "name", "arguments"))
    try:
        is_object = isinstance(json.loads(arguments), dict)
    except ValueError:
        is_object = False
    if not is_object:
        raise APIError(400, f"{where}.arguments: a function call's arguments must be a JSON object",
                       f"{where}.arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _function_call_output(item: dict, where: str, call_ids: set[str]) -> dict:
    check_keys(item, ("type", "call_id", "output", "id", "status"), where)
    call_id = required_string(item, "call_id", where)
    if call_id not in call_ids:
        raise APIError(400, f"{where}.call_id: no function_call before it has call_id {call_id!r}",
                       f"{where}.call_id")
    return {"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"), f"{where}.output")}


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict] | None:
    """Function tools in chat's shape; hosted tools (web_search, file_search, ...) are refused by type."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if tool.get("type") != "function":
            raise APIError(400, f"{where}.type: tool type {tool.get('type')!r} is not supported: only function tools",
                           f"{where}.type")
        if not isinstance(tool.get("name"), str):
            raise APIError(400, f"{where}.name: a function tool needs its name (the Responses shape has name, "
                           "description and parameters beside type, not under function)", f"{where}.name")
        check_keys(tool, ("type", "name", "description", "parameters", "strict"), where)
        if not isinstance(tool.get("parameters") or {}, dict):
            raise APIError(400, f"{where}.parameters: a JSON Schema object is required", f"{where}.parameters")
        out.append({"type": "function", "function": {
            key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None, tools: list[dict] | None) -> str | dict | None:
    """none | auto | required as they are; {type: function, name} as chat names a function. A choice
    that asks for a call needs tools to call."""
    if choice is None or choice in ("none", "auto"):
        return choice
    chat_choice: str | dict
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        chat_choice = {"type": "function", "function": {"name": choice["name"]}}
    elif choice == "required":
        chat_choice = choice
    else:
        raise APIError(400, "tool_choice: use none, auto, required or {\"type\": \"function\", \"name\": ...}",
                       "tool_choice")
    if not tools:
        raise APIError(400, "tool_choice asks for a function call, but the request has no tools", "tool_choice")
    return chat_choice


def response_format(text: dict[str, Any] | None) -> dict | None:
    """text.format as chat's response_format: text (no grammar), json_object or json_schema."""
    if text is None:
        return None
    check_keys(text, ("format",), "text")
    form = text.get("format")
    if form is None:
        return None
    kind = form.get("type") if isinstance(form, dict) else None
    if kind == "text" or kind == "json_object":
        check_keys(form, ("type",), "text.format")
        return {"type": kind}
    if kind != "json_schema":
        raise APIError(400, f"text.format.type {kind!r}: use text, json_object or json_schema", "text.format.type")
    check_keys(form, ("type", "name", "schema", "description", "strict"), "text.format")
    if not isinstance(form.get("schema"), dict):
        raise APIError(400, "text.format.schema: json_schema needs its schema (a JSON Schema object)",
                       "text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": form.get("name") or "response", "schema": form["schema"]}}
