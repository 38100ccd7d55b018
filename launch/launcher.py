"""`shardserve launch`: settle the settings, check the hardware, start engines and the server."""

from __future__ import annotations

import asyncio
import contextlib
import atexit
import ipaddress
import logging
import os
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from shardserve.launch.deploy_config import DeployConfig, merge, validate
from shardserve.launch.plan_view import build_plan, one_model, resolve_hardware
from shardserve.launch.profiles import load_profile
from shardserve.planner import PlanError, load_model
from shardserve.planner.model_source import local_weights, model_path, no_weights_problem
from shardserve.planner.hardware import Hardware
from shardserve.planner.hub import HubOptions
from shardserve.planner.model_source import DEMO_MODEL_NAME, is_demo_model
from shardserve.planner.plan_file import PlanFile
from shardserve.planner.settings import BY_NAME, ENGINE, for_layer
from shardserve.planner.yaml_file import read_yaml

if TYPE_CHECKING:
    from shardserve.launch.server.trace_recorder import TraceRecorder
    from shardserve.launch.server.engine_client import EngineClient
    from shardserve.launch.server.lora_registry import LoRARegistry

logger = logging.getLogger("shardserve.launch")

DEFAULT_MODEL = DEMO_MODEL_NAME
DEFAULT_PROFILE = "demo"  # bare `shardserve launch`: no plan, no profile, no model


def plan_settings(plan: PlanFile) -> dict:
    """The settings a plan fixes: its runtime, parallel and service sections are named as settings; its
    model, with the revision and download folder a Hub id was planned with (None: the defaults)."""
    return {"model": plan.model_source, "revision": plan.model.revision, "download_dir": plan.model.download_dir,
            **asdict(plan.runtime), **asdict(plan.parallel), **asdict(plan.service)}


def read_plan_file(path: str) -> PlanFile:
    """A plan YAML, every key and type checked; errors name the file and the key."""
    data, _ = read_yaml(path, "plan")
    return PlanFile.from_dict(data, path)


def check_plan_fits(plan: PlanFile, hardware: Hardware) -> None:
    """Fail fast, before loading anything, when this machine lacks what the plan assumed."""
    needed, want = plan.parallel.num_gpus, plan.hardware.gpu
    if plan.runtime.device == "cpu":
        return
    if hardware.is_cpu:
        raise PlanError(f"the plan needs {needed} GPU(s) ({want.name}); this machine has "
                        "none that NVML can see: launch on the planned hardware, or make a "
                        "CPU plan (--hardware cpu)")
    if hardware.total_gpus < needed:
        raise PlanError(f"the plan needs {needed} GPUs; this machine has "
                        f"{hardware.total_gpus} ({hardware.describe()})")
    if hardware.gpu.memory_bytes < want.memory_bytes * 0.98:
        raise PlanError(f"the plan assumed {want.memory_bytes / 2**30:.1f} GiB per GPU "
                        f"({want.name}); this machine's GPUs have "
                        f"{hardware.gpu.memory_bytes / 2**30:.1f} GiB: plan again here")


def settle(plan_path: str | None, profile: str | None, flags: dict,
           ray_address: str | None, typed: frozenset[str] = frozenset()) -> tuple[DeployConfig, PlanFile]:
    """profile < plan < flags; without a plan file, plan now on the hardware found here. `typed`: the settings
    given as flags (an error names them as typed, --max-num-seqs; the others by their key, as --set has them)."""
    if plan_path is None and profile is None and flags.get("model") is None:
        profile = DEFAULT_PROFILE
    base = load_profile(profile).set_values() if profile else {}
    plan = read_plan_file(plan_path) if plan_path else None
    planned = plan_settings(plan) if plan else {}
    config = validate(merge(base, planned, flags), "launch settings", flags={k: flags[k] for k in typed if k in flags})
    hardware = resolve_hardware(None, ray_address)
    if hardware.is_cpu and config.hardware and not ray_address:  # a Ray cluster is the hardware
        declared = resolve_hardware(config.hardware, None)
        if declared.is_cpu:  # CPU ranks are processes on this host: as many as declared
            hardware = declared
    if plan is not None:
        check_plan_fits(plan, hardware)
        from shardserve.launch.server.plan_check import rederived  # a layout edited by hand: its predictions made again
        plan = rederived(plan, str(plan_path), config.set_values(),
                         load_model(config.model, config.quantization, HubOptions.of(config)))
        return apply_auto_len(config, plan), plan
    model = config.model or DEFAULT_MODEL
    info = load_model(model, config.quantization, HubOptions.of(config))  # a Hub id: its config, no weights yet
    plan = build_plan(validate(merge(config.set_values(), {"model": model}), "launch settings"), hardware, info).record()
    config = validate(merge(plan_settings(plan), config.set_values(), {"model": model}), "launch settings")
    return apply_auto_len(config, plan), plan


def apply_auto_len(config: DeployConfig, plan: PlanFile) -> DeployConfig:
    """max_model_len auto: the number the plan chose for its KV cache, so the engines serve what the
    plan predicted (plan = launch)."""
    if config.max_model_len != "auto":
        return config
    logger.info("max_model_len auto: %d tokens, the longest the plan fits in its KV cache of %d tokens",
                plan.runtime.max_model_len, plan.memory.kv_cache_tokens)
    return validate(merge(config.set_values(), {"max_model_len": plan.runtime.max_model_len}), "launch settings")


def launch_target(argument: str | None, model: str | None) -> tuple[str | None, str | None]:
    """`launch X` as `vllm serve X`: (plan path, model). X is a plan when it names a .yaml/.yml file,
    else the model (a folder, a Hub id, a catalog id), which --model may not name a second time."""
    if argument is None:
        return None, model
    path = Path(argument).expanduser()
    if path.suffix in (".yaml", ".yml") and not path.is_dir():
        if not path.is_file():
            raise PlanError(f"plan {argument} does not exist: make it with `shardserve plan -o {argument}`")
        return argument, model
    return None, one_model(argument, model)


def fetch_weights(config: DeployConfig) -> DeployConfig:
    """Once the plan is settled on the model's config and the port is ours: the weights on this machine,
    before any replica starts. A Hub id is served from its snapshot in the Hugging Face cache (downloaded
    now when the cache lacks it; load_format dummy: its config and tokenizer only) under its own name: the
    engines get the folder, the clients see the id. A folder without weights is refused, naming dummy."""
    load_format = setting(config, "load_format")
    given = Path(model_path(config.model)).expanduser()
    if given.is_dir():
        problem = no_weights_problem(given, load_format)
        if problem:
            raise PlanError(problem)
        return config
    folder = local_weights(config.model, HubOptions.of(config), load_format)
    return validate(merge(config.set_values(), {"model": str(folder), "served_model_name": served_name(config)}),
                    "launch settings")


def served_name(config: DeployConfig) -> str:
    """--served-model-name, else the bundled demo's name however it was given, else --model."""
    if config.served_model_name:
        return config.served_model_name
    return DEMO_MODEL_NAME if is_demo_model(config.model) else config.model


def bind_port(host: str, port: int) -> socket.socket:
    """Listen now, before anything loads, and keep the socket for the server: a second launch on
    this port fails at once rather than after loading its model."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        listener.bind((host, port))
        listener.listen(2048)
    except OSError as e:
        listener.close()
        raise PlanError(f"cannot listen on {host}:{port} ({e.strerror}): another server "
                        f"has the port; pass --port with a free one (--port {port + 1})") from None
    return listener


def try_it(name: str, host: str, port: int, api_key: str | None, runner: str = "auto") -> str:
    """A curl for the start-up log, ready to paste: a completion, or on a pooling server an embedding."""
    where = "localhost" if host in ("0.0.0.0", "::", "127.0.0.1") else host
    auth = ' -H "Authorization: Bearer $SHARDSERVE_API_KEY"' if api_key else ""
    route, body = (("embeddings", '"input": "The function"') if runner == "pooling" else
                   ("completions", '"prompt": "The function", "max_tokens": 32'))
    return (f"curl http://{where}:{port}/v1/{route} -H 'Content-Type: application/json'"
            f"{auth} -d '{{\"model\": \"{name}\", {body}}}'")


def engine_kwargs(config: DeployConfig) -> dict:
    """Every setting of the engine layer, as settled (the model goes separately)."""
    kwargs = for_layer(config.set_values(), ENGINE)
    kwargs.pop("model", None)
    if kwargs.get("tensor_parallel_size", 1) * kwargs.get("pipeline_parallel_size", 1) == 1:
        kwargs.pop("distributed_executor_backend", None)  # one rank runs in-process
    return kwargs


def setting(config: DeployConfig, name: str):
    """A settled value, or the table's default where nothing set it."""
    value = getattr(config, name)
    return BY_NAME[name].default if value is None else value


def log_plan(plan: PlanFile) -> None:
    par = plan.parallel
    logger.info("plan: %s on %s: tensor_parallel_size=%d pipeline_parallel_size=%d "
                "data_parallel_size=%d layer_split=%s (%s)%s", plan.model.id, plan.hardware.gpu.name,
                par.tensor_parallel_size, par.pipeline_parallel_size, par.data_parallel_size,
                list(par.layer_split), par.distributed_executor_backend,
                " enable_expert_parallel" if par.enable_expert_parallel else "")
    for line in plan.rationale:
        logger.info("plan: %s", line)
    logger.info("plan predicts a KV cache of %d tokens, %.2fx concurrency", plan.memory.kv_cache_tokens,
                plan.memory.max_concurrency)


def compare_kv(plan: PlanFile, info) -> None:
    """`info`: the engine's KVCacheInfo (concurrency counted as the block manager holds blocks)."""
    predicted, measured_tokens = plan.memory.kv_cache_tokens, info.num_tokens
    logger.info("KV cache measured: %d tokens, %.2fx concurrency for %d tokens per request "
                "(plan predicted %d tokens, %.2fx)", measured_tokens, info.max_concurrency,
                info.max_model_len, predicted, plan.memory.max_concurrency)
    if predicted and abs(measured_tokens - predicted) > 0.1 * predicted:
        logger.warning("the measured KV cache differs from the plan's prediction by %.0f%%",
                       100 * (measured_tokens - predicted) / predicted)


def warn_exposure(host: str, api_key: str | None) -> None:
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback and not api_key:
        logger.warning("listening on %s without an API key: anyone who can reach this host can "
                       "use the server; set --api-key or SHARDSERVE_API_KEY", host)


def serve(config: DeployConfig, plan: PlanFile, listener: socket.socket, api_key: str | None,
          served_model_name: str | None, restarts: int = 0) -> int:
    """Serve on `listener` (bind_port's); when the engine dies (a rank or a node lost), start the
    whole gang again, up to `restarts` times. Returns the process exit code."""
    from shardserve.launch.server.lora_registry import registry_from_settings
    from shardserve.launch.server.plan_check import for_traffic
    from shardserve.launch.server.trace_recorder import TraceRecorder

    log_plan(plan)
    export_env(config.env or {})
    model = load_model(config.model, config.quantization)
    expected = for_traffic(plan, model)  # the self-check's model, once
    loras = registry_from_settings(served_model_name or served_name(config), model.spec, setting(config, "enable_lora"),
                                   setting(config, "max_lora_rank"), config.lora_modules,
                                   setting(config, "enable_runtime_lora_updating"))
    recorder = TraceRecorder(setting(config, "record_trace")) if setting(config, "record_trace") else None
    with listener, contextlib.closing(recorder) if recorder else contextlib.nullcontext():
        for attempt in range(restarts + 1):
            if attempt:
                logger.warning("restarting every replica and rank (restart %d of %d)", attempt,
                               restarts)
            # NOTE: the server closes the socket it is given when it stops: each run gets a duplicate
            code, engine_died = serve_once(config, plan, listener.dup(), api_key, loras, expected, recorder)
            if not engine_died:
                return code
    if restarts:
        logger.error("the engine died %d times; giving up (--restart %d)", restarts + 1, restarts)
    return 1


def exit_now(code: int) -> NoReturn:
    """End the process once serve() has returned (its engines and ranks stopped): every atexit handler
    runs and the output is flushed, then the process leaves without the interpreter's teardown.

    NOTE: that teardown collects every object of torch, transformers and the server, again and again:
    a second or more on a busy CPU, more with CUDA loaded, all of it after the drain whose length
    --shutdown-timeout promises."""
    atexit._run_exitfuncs()  # logging's flush among them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def export_env(env: dict[str, str]) -> None:
    """Set the chosen variables here and name them for the runtime, which sends them to every
    rank (local processes inherit them anyway)."""
    if env:
        from shardserve.runtime.distributed.ray_executor import FORWARD_ENV
        os.environ.update(env)
        names = {n for n in os.environ.get(FORWARD_ENV, "").split(",") if n} | set(env)
        os.environ[FORWARD_ENV] = ",".join(sorted(names))
        logger.info("every rank gets %s", " ".join(f"{k}={v}" for k, v in sorted(env.items())))


def uses_ray_cluster(config: DeployConfig) -> bool:
    ranks = (config.tensor_parallel_size or 1) * (config.pipeline_parallel_size or 1)
    return (config.distributed_executor_backend == "ray" and ranks > 1
            and bool(os.environ.get("RAY_ADDRESS")))


def model_folder(model: str) -> str:
    """The model's path as every node sees it: folders absolute, ids as given."""
    path = model_path(model)
    return str(Path(path).resolve()) if Path(path).is_dir() else path


def serve_once(config: DeployConfig, plan: PlanFile, listener: socket.socket, api_key: str | None,
               loras: LoRARegistry, expected=None, recorder: TraceRecorder | None = None) -> tuple[int, bool]:
    """Start the replicas and the server on `listener`; (exit code, whether the engine died).
    `expected`: the plan's speed for the traffic seen (plan_check.for_traffic), for the self-check;
    `recorder`: --record-trace's, kept across restarts."""
    import uvicorn

    from shardserve.launch.server.api_server import build_app
    from shardserve.launch.server.metrics import ServerMetrics
    from shardserve.launch.openai_api.openai_serving import OpenAIServing
    from shardserve.launch.server.serving_options import ServingOptions
    from shardserve.launch.server.plan_check import PlanCheck, Prediction
    from shardserve.launch.server.fair_share import FairShare
    from shardserve.launch.server.replicas import ReplicaSet
    from shardserve.launch.server.server_loop import ENDING_SECONDS, Drain, run, server_class
    from shardserve.launch.server.connections import http_protocol

    host, port = setting(config, "host"), listener.getsockname()[1]
    name = loras.base_name
    path = model_folder(config.model)
    if uses_ray_cluster(config):
        from shardserve.launch.cluster.ray_nodes import check_cluster
        nodes = check_cluster(path)
        logger.info("cluster: %d live nodes (%s) have the model's files and this host's "
                    "versions", sum(n["alive"] for n in nodes),
                    ", ".join(n["ip"] for n in nodes if n["alive"]))
    engines, restart = start_engines(path, engine_kwargs(config), config.data_parallel_size or 1)
    info = engines[0].info.kv_cache_info
    compare_kv(plan, info)

    share = FairShare(setting(config, "max_num_seqs") * len(engines), setting(config, "queue_timeout"))
    check = PlanCheck(Prediction.from_plan(plan), for_traffic=expected, accepted_tokens=lambda: sum(
        s.spec_decode.num_accepted_tokens for s in replicas.stats() if s.spec_decode is not None))
    replicas = ReplicaSet(engines, plan_check=check,
                          routing_policy=setting(config, "routing_policy"), restart=restart, fair_share=share,
                          max_num_seqs=setting(config, "max_num_seqs"))
    metrics = ServerMetrics(name, replicas.stats, replicas.max_model_len)
    replicas.metrics = metrics
    replicas.recorder = recorder
    limit = config.max_queued_requests or 4 * setting(config, "max_num_seqs") * len(engines)
    serving = OpenAIServing(replicas, name, ServingOptions.from_config(config), loras)
    app = build_app(replicas, serving, metrics, api_key, limit, config.allowed_origins,
                    max_request_body_bytes=setting(config, "max_request_body_bytes"),
                    request_read_timeout=setting(config, "request_read_timeout"))
    warn_exposure(host, api_key)
    logger.info("serving %r at http://%s:%d/v1; try:\n  %s", name, host, port,
                try_it(name, host, port, api_key, setting(config, "runner")))
    # NOTE: uvicorn's own grace only covers what is left after the drain (see server_loop.Drain)
    drain = Drain(app.state.admission, replicas, setting(config, "shutdown_timeout"))
    server = server_class()(uvicorn.Config(app, host=host, port=port, log_level="info",
                                           http=http_protocol(setting(config, "request_read_timeout")),
                                           timeout_graceful_shutdown=ENDING_SECONDS, access_log=False), drain)
    return asyncio.run(run(server, replicas, listener))


def start_engines(path: str, kwargs: dict, num_replicas: int) -> tuple[Sequence[EngineClient], Callable]:
    """Every replica, one or many, in a process of its own (its own GIL, its own GPUs), talked to over
    a socket (runtime/core/client.py, the one EngineClient): the API process never steps an engine. With
    them, how to start replica i anew (ReplicaSet's restart)."""
    from shardserve.runtime.core.client import start_replica, start_replicas
    from shardserve.runtime.engine_args import EngineArgs
    args = EngineArgs.from_kwargs(path, kwargs, "launch")
    engines = start_replicas(args, num_replicas)
    return engines, lambda index: start_replica(args, index, engines[0].tokenizer)


def api_key_from_env(flag: str | None) -> str | None:
    """--api-key, else SHARDSERVE_API_KEY; an empty key is refused (it would turn authentication off)."""
    if flag is not None and not flag.strip():
        raise PlanError("--api-key is empty: an empty key would turn authentication off; give a key, or "
                        "leave --api-key out to serve without one")
    return flag or os.environ.get("SHARDSERVE_API_KEY") or None
