"""POST /v1/messages: Anthropic's Messages API over the chat path. The request becomes a chat request
(anthropic_request), runs as chat runs, and its chat completion becomes a Message (anthropic_output) or,
streamed, Anthropic's events (anthropic_stream). Every error on this route leaves in Anthropic's shape."""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated

from fastapi import Depends, FastAPI, Request

from shardserve.launch.anthropic.output import error_body, from_completion, message_head
from shardserve.launch.anthropic.request import MessagesRequest
from shardserve.launch.anthropic.stream import message_events
from shardserve.launch.server.api_error import APIError
from shardserve.launch.server.metrics import ServerMetrics
from shardserve.launch.openai_api.openai_serving import OpenAIServing, PreparedRequest
from shardserve.launch.openai_api.request_deltas import RequestDeltas
from shardserve.launch.server.fair_share import client_key
from shardserve.launch.server.prefix_router import session_key
from shardserve.launch.server.request_checks import app_path, parsed_body
from shardserve.launch.server.responding import off_loop, streaming, until_disconnect

MESSAGES_PATH = "/v1/messages"
# chat's names for what the Messages request calls otherwise, for the errors the chat path raises
_RENAMED = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens"}


def add_messages_routes(app: FastAPI, serving: OpenAIServing, metrics: ServerMetrics) -> None:
    """The route, and the middleware that reshapes its errors. NOTE: call it after the other middleware is
    added (the API key's among them): the last added runs first, so it sees every error the route answers."""

    @app.post(MESSAGES_PATH)
    async def messages(body: Annotated[MessagesRequest, Depends(parsed_body(MessagesRequest))], request: Request):
        try:
            prepared = await off_loop(lambda b: serving.prepare_chat(b.chat_request()), body)
            # a Message's stream ends with its usage
            prepared = dataclasses.replace(prepared, options=dataclasses.replace(prepared.options, include_usage=True),
                                           session=session_key(request.headers, (body.metadata or {}).get("user_id")),
                                           client=client_key((body.metadata or {}).get("user_id"), request))
            head, stops = message_head(prepared), tuple(body.stop_sequences or ())
            deltas = await serving.open(prepared)  # a grammar's 400 comes before any stream starts
        except APIError as e:
            raise in_messages_terms(e) from None
        if body.stream:
            return streaming(message_events(serving.stream(prepared, deltas), head, prepared.num_prompt_tokens, stops),
                             metrics, deltas)
        return await until_disconnect(_full_message(serving, prepared, deltas, head, stops), request, metrics, deltas)

    app.add_middleware(AnthropicErrors)


def in_messages_terms(error: APIError) -> APIError:
    """A chat path's error with the Messages request's names for its fields (stop_sequences, not stop)."""
    param = _RENAMED.get(error.param or "", error.param)
    message = error.message.replace("max_completion_tokens", "max_tokens")
    message = message.replace("ask for required or a named function", "ask for tool_choice any or tool")
    if param is not None and param != error.param and param not in message:
        message = f"{param}: {message}"
    return APIError(error.status, message, param, error.error_type)


async def _full_message(serving: OpenAIServing, prepared: PreparedRequest, deltas: RequestDeltas, head: dict,
                        stops: tuple[str, ...]) -> dict:
    return from_completion(head, await serving.full_response(prepared, deltas), stops)


class AnthropicErrors:
    """ASGI middleware: an error answered on /v1/messages, whoever answered it (the API key check, the body
    limit, admission, validation, the route), leaves as Anthropic's {"type": "error", "error": {type,
    message}} with the same status. The server's other routes keep OpenAI's shape."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or app_path(scope) != MESSAGES_PATH:
            return await self.app(scope, receive, send)
        start: dict | None = None
        parts: list[bytes] = []

        async def reshaped(message: dict) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until the body is in
                return
            if start is None:
                return await send(message)
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                body = _reshaped(start["status"], b"".join(parts))
                headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
                await send(start | {"headers": headers + [(b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, reshaped)


def _reshaped(status: int, body: bytes) -> bytes:
    """An OpenAI-shaped error body in Anthropic's shape; any other body (499's empty one) as it is."""
    try:
        error = json.loads(body)["error"]
        message = error["message"]
    except (ValueError, KeyError, TypeError):
        return body
    return json.dumps(error_body(status, message)).encode()
