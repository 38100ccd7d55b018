"""The Response object of the Responses API and its output items, built from the chat path's completion.

    chat completion                          Response
    message.reasoning (--reasoning-parser)   a reasoning item: [reasoning_text {text}], first
    message.content                          a message item: [output_text {text, logprobs}]
    message.tool_calls                       function_call items {call_id, name, arguments}
    finish_reason length                     status incomplete, incomplete_details max_output_tokens
    usage prompt/completion tokens           usage input/output tokens
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardserve.launch.openai_api.openai_serving import PreparedRequest
    from shardserve.launch.responses.request import ResponsesRequest


def response_head(body: ResponsesRequest, prepared: PreparedRequest) -> dict:
    """The Response as it starts (in progress, no output): what every state of it repeats of the request.
    temperature and top_p are those the request ran with (the model's defaults where the request left
    them out)."""
    text_format = (body.text or {}).get("format") or {"type": "text"}
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": prepared.created,
            "model": prepared.model, "status": "in_progress", "error": None, "incomplete_details": None,
            "instructions": body.instructions, "output": [], "usage": None,
            "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False, "tools": body.tools or [],
            "tool_choice": body.tool_choice or "auto", "temperature": prepared.params.temperature,
            "top_p": prepared.params.top_p, "top_logprobs": body.top_logprobs, "text": {"format": text_format},
            "truncation": "disabled", "reasoning": None, "previous_response_id": None, "store": False,
            "background": False, "user": body.user}


def from_completion(head: dict, completion: dict) -> dict:
    """The finished Response of a chat completion (one choice)."""
    (choice,) = completion["choices"]
    message, finish_reason = choice["message"], choice["finish_reason"]
    status = "incomplete" if finish_reason == "length" else "completed"
    calls = message.get("tool_calls") or []
    output = [reasoning_item(f"rs_{uuid.uuid4().hex}", message["reasoning"], status)] if message.get("reasoning") else []
    if message.get("content") or not calls:
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        output.append(message_item(f"msg_{uuid.uuid4().hex}", message.get("content") or "", logprobs, status))
    output += [function_call_item(f"fc_{uuid.uuid4().hex}", call) for call in calls]
    return finished(head, output, finish_reason, completion["usage"])


def message_item(item_id: str, text: str, logprobs: list[dict], status: str) -> dict:
    """An assistant message with one output_text part; `logprobs` in chat's per-token shape, which is
    the Responses shape too."""
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]}


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    """The reasoning a server's --reasoning-parser split off, as one reasoning_text part (no summary)."""
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def function_call_item(item_id: str, call: dict) -> dict:
    """A chat tool call ({id, function: {name, arguments}}) as a function_call item."""
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": "completed"}


def finished(head: dict, output: list[dict], finish_reason: str | None, usage: dict) -> dict:
    """The Response once generation has ended; `usage` is chat's, with its prompt_tokens_details."""
    is_cut = finish_reason == "length"
    num_cached = usage["prompt_tokens_details"]["cached_tokens"]
    return head | {
        "status": "incomplete" if is_cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if is_cut else None, "output": output,
        "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": num_cached},
                  "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage["total_tokens"]}}
