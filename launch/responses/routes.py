"""POST /v1/responses: OpenAI's Responses API over the chat path. The request becomes a chat request
(responses_request), runs as chat runs, and its chat completion becomes a Response (responses_output)
or, streamed, the Responses events (responses_stream)."""

from __future__ import annotations

import dataclasses
from typing import Annotated

from fastapi import Depends, FastAPI, Request

from shardserve.launch.server.api_error import APIError
from shardserve.launch.server.metrics import ServerMetrics
from shardserve.launch.openai_api.openai_serving import OpenAIServing, PreparedRequest
from shardserve.launch.openai_api.request_deltas import RequestDeltas
from shardserve.launch.server.fair_share import client_key
from shardserve.launch.server.prefix_router import session_key
from shardserve.launch.responses.output import from_completion, response_head
from shardserve.launch.responses.request import ResponsesRequest
from shardserve.launch.responses.stream import response_events
from shardserve.launch.server.responding import off_loop, streaming, until_disconnect
from shardserve.launch.server.request_checks import parsed_body

# chat's names for what the Responses request calls otherwise, for the errors the chat path raises
_RENAMED = {"messages": "input", "response_format": "text.format", "max_completion_tokens": "max_output_tokens",
            "max_tokens": "max_output_tokens"}


def add_responses_routes(app: FastAPI, serving: OpenAIServing, metrics: ServerMetrics) -> None:

    @app.post("/v1/responses")
    async def responses(body: Annotated[ResponsesRequest, Depends(parsed_body(ResponsesRequest))], request: Request):
        try:
            prepared = await off_loop(lambda b: serving.prepare_chat(b.chat_request()), body)
            # a Response's usage always has its cached tokens; a stream always ends with it
            options = dataclasses.replace(prepared.options, include_usage=True, prompt_tokens_details=True)
            session = session_key(request.headers, (body.model_extra or {}).get("prompt_cache_key"), body.user)
            prepared = dataclasses.replace(prepared, options=options, session=session,
                                           client=client_key(body.user, request))
            head = response_head(body, prepared)
            deltas = await serving.open(prepared)  # a grammar's 400 comes before any stream starts
        except APIError as e:
            raise in_responses_terms(e) from None
        if body.stream:
            return streaming(response_events(serving.stream(prepared, deltas), head), metrics, deltas)
        return await until_disconnect(_full_response(serving, prepared, deltas, head), request, metrics, deltas)


def in_responses_terms(error: APIError) -> APIError:
    """A chat path's error with the Responses request's names for its fields (input, not messages)."""
    message = error.message
    for chat_name in ("response_format", "max_completion_tokens", "max_tokens"):  # never words in a message
        message = message.replace(chat_name, _RENAMED[chat_name])
    head = (error.param or "").split(".")[0]
    param = _RENAMED[head] if head in _RENAMED else error.param
    return APIError(error.status, message, param, error.error_type)


async def _full_response(serving: OpenAIServing, prepared: PreparedRequest, deltas: RequestDeltas,
                         head: dict) -> dict:
    return from_completion(head, await serving.full_response(prepared, deltas))
