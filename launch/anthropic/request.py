"""Anthropic's Messages request (POST /v1/messages) and its translation into a chat completions request.

    system (a string or text blocks)          a system message, first
    messages: content as a string             a user or assistant message
    text blocks                               the message's text
    tool_use blocks (assistant)               the assistant message's tool_calls (arguments: the input as JSON)
    tool_result blocks (user)                 tool messages answering their tool_use_id
    a final assistant message                 continued, not answered (Anthropic's prefill)
    max_tokens, temperature, top_p, top_k     the same
    stop_sequences                            chat's stop
    output_config.format {json_schema}        chat's response_format json_schema (the output follows it)
    tools {name, description, input_schema}   chat's {type: function, function: {name, ..., parameters}}
    tool_choice auto | any | tool | none      auto | required | a named function | none;
                                              disable_parallel_tool_use: parallel_tool_calls false

NOTE: a tool_result with is_error true reaches the model as its text after "Error: ": a chat template has
no other place to say it. thinking and redacted_thinking blocks in earlier assistant turns are accepted
and not shown to the model, as reasoning templates drop earlier turns' reasoning too (passed on as chat's
reasoning_content, they would make every template that reads none refuse the request). cache_control is accepted wherever Anthropic takes it: the prefix cache keeps every
prompt's blocks without being asked. Anything else the server cannot honour (images, documents, hosted
tools, extended thinking settings, output_config.effort) is a 400 that names the field.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from pydantic import ConfigDict, Field, ValidationError

from shardserve.launch.server.api_error import APIError
from shardserve.launch.openai_api.protocol import ChatCompletionRequest
from shardserve.launch.server.request_checks import Items, UnicodeBody, check_keys, is_neutral, required_string

_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # "tool" names a function


class MessagesRequest(UnicodeBody):
    model_config = ConfigDict(extra="allow")  # an extra field is refused by name unless it asks for nothing

    model: str
    messages: Items[Any]
    max_tokens: int = Field(ge=1)
    system: Optional[Union[str, Items[Any]]] = None
    temperature: Optional[float] = Field(None, ge=0, le=1, allow_inf_nan=False)  # Anthropic's range
    top_p: Optional[float] = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: Optional[int] = None
    stop_sequences: Optional[Items[str]] = None
    stream: bool = False
    tools: Optional[Items[Any]] = None
    tool_choice: Optional[dict[str, Any]] = None
    metadata: Optional[dict[str, Any]] = None  # {user_id}: asks for nothing that changes the reply
    chat_template_kwargs: Optional[dict[str, Any]] = None  # vLLM's extra, passed on to the chat template
    output_config: Optional[dict[str, Any]] = None  # {format: {type: json_schema, schema}}; effort is refused

    def chat_request(self) -> ChatCompletionRequest:
        """The same request as chat completions takes it; a field chat cannot honour is refused first."""
        for name, value in (self.model_extra or {}).items():
            if name != "cache_control" and not is_neutral(name, value):
                raise APIError(400, f"{name} is not supported: {_WHY.get(name, 'this server does not know it')}",
                               name)
        messages = conversation(self.system, self.messages)
        is_prefill = self.messages[-1].get("role") == "assistant"
        tools = chat_tools(self.tools)
        choice, parallel = chat_tool_choice(self.tool_choice, tools)
        fields = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                  "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                  "stop": self.stop_sequences, "stream": self.stream, "tools": tools, "tool_choice": choice,
                  "parallel_tool_calls": parallel, "chat_template_kwargs": self.chat_template_kwargs,
                  "response_format": output_format(self.output_config),
                  "add_generation_prompt": not is_prefill, "continue_final_message": is_prefill}
        try:
            return ChatCompletionRequest.model_validate(fields)
        except ValidationError as e:  # the translation makes valid messages: what fails is a field as given
            error = e.errors()[0]
            where = ".".join(str(p) for p in error["loc"])
            raise APIError(400, f"{where}: {error['msg']}", str(error["loc"][0])) from None


_WHY = {"thinking": "this server sets no thinking budget; with --reasoning-parser a model's reasoning comes back "
                    "as a thinking block",
        "container": "this server runs no tools of its own", "mcp_servers": "this server runs no tools of its own"}


def conversation(system: str | list[Any] | None, messages: list[Any]) -> list[dict]:
    """The chat messages of `system` and `messages`, each message and block checked where it stands."""
    system_text = None if system is None else _text(system, "system")
    out: list[dict] = [] if not system_text else [{"role": "system", "content": system_text}]
    if not messages:
        raise APIError(400, "messages must not be empty", "messages")
    tool_ids: set[str] = set()
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise APIError(400, f"{where}: a message is an object with role and content", where)
        _check_keys(message, ("role", "content"), where)
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise APIError(400, f"{where}.role: {role!r} is not user or assistant (a system prompt goes in system)",
                           f"{where}.role")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise APIError(400, f"{where}.content: a string or a list of content blocks is required",
                           f"{where}.content")
        elif role == "assistant":
            out.append(_assistant(content, f"{where}.content", tool_ids, is_last=i == len(messages) - 1))
        else:
            out += _user(content, f"{where}.content", tool_ids)
    return out


def _check_keys(item: dict, known: tuple[str, ...], where: str) -> None:
    check_keys(item, (*known, "cache_control"), where)  # a prompt-caching hint: any block may carry it


def _block_type(block: Any, where: str, allowed: tuple[str, ...]) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in allowed:
        raise APIError(400, f"{where}.type: content block type {kind!r} is not supported here: use "
                       f"{', '.join(allowed)} (this server serves text)", f"{where}.type")
    return kind


def _text(content: str | list[Any], where: str) -> str:
    """A string, or text blocks joined (as chat joins text parts)."""
    if isinstance(content, str):
        return content
    for j, block in enumerate(content):
        _block_type(block, f"{where}.{j}", ("text",))
    return "".join(_block_text(block, f"{where}.{j}") for j, block in enumerate(content))


def _block_text(block: dict, where: str) -> str:
    _check_keys(block, ("type", "text"), where)
    return required_string(block, "text", where)


def _user(blocks: list[Any], where: str, tool_ids: set[str]) -> list[dict]:
    """A user turn: its tool results as tool messages and its text as user messages, in their order."""
    out: list[dict] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        if _block_type(block, at, ("text", "tool_result")) == "text":
            texts.append(_block_text(block, at))
            continue
        if texts:
            out.append({"role": "user", "content": "".join(texts)})
            texts = []
        _check_keys(block, ("type", "tool_use_id", "content", "is_error"), at)
        tool_use_id = required_string(block, "tool_use_id", at)
        if tool_use_id not in tool_ids:
            raise APIError(400, f"{at}.tool_use_id: no tool_use block before it has id {tool_use_id!r}",
                           f"{at}.tool_use_id")
        result = block.get("content")
        text = "" if result is None else _text(result, f"{at}.content") if isinstance(result, (str, list)) else None
        if text is None:
            raise APIError(400, f"{at}.content: a string or a list of text blocks is required", f"{at}.content")
        text = f"Error: {text}" if block.get("is_error") else text
        out.append({"role": "tool", "tool_call_id": tool_use_id, "content": text})
    if texts or not blocks:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant(blocks: list[Any], where: str, tool_ids: set[str], is_last: bool) -> dict:
    """An assistant turn: its text, and its tool_use blocks as tool calls. A final one (a prefill) is
    continued, so it holds text only."""
    texts, calls = [], []
    allowed = ("text", "thinking", "redacted_thinking") + (() if is_last else ("tool_use",))
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        kind = _block_type(block, at, allowed)
        if kind == "text":
            texts.append(_block_text(block, at))
        elif kind == "tool_use":
            _check_keys(block, ("type", "id", "name", "input"), at)
            call_id, name = required_string(block, "id", at), required_string(block, "name", at)
            if not isinstance(block.get("input"), dict):
                raise APIError(400, f"{at}.input: a tool_use block's input is an object", f"{at}.input")
            tool_ids.add(call_id)
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(block["input"])}})
        else:
            _check_keys(block, ("type", "thinking", "signature", "data"), at)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    return message | ({"tool_calls": calls} if calls else {})


def chat_tools(tools: list[Any] | None) -> list[dict] | None:
    """Client tools in chat's shape; Anthropic's hosted tools (web_search, bash, ...) are refused by type."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        kind = tool.get("type") if isinstance(tool, dict) else "?"
        if kind not in (None, "custom"):
            raise APIError(400, f"{where}.type: tool type {kind!r} is not supported: only client tools (name, "
                           "description, input_schema)", f"{where}.type")
        _check_keys(tool, ("type", "name", "description", "input_schema", "strict"), where)
        name = required_string(tool, "name", where)
        if not isinstance(tool.get("input_schema"), dict):
            raise APIError(400, f"{where}.input_schema: a JSON Schema object is required", f"{where}.input_schema")
        function = {"name": name, "parameters": tool["input_schema"]}
        out.append({"type": "function", "function": function | (
            {"description": tool["description"]} if tool.get("description") is not None else {})})
    return out


def chat_tool_choice(choice: dict[str, Any] | None, tools: list[dict] | None) -> tuple[str | dict | None, bool | None]:
    """(chat's tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    _check_keys(choice, ("type", "name", "disable_parallel_tool_use"), "tool_choice")
    if kind == "tool":
        chat_choice: str | dict = {"type": "function", "function": {"name": required_string(choice, "name", "tool_choice")}}
    elif kind in _TOOL_CHOICES:
        chat_choice = _TOOL_CHOICES[kind]
    else:
        raise APIError(400, f"tool_choice.type {kind!r}: use auto, any, tool or none", "tool_choice.type")
    if not tools:
        if kind in ("any", "tool"):
            raise APIError(400, f"tool_choice {kind} asks for a tool call, but the request has no tools",
                           "tool_choice")
        return None, None  # auto or none among no tools: nothing to choose
    return chat_choice, (False if choice.get("disable_parallel_tool_use") else None)


def output_format(config: dict[str, Any] | None) -> dict | None:
    """Anthropic's output_config as chat's response_format: its format (a JSON schema) constrains the output,
    as vLLM's Messages route does. effort is refused: this server sets no reasoning effort (a chat template
    that does not read one would drop it in silence)."""
    if not config:
        return None
    _check_keys(config, ("format", "effort"), "output_config")
    if config.get("effort") is not None:
        raise APIError(400, "output_config.effort is not supported: this server sets no reasoning effort; leave "
                       "it out (the model reasons as its chat template has it)", "output_config.effort")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type", "json_schema") != "json_schema":
        raise APIError(400, "output_config.format: only {\"type\": \"json_schema\", \"schema\": {...}} is supported",
                       "output_config.format")
    _check_keys(fmt, ("type", "schema"), "output_config.format")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise APIError(400, "output_config.format.schema: a JSON schema (an object) is required",
                       "output_config.format.schema")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
