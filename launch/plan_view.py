"""Show a plan on the terminal, and read or write plan files."""

from __future__ import annotations

import dataclasses

import os
import tempfile
import time
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from shardserve.planner import PlanError, parse_declared
from shardserve.planner.detect import detect_local, detect_ray
from shardserve.planner.hardware import Hardware
from shardserve.planner.plan_file import PlanFile


def resolve_hardware(declared: str | None, ray_address: str | None) -> Hardware:
    """Declared beats a Ray cluster, which beats what NVML sees on this machine."""
    if declared:
        return parse_declared(declared)
    if ray_address:
        return detect_ray(ray_address)
    return detect_local()


def build_plan(config, hardware: Hardware, info=None, recommend: bool = False):
    """The one way `plan` and `launch` make a plan: the settled config's plan-layer settings, its model
    (`info`: the model already read, else read here); `recommend`: on the fewest GPUs of the type."""
    from shardserve.planner import PlanOptions, load_model, make_plan
    from shardserve.planner.hub import HubOptions
    from shardserve.planner.settings import PLAN, for_layer

    if not config.model:
        raise PlanError("no model: pass --model, or a --profile that sets one")
    options = PlanOptions(**for_layer(config.set_values(), PLAN))
    model = info or load_model(config.model, options.quantization, HubOptions.of(config))
    return make_plan(model, hardware, options, recommend)


def one_model(argument: str | None, model: str | None) -> str | None:
    """The model `plan X` or `launch X` names (as `vllm serve X`), which --model may not name a second time."""
    if argument is None:
        return model
    if model not in (None, argument):
        raise PlanError(f"two models: {argument} (the argument) and --model {model}: give one of them")
    return argument


def make_plan_from(flags: dict, profile: str | None, ray_address: str | None, recommend: bool = False,
                   trace_path: Path | None = None, traffic: str | None = None) -> PlanFile:
    """Plan from a profile overridden by flags (None means 'not given'); with a trace (a file, or the named
    `traffic`'s), for its traffic, the layout and estimates replayed from it (launch/trace_plan.py)."""
    from shardserve.launch.deploy_config import merge, validate
    from shardserve.launch.profiles import load_profile

    began, trace = time.perf_counter(), None
    if trace_path is not None and traffic is not None:
        raise PlanError(f"--trace with --traffic {traffic}: the trace is the traffic; give one of them")
    if traffic is not None:
        from shardserve.launch.trace_plan import traffic_flags
        trace, flags = traffic_flags(traffic, flags)
    elif trace_path is not None:
        from shardserve.launch.trace_plan import workload_flags
        from shardserve.planner.trace import read_trace
        trace = read_trace(trace_path)
        flags = workload_flags(trace, flags)
    base = load_profile(profile).set_values() if profile else {}
    measured_line = None
    if trace is not None:
        from shardserve.launch.trace_plan import acceptance_flags
        flags, measured_line = acceptance_flags(trace, flags, base)
    config = validate(merge(base, flags), f"profile {profile}" if profile else "", flags=flags)
    hardware = resolve_hardware(config.hardware, ray_address)
    if trace is None:
        return build_plan(config, hardware, recommend=recommend).record()
    from shardserve.launch.trace_plan import replayed_plan
    from shardserve.planner import load_model
    from shardserve.planner.hub import HubOptions
    model = load_model(config.model, config.quantization, HubOptions.of(config))
    record = replayed_plan(build_plan(config, hardware, model, recommend), model, trace, began)
    return record if measured_line is None else dataclasses.replace(record, rationale=(*record.rationale,
                                                                                        measured_line))


def write_plan(plan: PlanFile, path: Path) -> None:
    """Write atomically: a reader never sees half a plan, a failure leaves no file."""
    path = path.expanduser()
    if not path.parent.exists():
        raise PlanError(f"cannot write {path}: folder {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    umask = os.umask(0o022)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # a plan is no secret: the mode any new file gets, not mkstemp's 0600
    try:
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(plan.to_dict(), f, sort_keys=False)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 / 20 or n == 0 else f"{n / 2**20:.1f} MiB"  # (a small model's)


def _params(num: int) -> str:
    return f"{num / 1e9:.2f}B" if num >= 0.9995e9 else f"{num / 1e6:.1f}M"


def _weights_kind(model) -> str:
    """What the weights' size is of: the checkpoint's own format (an FP8 checkpoint's, not the compute dtype's)."""
    quant = model.quantization
    if not quant:
        return f"in {model.dtype}"
    bits = f" {quant['bits']}-bit" if quant.get("bits") and quant.get("method") != "fp8" else ""
    return f"as {quant['method']}{bits} weights"


def render_plan(plan: PlanFile, console: Console) -> None:
    m, hw, par, mem, rt = plan.model, plan.hardware, plan.parallel, plan.memory, plan.runtime
    nodes = f"{hw.nodes}x" if hw.nodes > 1 else ""
    console.print(f"[bold]{m.id}[/] ({m.architecture}, {_params(m.num_params)} params, "
                  f"{_gib(m.weight_bytes)} {_weights_kind(m)}) on "
                  f"[bold]{nodes}{hw.gpus_per_node}x{hw.gpu.name}[/] "
                  f"({hw.source}, {hw.interconnect})", highlight=False)
    console.print(summary(plan), highlight=False)
    layout = Table(title="Layout", show_header=False, title_justify="left")
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                "layer_split", "distributed_executor_backend", "enable_expert_parallel"):
        value = getattr(par, key)
        layout.add_row(key, str(list(value) if isinstance(value, tuple) else value))
    layout.add_row("max_model_len", str(rt.max_model_len))
    layout.add_row("dtype / kv_cache_dtype", f"{rt.dtype} / {rt.kv_cache_dtype}")
    console.print(layout)

    # a GPU's size, and what the plan fills of it (used: the parts shown, and the LoRA slots said below)
    of_gpu = ("" if rt.device == "cpu" else f": {_gib(mem.per_stage[0].total_bytes)}, used up to "
              f"gpu_memory_utilization {rt.gpu_memory_utilization}")
    memory = Table(title=f"Memory per {'CPU rank' if rt.device == 'cpu' else 'GPU'}{of_gpu}", title_justify="left")
    has_state = any(stage.recurrent_state_bytes for stage in mem.per_stage)  # linear-attention layers'
    for col in ("stage", "used", "weights", "activations", "overhead", "KV cache") + ("state",) * has_state:
        memory.add_column(col, justify="right")
    for i, stage in enumerate(mem.per_stage):
        parts: tuple[int, ...] = (stage.weights_bytes, stage.activation_bytes, stage.overhead_bytes,
                                  stage.kv_cache_bytes)
        parts += (stage.recurrent_state_bytes or 0,) * has_state
        memory.add_row(str(i), _gib(sum(parts) + (stage.lora_bytes or 0)), *(_gib(b) for b in parts))
    console.print(memory)
    console.print(f"KV cache: [bold]{mem.kv_cache_tokens:,}[/] tokens per replica "
                  f"({mem.num_blocks:,} blocks of {mem.block_size}); maximum concurrency "
                  f"for {rt.max_model_len:,} tokens per request: "
                  f"[bold]{mem.max_concurrency:.2f}x[/]", highlight=False)
    if has_state:
        console.print(f"Recurrent state of the linear-attention layers: {_gib(mem.per_gpu.recurrent_state_bytes or 0)} "
                      f"per GPU, a row for each of max_num_seqs {rt.max_num_seqs} requests and a scratch row",
                      highlight=False)
    if mem.offload_tokens:
        console.print(f"CPU tier of the KV cache: [bold]{mem.offload_tokens:,}[/] tokens per replica in "
                      f"{_gib(mem.offload_bytes or 0)} of host memory", highlight=False)
    if rt.enable_lora:
        console.print(f"LoRA: [bold]{rt.max_loras}[/] adapter slot(s) of rank up to {rt.max_lora_rank}, "
                      f"{_gib(mem.per_gpu.lora_bytes or 0)} per GPU", highlight=False)
    render_estimates(plan, console)
    console.print("[bold]Why[/]")
    for line in plan.rationale:
        console.print(f"  - {line}", highlight=False)
    for line in plan.warnings:
        console.print(f"  [yellow]warning:[/] {line}", highlight=False)
    if plan.alternatives:
        console.print(_alternatives_table(plan))


def summary(plan: PlanFile) -> str:
    """The answer in one line, before the detail: layout, GPUs, latency at the percentile, speed, KV."""
    par, est, mem, p = plan.parallel, plan.estimates, plan.memory, plan.estimates.workload.percentile
    num = par.tensor_parallel_size * par.pipeline_parallel_size * par.data_parallel_size
    unit = "CPU ranks" if plan.runtime.device == "cpu" else plan.hardware.gpu.name
    ttft = "unbounded (overloaded)" if est.ttft_ms is None else f"{est.ttft_ms:,.0f} ms"
    return (f"[bold]Plan:[/] tp {par.tensor_parallel_size} x pp {par.pipeline_parallel_size} x dp "
            f"{par.data_parallel_size} on {num} {unit}: TTFT p{p} {ttft}, TPOT p{p} {est.tpot_ms:,.1f} ms, "
            f"{est.output_tokens_per_s:,.0f} output tok/s ({est.output_tokens_per_s_per_user:,.1f} per user), "
            f"KV cache {mem.kv_cache_tokens:,} tokens per replica ({mem.max_concurrency:.2f}x "
            f"{plan.runtime.max_model_len:,})")


def _alternatives_table(plan: PlanFile) -> Table:
    """The layouts that lost, with an ep column where experts could be dealt out whole (a MoE model):
    the same tp and pp with and without expert parallel are two rows."""
    with_ep = plan.parallel.enable_expert_parallel or any(a["enable_expert_parallel"] for a in plan.alternatives)
    unit = "CPU rank" if plan.hardware.gpu.is_cpu else "GPU"
    alt = Table(title=f"The plan and the other layouts (* on the Pareto front: output tok/s per {unit} against per user; "
                "TTFT and TPOT in ms)", title_justify="left")
    shape = ("tp", "pp", "dp", "ep") if with_ep else ("tp", "pp", "dp")
    for col in (*shape, "tok/s", "/rank" if plan.hardware.gpu.is_cpu else "/GPU", "/user", "TTFT", "TPOT"):
        alt.add_column(col, no_wrap=True)
    alt.add_column("why not")
    for a in (plan_row(plan), *plan.alternatives):
        numbers = [_cell(a[k], f) for k, f in zip(_SPEED_KEYS, (",.0f", ",.0f", ",.1f", ",.0f", ",.1f"))]
        cells = [str(a["tensor_parallel_size"]), str(a["pipeline_parallel_size"]),
                 str(a["data_parallel_size"]) + ("*" if a["on_pareto_front"] else "")]
        if with_ep:
            cells.append("yes" if a["enable_expert_parallel"] else "no")
        alt.add_row(*cells, *numbers, a["why_not"])
    return alt


_SPEED_KEYS = ("output_tokens_per_s", "output_tokens_per_s_per_gpu", "output_tokens_per_s_per_user", "ttft_ms",
               "tpot_ms")


def plan_row(plan: PlanFile) -> dict:
    """The plan's own layout and speed, keyed as its alternatives are."""
    par, est = plan.parallel, plan.estimates
    return {"tensor_parallel_size": par.tensor_parallel_size, "pipeline_parallel_size": par.pipeline_parallel_size,
            "data_parallel_size": par.data_parallel_size, "enable_expert_parallel": par.enable_expert_parallel,
            **{key: getattr(est, key) for key in _SPEED_KEYS}, "on_pareto_front": False, "why_not": "[bold]the plan[/]"}


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def describe_workload(w) -> str:
    """'1024 in / 256 out tokens, 20 req/s (Poisson)' for a plan's estimates.workload."""
    prefix = f" ({w.prefix_len} shared)" if w.prefix_len else ""
    load = (f"{w.request_rate:g} req/s (Poisson)" if w.request_rate is not None
            else f"{w.concurrency:g} requests in flight")
    return f"{w.input_len:,} in{prefix} / {w.output_len:,} out tokens, {load}"


def render_estimates(plan: PlanFile, console: Console) -> None:
    est, svc = plan.estimates, plan.service
    p = est.workload.percentile
    table = Table(title=f"Estimates for {describe_workload(est.workload)}", title_justify="left",
                  show_header=False)
    targets = {"ttft_ms": svc.ttft_ms, "tpot_ms": svc.tpot_ms}
    for key, label, value, unit in (
            ("ttft_ms", f"TTFT p{p}", "unbounded" if est.ttft_ms is None else f"{est.ttft_ms:,.0f}",
             "(overloaded: see the warning)" if est.ttft_ms is None else "ms"),
            ("tpot_ms", f"TPOT p{p}", f"{est.tpot_ms:,.1f}", "ms"),
            ("", "output tokens/s", f"{est.output_tokens_per_s:,.0f}", "whole deployment"),
            ("", f"  per {'CPU rank' if plan.runtime.device == 'cpu' else 'GPU'}",
             f"{est.output_tokens_per_s_per_gpu:,.0f}", ""),
            ("", "  per user", f"{est.output_tokens_per_s_per_user:,.1f}", ""),
            ("", "max request rate", f"{est.max_request_rate:,.2f}", "req/s" + (
                " within the targets" if svc.ttft_ms or svc.tpot_ms else " before overload")),
            ("", "batch-1 decode", f"{est.decode_tokens_per_s_batch1:,.0f}", "tok/s")):
        target = targets.get(key)
        table.add_row(label, value, unit + (f" (target {target:g})" if target is not None else ""))
    console.print(table)
    if est.percentiles is not None and est.trace is not None:
        console.print(_percentiles_table(est))
    console.print(f"  speed from {est.source}", highlight=False)


def _percentiles_table(est) -> Table:
    """A replayed trace's latencies at p50, p90 and p99."""
    tr = est.trace
    load = (f"{tr.concurrency:,} in flight, the next sent as one finishes" if tr.concurrency is not None
            else "offline" if tr.offline else "as they arrived")
    table = Table(title=f"The trace replayed through the engine's scheduler: {tr.num_requests:,} requests "
                  f"({load}) in {tr.replay_seconds:.1f} s; ms",
                  title_justify="left")
    for col in ("", "p50", "p90", "p99"):
        table.add_column(col, justify="right")
    for label, spread in (("TTFT", est.percentiles.ttft_ms), ("TPOT", est.percentiles.tpot_ms),
                          ("ITL", est.percentiles.itl_ms), ("E2E", est.percentiles.e2e_ms)):
        if spread is not None:
            table.add_row(label, *(f"{v:,.1f}" for v in (spread.p50, spread.p90, spread.p99)))
    return table
