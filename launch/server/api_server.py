"""The HTTP server: OpenAI routes, health, metrics and version over one ReplicaSet."""

from __future__ import annotations

import hmac
import json
from functools import partial
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from shardserve.launch import __version__
from shardserve.launch.server.admission import Admission, InFlightLimit
from shardserve.launch.anthropic.messages import MESSAGES_PATH, add_messages_routes
from shardserve.launch.server.body_limit import BodyLimit
from shardserve.launch.server.chat_batch import add_chat_batch_routes
from shardserve.launch.server.embeddings import add_embedding_routes
from shardserve.launch.server.lora_routes import add_lora_routes
from shardserve.launch.server.metrics import ServerMetrics
from shardserve.launch.openai_api.openai_serving import OpenAIServing, PreparedRequest
from shardserve.launch.server.fair_share import client_key
from shardserve.launch.server.prefix_router import session_key
from shardserve.launch.openai_api.protocol import APIError, ChatCompletionRequest, CompletionRequest
from shardserve.launch.server.replicas import ReplicaSet, public_message
from shardserve.launch.server.request_checks import API_PATHS, app_path, document_bodies, json_body, parsed_body
from shardserve.launch.server.responding import off_loop, streaming, until_disconnect
from shardserve.launch.responses.routes import add_responses_routes
from shardserve.launch.server.tokenization import DetokenizeRequest, TokenizeRequest, tokenizer_info


class ApiKeyAuth:
    """ASGI middleware: the API routes want 'Authorization: Bearer <key>' (compared in constant time);
    /v1/messages takes Anthropic's 'x-api-key: <key>' as well, as the anthropic SDK sends it.

    NOTE: plain ASGI, not @app.middleware("http"): Starlette's BaseHTTPMiddleware runs the app in a task
    of its own behind a memory stream, which hides a client's disconnect from the routes."""

    def __init__(self, app, api_key: str):
        self.app, self.expected, self.key = app, f"Bearer {api_key}".encode(), api_key.encode()

    async def __call__(self, scope, receive, send):
        path = app_path(scope)
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and path.startswith(API_PATHS):
            headers, is_messages = dict(scope["headers"]), path == MESSAGES_PATH
            is_known = hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
            if is_messages and hmac.compare_digest(headers.get(b"x-api-key", b""), self.key):
                is_known = True
            if not is_known:
                either = " or 'x-api-key: <key>'" if is_messages else ""
                error = APIError(401, f"missing or wrong API key: send 'Authorization: Bearer <key>'{either}")
                return await JSONResponse(error.body(), 401)(scope, receive, send)
        await self.app(scope, receive, send)


def build_app(replicas: ReplicaSet, serving: OpenAIServing, metrics: ServerMetrics,
              api_key: str | None, max_queued_requests: int,
              allowed_origins: list[str] | None = None, *, max_request_body_bytes: int,
              request_read_timeout: float) -> FastAPI:
    app = FastAPI(title="shardserve", version=__version__, root_path=serving.options.root_path or "")
    admission = app.state.admission = Admission(max_queued_requests, metrics)  # the launcher drains it
    app.add_middleware(InFlightLimit, admission=admission)
    app.add_middleware(BodyLimit, limit=max_request_body_bytes, read_timeout=request_read_timeout, metrics=metrics)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in allowed_origins)
    _install_error_handlers(app, metrics)
    document_bodies(app)  # the routes' bodies are parsed off the event loop (parsed_body)
    _add_token_routes(app, serving)
    add_responses_routes(app, serving, metrics)  # POST /v1/responses, over the chat path
    add_embedding_routes(app, replicas, serving, metrics)  # POST /v1/embeddings (runner pooling)

    if api_key:
        app.add_middleware(ApiKeyAuth, api_key=api_key)
    add_messages_routes(app, serving, metrics)  # POST /v1/messages (Anthropic's); after the key: it reshapes its 401
    add_chat_batch_routes(app, serving, metrics)  # POST /v1/chat/completions/batch (vLLM's)

    @app.get("/health")
    async def health():
        dead = replicas.public_dead_reason()
        if dead:
            return JSONResponse({"status": "dead", "reason": dead}, status_code=503)
        if admission.is_draining:  # a load balancer sends no more
            return JSONResponse({"status": "shutting down"}, status_code=503)
        down = replicas.down()
        if down:  # the others serve while these restart
            return {"status": "degraded", "replicas_down": {str(i): public_message(r) for i, r in down.items()}}
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    if serving.options.enable_server_load_tracking:
        @app.get("/load")
        async def load():  # vLLM's server load metric: API requests in flight, for load-aware routers
            return {"server_load": admission.num_in_flight}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():  # SageMaker's health check
        return await health()

    _add_info_routes(app, replicas, serving)
    _add_generation_routes(app, serving, metrics)
    return app


def _add_info_routes(app: FastAPI, replicas: ReplicaSet, serving: OpenAIServing) -> None:
    @app.get("/v1/models")
    async def models():
        """vLLM's model cards; root is the served name, where vLLM puts the model's path (no path in a response)."""
        return {"object": "list", "data": [{
            "id": serving.served_model_name, "object": "model", "created": 0, "owned_by": "shardserve",
            "root": serving.served_model_name, "parent": None, "max_model_len": replicas.max_model_len,
            "permission": [{"id": f"modelperm-{serving.served_model_name}", "object": "model_permission",
                            "created": 0, "allow_create_engine": False, "allow_sampling": True,
                            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                            "allow_fine_tuning": False, "organization": "*", "group": None,
                            "is_blocking": False}]}, *[{
            "id": name, "object": "model", "created": 0, "owned_by": "shardserve", "root": name,
            "parent": serving.served_model_name, "max_model_len": replicas.max_model_len, "permission": []}
            for name in serving.loras.adapters]]}

    if serving.options.enable_runtime_lora_updating:  # as vLLM: any client may add adapters, so off unless asked
        add_lora_routes(app, serving)

    if serving.options.enable_tokenizer_info_endpoint:  # as vLLM: it shows the chat template, so off unless asked
        @app.get("/tokenizer_info")
        async def tokenizer_information():
            return tokenizer_info(serving)


def _add_generation_routes(app: FastAPI, serving: OpenAIServing, metrics: ServerMetrics) -> None:
    async def respond(prepared: PreparedRequest, body, request: Request):
        extra = body.model_extra or {}
        prepared.session = session_key(request.headers, extra.get("prompt_cache_key"), extra.get("user"))
        prepared.client = client_key(extra.get("user"), request)
        deltas = await serving.open(prepared)  # a grammar's 400 comes before any stream starts
        if body.stream:
            return streaming(serving.stream(prepared, deltas), metrics, deltas)
        return await until_disconnect(serving.full_response(prepared, deltas), request, metrics, deltas)

    @app.post("/v1/completions")
    async def completions(body: Annotated[CompletionRequest, Depends(parsed_body(CompletionRequest))], request: Request):
        return await respond(await off_loop(serving.prepare_completion, body), body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: Annotated[ChatCompletionRequest, Depends(parsed_body(ChatCompletionRequest))], request: Request):
        return await respond(await off_loop(serving.prepare_chat, body), body, request)

    @app.post("/invocations")
    async def invocations(request: Request):
        """SageMaker's one route, by the body's shape: messages make a chat completion, a prompt a completion."""
        data = await json_body(request)
        kind = next((k for field, k in (("messages", ChatCompletionRequest), ("prompt", CompletionRequest))
                     if isinstance(data, dict) and field in data), None)
        if kind is None:
            raise APIError(400, "/invocations serves a body with messages (a chat completion) or with a prompt "
                           "(a completion)", "messages")
        try:
            body = kind.model_validate(data)
        except ValidationError as e:
            raise RequestValidationError([err | {"loc": ("body", *err["loc"])} for err in e.errors()]) from None
        prepare = serving.prepare_chat if isinstance(body, ChatCompletionRequest) else serving.prepare_completion
        return await respond(await off_loop(prepare, body), body, request)


def _install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Every error leaves as OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        metrics.outcome(e.outcome)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

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


_JSON_SLICE = 16384  # list items per json.dumps call
_dumps = partial(json.dumps, ensure_ascii=False, allow_nan=False, separators=(",", ":"))  # as JSONResponse


def json_in_slices(answer: dict) -> Response:
    """NOTE: JSONResponse's bytes, with each long list encoded a slice at a time. One json.dumps call holds
    the GIL until it returns: over the 2 million ids of a 10 MB text it held the event loop's thread for
    0.3-0.7 s (every stream waited); between slices of 16,384 the loop gets its turns (10 ms at most)."""
    def encode(value) -> str:
        if not (isinstance(value, list) and len(value) > _JSON_SLICE):
            return _dumps(value)
        return "[" + ",".join(_dumps(value[i:i + _JSON_SLICE])[1:-1] for i in range(0, len(value), _JSON_SLICE)) + "]"
    body = "{" + ",".join(f"{_dumps(key)}:{encode(value)}" for key, value in answer.items()) + "}"
    return Response(body.encode(), media_type="application/json")


def _add_token_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """vLLM's /tokenize and /detokenize, through the same input processor as generation."""

    @app.post("/tokenize")
    async def tokenize(body: Annotated[TokenizeRequest, Depends(parsed_body(TokenizeRequest))]):  # the answer's JSON (millions of ids) is written off the loop too
        return await off_loop(lambda b: json_in_slices(serving.tokenize(b)), body)

    @app.post("/detokenize")
    async def detokenize(body: Annotated[DetokenizeRequest, Depends(parsed_body(DetokenizeRequest))]):
        return await off_loop(serving.detokenize, body)
