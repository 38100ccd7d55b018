"""A chat request's messages through the chat template: the request's own template (only where the server
trusts requests with one), the check that the template renders the tools, tool calls and reasoning it is given, and
the flags that end the conversation (a generation prompt, or the final message left open)."""

from __future__ import annotations

import re
from typing import Any

from shardserve.launch.server.api_error import APIError, as_api_error
from shardserve.launch.openai_api.tool_calls import ToolCallError, template_messages
from shardserve.runtime.input_processor import InputProcessor


def template_kwargs(chat_template: str | None, chat_template_kwargs: dict[str, Any] | None, trusted: bool) -> dict:
    """The request's chat_template_kwargs, its own template among them. NOTE: a template is code the server
    runs (a loop in one holds a thread for seconds): a request's own runs only on a server started with
    --trust-request-chat-template, as on vLLM."""
    kwargs = dict(chat_template_kwargs or {})
    field = "chat_template_kwargs.chat_template" if "chat_template" in kwargs else None
    if chat_template is not None:
        kwargs["chat_template"], field = chat_template, "chat_template"
    if field is not None and not trusted:
        raise APIError(400, f"{field}: this server runs only its own chat template; start it with "
                       "--trust-request-chat-template to let requests bring theirs", field)
    return kwargs


# how a chat template that reads a field names it: an assistant turn's reasoning is `reasoning_content` (Qwen3,
# DeepSeek-R1) or `thinking` (gpt-oss; a whole word: not enable_thinking)
_READS = {"tools": re.compile("tools"), "tool_calls": re.compile("tool_calls"),
          "reasoning_content": re.compile(r"(?<!\w)(?:reasoning_content|thinking)(?!\w)")}


def template_conversation(messages: list[dict]) -> list[dict]:
    """OpenAI messages as chat templates read them (tool-call arguments as mappings, reasoning under both
    names templates read it by)."""
    try:
        messages = template_messages(messages)
    except ToolCallError as e:
        raise APIError(400, str(e), e.field) from None
    return [m | {"thinking": m["reasoning_content"]} if "reasoning_content" in m else m for m in messages]


def check_template_renders(processor: InputProcessor, conversation: list[dict], has_tools: bool,
                           kwargs: dict) -> None:
    """Tools, tool calls or reasoning that the chat template never reads would be dropped without a word."""
    template = kwargs.get("chat_template") or getattr(processor.tokenizer, "chat_template", None) or ""
    needs = (["tools"] if has_tools else []) + [name for name in ("tool_calls", "reasoning_content")
                                                if any(name in m for m in conversation)]
    for name in needs:
        if not _READS[name].search(template):
            field = "tools" if name == "tools" else _message_field(conversation, name)
            raise APIError(400, f"{field}: this model's chat template does not render {name}: start the server "
                           "with a --chat-template that does", field)


def _message_field(conversation: list[dict], name: str) -> str:
    """The first message with `name`, as the field to report (messages.1.reasoning_content)."""
    index = next(i for i, m in enumerate(conversation) if name in m)
    return f"messages.{index}.{name}"


def template_arguments(processor: InputProcessor, conversation: list[dict], tools: list[dict] | None,
                       flags: dict[str, bool], kwargs: dict) -> tuple[bool, dict]:
    """(add_generation_prompt, the template's other arguments) for a checked conversation: `flags`
    (add_generation_prompt, continue_final_message) and the tools (None: not shown) beside `kwargs`."""
    check_template_renders(processor, conversation, bool(tools), kwargs)
    extra = {name: value for name, value in flags.items() if name != "add_generation_prompt"}
    return flags["add_generation_prompt"], kwargs | extra | ({"tools": tools} if tools else {})


def render(processor: InputProcessor, conversation: list[dict], tools: list[dict] | None,
           flags: dict[str, bool], kwargs: dict) -> str:
    """The prompt text of a conversation (template_arguments)."""
    add_generation_prompt, arguments = template_arguments(processor, conversation, tools, flags, kwargs)
    with as_api_error("messages"):
        return processor.apply_chat_template(conversation, add_generation_prompt, arguments)
