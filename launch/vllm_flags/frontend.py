"""vLLM's API-server flags (its FrontendArgs and `vllm serve`'s own) that `launch` takes under no same name."""

from __future__ import annotations

from shardserve.launch.vllm_flags.entry import KERNELS, MULTINODE, NO_LOGS, notice, refuse, rename

TLS = "HTTPS; here plain HTTP: put a TLS-terminating proxy (nginx, Caddy, a load balancer) in front"
CORS = ("CORS beyond the origins: here every method and header is allowed for the --allowed-origins, and "
        "credentials whenever they name origins (never with '*'); not configurable")

FRONTEND = (
    *rename("-h!", "--help"),
    *refuse(MULTINODE, "--headless! --data-parallel-supervisor-port --dp-supervisor-probe-interval-s "
            "--dp-supervisor-probe-timeout-s --dp-supervisor-probe-failure-threshold"),
    *refuse("API server processes; here one API process serves every replica (--data-parallel-size)",
            "--api-server-count|-asc", accepted=("1",)),
    *refuse("a YAML file of vLLM flags; here --profile takes a YAML profile (its keys are the settings' "
            "names: max_model_len, tensor_parallel_size)", "--config"),
    *refuse("a gRPC server; here OpenAI's HTTP API only (and Anthropic's /v1/messages)", "--grpc! --grpc-port"),
    *refuse("Unix-socket listening; here TCP only (--host, --port)", "--uds"),
    *refuse("how message content reaches the chat template; here always as one string (vLLM's string; "
            "parts other than text are refused)", "--chat-template-content-format", accepted=("auto", "string")),
    *refuse("per-request multimodal kwargs; not served: no image, audio or video input here",
            "--trust-request-mm-kwargs!"),
    *notice("no multimodal input is read here", "--no-trust-request-mm-kwargs!"),
    *refuse("chat_template_kwargs applied to every request; not served: send chat_template_kwargs with each "
            "request, or give a --chat-template with the default written in", "--default-chat-template-kwargs"),
    *refuse("rewrites requests' reasoning_effort; not served: send an effort the chat template knows",
            "--reasoning-effort-map"),
    *refuse("the role of chat replies; here always assistant", "--response-role", accepted=("assistant",)),
    *rename("--disable-auto-tool-choice!", "--no-enable-auto-tool-choice"),
    *notice("here tool_choice none always leaves the tools out of the prompt",
            "--exclude-tools-when-tool-choice-none!"),
    *refuse("tools shown to the template under tool_choice none; here tool_choice none always leaves them out",
            "--no-exclude-tools-when-tool-choice-none!"),
    *refuse("a Python file registering tool parsers; here the built-in hermes, llama3_json and openai "
            "(--tool-call-parser)", "--tool-parser-plugin"),
    *refuse("a grammar floor for tool calls; here required and named calls are sampled under a grammar and "
            "auto calls parsed from free text, not configurable", "--tool-strict-level"),
    *refuse("built-in or MCP tool servers for the Responses API; not served: the client runs its tools",
            "--tool-server"),
    *notice("it caps the prompt text in request logs: " + NO_LOGS, "--max-log-len"),
    *rename("--disable-prompt-tokens-details!", "--no-enable-prompt-tokens-details"),
    *refuse("per-request timings in responses; not served: /metrics has the TTFT, TPOT and latency histograms",
            "--enable-per-request-metrics!"),
    *notice("responses carry no per-request timings here", "--disable-per-request-metrics!"),
    *rename("--disable-server-load-tracking!", "--no-enable-server-load-tracking"),
    *rename("--disable-force-include-usage!", "--no-enable-force-include-usage"),
    *refuse("SSE comments while a stream is idle; not served: raise the proxy's read timeout instead",
            "--sse-keep-alive-interval", accepted=("0",)),
    *rename("--disable-tokenizer-info-endpoint!", "--no-enable-tokenizer-info-endpoint"),
    *refuse("request or output logging; " + NO_LOGS, "--enable-log-requests! --enable-log-outputs! "
            "--enable-uvicorn-access-log! --log-error-stack!"),
    *notice(NO_LOGS, "--disable-log-requests! --disable-log-outputs! --enable-log-deltas! --disable-log-deltas! "
            "--disable-uvicorn-access-log! --disable-access-log-for-endpoints --no-log-error-stack!"),
    *refuse("uvicorn's log level; here info, not configurable", "--uvicorn-log-level", accepted=("info",)),
    *notice("shardserve logs no periodic engine statistics (/metrics has them)",
            "--disable-log-stats! --aggregate-engine-logging!"),
    *notice("it checks VLLM_* environment variables; shardserve reads none",
            "--fail-on-environ-validation! --no-fail-on-environ-validation!"),
    *notice("for Cohere's /cohere/v2/chat and tokenizer, which shardserve does not serve",
            "--cohere-is-reasoning-model! --no-cohere-is-reasoning-model! --cohere-format"),
    *notice("Anthropic requests with a thinking field are refused here (400: no thinking budget)",
            "--anthropic-disabled-thinking-effort"),
    *refuse("a tokens-in/tokens-out server for disaggregated serving; not served", "--tokens-only!"),
    *refuse("the scale-out endpoints (/render, /inference/v1/generate); not served", "--enable-scale-out!"),
    *notice("the OpenAI and Anthropic routes are served; no tokens-only or scale-out endpoints",
            "--no-tokens-only! --disable-scale-out!"),
    *refuse("system_fingerprint in responses; here responses carry none (vLLM's none)",
            "--fingerprint-mode", accepted=("none",)),
    *refuse("a custom system_fingerprint; here responses carry none", "--fingerprint-value"),
    *refuse(CORS, "--allow-credentials! --no-allow-credentials!"),
    *refuse(CORS, "--allowed-methods --allowed-headers", accepted=('["*"]', "*")),
    *refuse(TLS, "--ssl-keyfile --ssl-certfile --ssl-ca-certs --ssl-cert-reqs --ssl-ciphers --enable-ssl-refresh!"),
    *notice("no TLS here, so no certificates to refresh", "--disable-ssl-refresh!"),
    *refuse("an ASGI middleware by import path; not served: put it in a proxy in front", "--middleware"),
    *refuse("an X-Request-Id header on responses; not served", "--enable-request-id-headers!"),
    *notice("responses carry no X-Request-Id header here", "--disable-request-id-headers!"),
    *refuse("no API docs; here /docs and /openapi.json are always served", "--disable-fastapi-docs!"),
    *notice("/docs and /openapi.json are served here", "--enable-fastapi-docs! --disable-offline-docs!"),
    *refuse("/docs with bundled assets (air-gapped hosts); here /docs loads Swagger UI from its CDN",
            "--enable-offline-docs!"),
    *refuse("h11's limits on a request's headers; here uvicorn's defaults (16 KiB of headers), with "
            "--request-read-timeout and --max-request-body-bytes", "--h11-max-incomplete-event-size "
            "--h11-max-header-count"),
    *notice("late-interaction (multi-vector) scoring is not served here",
            "--enable-flash-late-interaction! --disable-flash-late-interaction!"),
    *refuse(KERNELS, "--gdn-prefill-backend --kda-prefill-backend --kda-decode-backend"),
)
