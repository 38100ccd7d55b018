"""Anthropic's Message and its content blocks, built from the chat path's completion.

    chat completion                          Message
    message.reasoning (--reasoning-parser)   a thinking block, first (its signature empty: nothing signs it)
    message.content                          a text block (none when the content is empty)
    message.tool_calls                       tool_use blocks {id, name, input}
    finish_reason length                     stop_reason max_tokens
    a tool call                              stop_reason tool_use
    stop_reason (the stop string matched)    stop_reason stop_sequence, stop_sequence
    otherwise                                stop_reason end_turn
    usage prompt/completion tokens           usage input/output tokens

NOTE: a call cut short by max_tokens has arguments that are not yet a JSON object, which a tool_use block
cannot hold: it comes back as a text block with the arguments as far as they came, beside stop_reason
max_tokens, so nothing generated is lost.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardserve.launch.openai_api.openai_serving import PreparedRequest

# Anthropic's error type for each HTTP status this server answers with
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    """Anthropic's error: {"type": "error", "error": {"type", "message"}}."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def message_head(prepared: PreparedRequest) -> dict:
    """What every state of the Message repeats: its id, type, role and model."""
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": prepared.model}


def from_completion(head: dict, completion: dict, stop_sequences: tuple[str, ...]) -> dict:
    """The Message of a chat completion (one choice)."""
    (choice,) = completion["choices"]
    message = choice["message"]
    content = []
    if message.get("reasoning"):
        content.append(thinking_block(message["reasoning"]))
    if message.get("content"):
        content.append(text_block(message["content"]))
    content += [tool_use_block(call) or text_block(call["function"]["arguments"])
                for call in message.get("tool_calls") or ()]
    has_tool_use = any(block["type"] == "tool_use" for block in content)
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"), has_tool_use, stop_sequences)
    usage = completion["usage"]
    return head | {"content": content, "stop_reason": reason, "stop_sequence": sequence,
                   "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}}


def stop_reason(finish_reason: str | None, matched: int | str | None, has_tool_use: bool,
                stop_sequences: tuple[str, ...]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of chat's finish_reason and stop_reason (the stop string or token id matched)."""
    if finish_reason == "length":
        return "max_tokens", None
    if has_tool_use:
        return "tool_use", None
    if isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    return "end_turn", None


def text_block(text: str) -> dict:
    return {"type": "text", "text": text}


def thinking_block(text: str) -> dict:
    return {"type": "thinking", "thinking": text, "signature": ""}


def tool_use_block(call: dict) -> dict | None:
    """A chat tool call ({id, function: {name, arguments}}) as a tool_use block; None when its arguments are
    not a JSON object (a call cut short by max_tokens)."""
    try:
        arguments = json.loads(call["function"]["arguments"])
    except ValueError:
        return None
    if not isinstance(arguments, dict):
        return None
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": arguments}
