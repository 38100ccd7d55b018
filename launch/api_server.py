"""The HTTP server: OpenAI routes, health, metrics and version over one ReplicaSet."""

from __future__ import annotations

import asyncio
import hmac

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shardserve.launch import __version__
from shardserve.launch.admission import Admission, InFlightLimit
from shardserve.launch.body_limit import BodyLimit
from shardserve.launch.metrics import ServerMetrics
from shardserve.launch.openai_serving import OpenAIServing, PreparedRequest
from shardserve.launch.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                        TokenizeRequest)
from shardserve.launch.replicas import ReplicaSet
from shardserve.launch.response_format import ErrorEvent


class ApiKeyAuth:
    """ASGI middleware: the API routes want 'Authorization: Bearer <key>' (compared in constant time).

    NOTE: plain ASGI, not @app.middleware("http"): Starlette's BaseHTTPMiddleware runs the app in a task
    of its own behind a memory stream, which hides a client's disconnect from the routes."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and \
                scope["path"].startswith(("/v1", "/tokenize", "/detokenize")):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
                return await JSONResponse(error.body(), 401)(scope, receive, send)
        await self.app(scope, receive, send)


def build_app(replicas: ReplicaSet, serving: OpenAIServing, metrics: ServerMetrics,
              api_key: str | None, max_queued_requests: int,
              allowed_origins: list[str] | None = None, *, max_request_body_bytes: int) -> FastAPI:
    app = FastAPI(title="shardserve", version=__version__)
    admission = app.state.admission = Admission(max_queued_requests, metrics)  # the launcher drains it
    app.add_middleware(InFlightLimit, admission=admission)
    app.add_middleware(BodyLimit, limit=max_request_body_bytes, metrics=metrics)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in allowed_origins)
    _install_error_handlers(app, metrics)
    _add_token_routes(app, serving)

    if api_key:
        app.add_middleware(ApiKeyAuth, api_key=api_key)

    @app.get("/health")
    async def health():
        dead = replicas.public_dead_reason()
        if dead:
            return JSONResponse({"status": "dead", "reason": dead}, status_code=503)
        if admission.is_draining:  # a load balancer sends no more
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": serving.served_model_name, "object": "model", "created": 0,
            "owned_by": "shardserve", "max_model_len": replicas.max_model_len}]}

    async def respond(prepared: PreparedRequest, body, request: Request):
        await serving.compile_grammar(prepared)  # a 400 comes before any stream starts
        if body.stream:
            return _streaming(serving.stream(prepared, body.include_usage), metrics)
        return await _until_disconnect(serving.full_response(prepared), request, metrics)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await respond(await off_loop(serving.prepare_completion, body), body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await respond(await off_loop(serving.prepare_chat, body), body, request)

    return app


def _install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Every error leaves as OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        metrics.outcome(e.outcome)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        # unknown routes and wrong methods: the same error shape as everything else
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError):
        metrics.outcome("rejected")
        errors = e.errors()
        if any(err["type"] == "json_invalid" for err in errors):
            return JSONResponse(APIError(400, "the request body is not valid JSON").body(), 400)
        fields = [".".join(str(p) for p in err["loc"][1:]) for err in errors]
        message = "; ".join(f"{f}: {err['msg']}" if f else err["msg"]
                            for f, err in zip(fields, errors))
        return JSONResponse(APIError(400, message or "invalid request",
                                     fields[0] if fields and fields[0] else None).body(), 400)


async def off_loop(prepare, body):
    """NOTE: a request's text is rendered (chat template) and tokenized in a worker thread: a text near the
    body limit takes seconds to tokenize, and on the event loop every stream would wait that long. A fast
    tokenizer lets go of the GIL while it encodes, so the loop goes on meanwhile."""
    return await asyncio.to_thread(prepare, body)


def _add_token_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """vLLM's /tokenize and /detokenize, through the same input processor as generation."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):  # the answer's JSON (millions of ids) is written off the loop too
        return await off_loop(lambda b: JSONResponse(serving.tokenize(b)), body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await off_loop(serving.detokenize, body)


class _EventStream(StreamingResponse):
    """NOTE: a client's departure cancels the response wherever it waits; closing the events here unwinds
    their generators at once (their finally clauses abort the prompts in the engine), rather than
    whenever the garbage collector finds them."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _streaming(events, metrics: ServerMetrics) -> StreamingResponse:
    async def counted():
        outcome, ended_by = "aborted", None
        try:
            async for event in events:
                if isinstance(event, ErrorEvent):  # ended by an error event (a drain, a dead engine)
                    ended_by = event.outcome
                yield event
            outcome = ended_by or "success"
        finally:
            metrics.outcome(outcome)
            await events.aclose()
    return _EventStream(counted(), media_type="text/event-stream")


async def _until_disconnect(coro, request: Request, metrics: ServerMetrics):
    """Run a non-streaming request; the moment its client goes away, cancel it: the cancel unwinds into
    the engine, which aborts its prompts and frees their blocks."""
    task = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # unwound: the abort is on its way to the engine
    if task.cancelled():
        metrics.outcome("aborted")
        return Response(status_code=499)  # nobody reads it
    result = task.result()  # re-raises APIError for the handler
    metrics.outcome("success")
    return result


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone: once the body is read, receive() has nothing else to say."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
