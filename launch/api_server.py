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
from shardserve.launch.metrics import ServerMetrics
from shardserve.launch.openai_serving import OpenAIServing, PreparedRequest
from shardserve.launch.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                        TokenizeRequest)
from shardserve.launch.replicas import ReplicaSet


class InFlightLimit:
    """ASGI middleware: counts API requests from arrival until their response is fully sent
    (streams included, disconnects too) and answers 503 beyond `limit`.

    NOTE: counting here, not in the engine, closes the race where a burst passes the check
    before any of its requests has reached a replica."""

    def __init__(self, app, limit: int, metrics: ServerMetrics):
        self.app, self.limit, self.metrics = app, limit, metrics
        self.active = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or \
                not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        if self.active >= self.limit:
            self.metrics.outcome("unavailable")
            error = APIError(503, f"server overloaded: {self.active} requests in flight; retry "
                             "later", error_type="service_unavailable")
            return await JSONResponse(error.body(), 503)(scope, receive, send)
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


def build_app(replicas: ReplicaSet, serving: OpenAIServing, metrics: ServerMetrics,
              api_key: str | None, max_queued_requests: int,
              allowed_origins: list[str] | None = None) -> FastAPI:
    app = FastAPI(title="shardserve", version=__version__)
    app.add_middleware(InFlightLimit, limit=max_queued_requests, metrics=metrics)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in allowed_origins)
    _install_error_handlers(app, metrics)
    _add_token_routes(app, serving)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        path = request.url.path
        if api_key and request.method != "OPTIONS" and path.startswith(("/v1", "/tokenize", "/detokenize")):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return JSONResponse(APIError(401, "missing or wrong API key: send "
                                             "'Authorization: Bearer <key>'").body(), 401)
        return await call_next(request)

    @app.get("/health")
    async def health():
        dead = replicas.public_dead_reason()
        if dead:
            return JSONResponse({"status": "dead", "reason": dead}, status_code=503)
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
        if body.stream:
            return _streaming(serving.stream(prepared, body.include_usage), metrics)
        return await _until_disconnect(serving.full_response(prepared), request, metrics)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await respond(serving.prepare_completion(body), body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await respond(serving.prepare_chat(body), body, request)

    return app


def _install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Every error leaves as OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        if e.status < 500 or e.error_type == "service_unavailable":
            metrics.outcome("rejected" if e.status < 500 else "unavailable")
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


def _add_token_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """vLLM's /tokenize and /detokenize, through the same input processor as generation."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return serving.detokenize(body)


def _streaming(events, metrics: ServerMetrics) -> StreamingResponse:
    async def counted():
        outcome = "aborted"
        try:
            async for event in events:
                yield event
            outcome = "success"
        finally:
            metrics.outcome(outcome)
    return StreamingResponse(counted(), media_type="text/event-stream")


async def _until_disconnect(coro, request: Request, metrics: ServerMetrics):
    """Run a non-streaming request; if the client goes away, cancel it (freeing its blocks)."""
    task = asyncio.ensure_future(coro)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            result = task.result()  # re-raises APIError for the handler
            metrics.outcome("success")
            return result
        if await request.is_disconnected():
            task.cancel()
            metrics.outcome("aborted")
            return Response(status_code=499)
