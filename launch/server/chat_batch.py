"""POST /v1/chat/completions/batch: vLLM's batch of conversations in one request, over the chat path.

The body is a chat completions request whose `messages` is a list of conversations. Each conversation
runs as its own chat request with the other fields, all at once; the answer is one chat completion with a
choice per conversation (index i for conversation i) and the usage of them all. As on vLLM, a batch does
not stream, call tools or take n > 1; here those, and prompt_logprobs (whose place is per conversation),
are refused by name. An error names the conversation: messages.2.content.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from shardserve.launch.server.api_error import APIError
from shardserve.launch.server.fair_share import client_key
from shardserve.launch.server.metrics import ServerMetrics
from shardserve.launch.openai_api.openai_serving import OpenAIServing, PreparedRequest
from shardserve.launch.openai_api.request_deltas import RequestDeltas
from shardserve.launch.openai_api.protocol import ChatCompletionRequest
from shardserve.launch.server.request_checks import json_body
from shardserve.launch.server.responding import off_loop, until_disconnect

BATCH_PATH = "/v1/chat/completions/batch"
# fields a batch refuses unless they ask for nothing: (field, the value that asks for nothing, why)
_REFUSED = (("stream", False, "a batch answers once, as one chat completion"),
            ("n", 1, "a batch has one choice per conversation"),
            ("tools", None, "a batch calls no tools"), ("tool_choice", "none", "a batch calls no tools"),
            ("prompt_logprobs", None, "a batch's response has no place for each conversation's"))


def add_chat_batch_routes(app: FastAPI, serving: OpenAIServing, metrics: ServerMetrics) -> None:

    @app.post(BATCH_PATH)
    async def chat_batch(request: Request):
        data = await json_body(request)
        bodies = conversations(data)
        prepared = await off_loop(lambda b: [_prepared(serving, body, i) for i, body in enumerate(b)], bodies)
        opened: list = []
        client = client_key(data.get("user"), request)
        try:
            for one in prepared:
                one.client = client
                opened.append(await serving.open(one))  # the same grammar for each: compiled once, then cached
        except BaseException:
            for deltas in opened:
                await deltas.aclose()
            raise
        return await until_disconnect(_batch_response(serving, prepared, opened), request, metrics, opened)


def conversations(data: Any) -> list[ChatCompletionRequest]:
    """One chat request per conversation of `messages`, with the batch's other fields."""
    if not isinstance(data, dict):
        raise APIError(400, "the request body is a JSON object", None)
    batch = data.get("messages")
    if not isinstance(batch, list) or not batch or not all(isinstance(c, list) for c in batch):
        raise APIError(400, "messages: a batch's messages is a non-empty list of conversations (lists of "
                       "messages); a single conversation goes to /v1/chat/completions", "messages")
    for name, neutral, why in _REFUSED:
        if data.get(name, neutral) not in (neutral, None, []):
            raise APIError(400, f"{name} is not supported by {BATCH_PATH}: {why}", name)
    bodies = []
    for i, conversation in enumerate(batch):
        try:
            bodies.append(ChatCompletionRequest.model_validate(data | {"messages": conversation}))
        except ValidationError as e:  # reported as the route's own validation errors, at the conversation
            errors = [err | {"loc": ("body", *_at(err["loc"], i))} for err in e.errors()]
            raise RequestValidationError(errors) from None
        except APIError as e:  # text that is not valid Unicode
            raise _in_batch(e, i) from None
    return bodies


def _at(loc: tuple, index: int) -> tuple:
    """A conversation's error location in the batch: messages.3 -> messages.<index>.3."""
    return ("messages", index, *loc[1:]) if loc and loc[0] == "messages" else loc


def _prepared(serving: OpenAIServing, body: ChatCompletionRequest, index: int) -> PreparedRequest:
    try:
        return serving.prepare_chat(body)
    except APIError as e:
        raise _in_batch(e, index) from None


def _in_batch(error: APIError, index: int) -> APIError:
    """A conversation's error, named in the batch: messages.<index>... where it is about the messages, else
    its message says which conversation (a prompt too long for its max_tokens)."""
    param = error.param or ""
    if not param.startswith("messages"):
        message = f"messages.{index}: {error.message}" if error.status == 400 else error.message
        return APIError(error.status, message, error.param, error.error_type)
    where = f"messages.{index}" + param.removeprefix("messages")
    message = error.message
    message = message.replace(param, where, 1) if message.startswith(param) else f"{where}: {message}"
    return APIError(error.status, message, where, error.error_type)


async def _batch_response(serving: OpenAIServing, prepared: list[PreparedRequest],
                          opened: list[RequestDeltas]) -> dict:
    """Every conversation's completion, at once, as one; the moment one fails the others are cancelled
    (their prompts aborted), and its error is the batch's."""
    tasks = [asyncio.ensure_future(serving.full_response(one, deltas)) for one, deltas in zip(prepared, opened)]
    try:
        completions = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    choices = []
    for i, completion in enumerate(completions):
        (choice,) = completion["choices"]
        ids = {"prompt_token_ids": completion["prompt_token_ids"]} if "prompt_token_ids" in completion else {}
        choices.append(choice | {"index": i} | ids)
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": serving.served_model_name, "choices": choices,
            "usage": _summed([completion["usage"] for completion in completions]), "prompt_logprobs": None}


def _summed(usages: list[dict]) -> dict:
    total = {key: sum(u[key] for u in usages) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
    if "prompt_tokens_details" in usages[0]:
        total["prompt_tokens_details"] = {"cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"]
                                                               for u in usages)}
    return total
