"""The planner's speed predictions beside published measurements (bench/published_results.yaml).

    python bench/accuracy.py                 # writes bench/ACCURACY.md
    python bench/accuracy.py --check         # exit 1 when ACCURACY.md is not what the planner predicts now

Each published result is re-planned with its layout pinned (tp, pp, dp), its GPU, dtype and
workload; each published figure is set beside the plan's prediction of the same quantity. ShareGPT traffic at
a rate or all at once goes the way of `plan --traffic sharegpt`: its lengths (planner/catalog/traffic/
sharegpt.json), num_prompts of them at the source's rate, replayed through the engine's scheduler.
What the sources leave open is filled by the assumptions in ASSUMPTIONS, stated in the output.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import yaml

from accuracy_report import Row, at_once, render
from shardserve.launch.trace_plan import with_replay
from shardserve.planner import PlanError, PlanOptions, load_model, make_plan, parse_declared
from shardserve.planner.operators import Chunk
from shardserve.planner.perf_tables import load_database
from shardserve.planner.replay import predict_replicas, replica_of
from shardserve.planner.serving import Replica
from shardserve.planner.speed import Estimates
from shardserve.planner.trace import Trace
from shardserve.planner.traffic import DEFAULT_NUM_REQUESTS, load_lengths, named_trace

HERE = Path(__file__).resolve().parent
ASSUMPTIONS = {
    "sharegpt": "ShareGPT runs: num_prompts requests (1,000 where unstated) drawn from ShareGPT's lengths as "
                "vLLM's benchmarks sample them (Llama-3 tokens, planner/catalog/traffic/sharegpt.json), scaled to "
                "the mean lengths the source published for its sample where it did, arriving at the source's rate "
                "(Poisson), at its concurrency (a closed loop) or all at once, replayed through the engine's "
                "scheduler (`plan --traffic sharegpt`)",
    "max_num_seqs": "max_num_seqs as each engine defaults: vLLM 0.6 256, newer vLLM 1024, SGLang and "
                    "TensorRT-LLM 2048 halved until the plan fits (their limits follow memory), NIM 256",
    "offline": "offline runs and infinite rates are closed loops of num_prompts requests (ShareGPT's: replayed, "
               "all at once); their latencies (a burst: each request's place in the queue) are not compared",
    "engine": "engine-level results (static batches) leave out the server's request overhead",
    "burst": "bursts (every request at once) of ShareGPT's spread of lengths end in a tail of long requests "
             "at small batches, which the replay runs through as it comes; they are summed up apart, as when "
             "the steady state predicted them",
    "percentile": "means and medians are compared with the p50 estimate (a replay's p50), p99 figures with the "
                  "p99 estimate",
    "fp8": "fp8 results serve fp8 weights; TensorRT-LLM fp8 engines an fp8 KV cache too",
    "mixed": "prefill steps as each engine defaults: SGLang (--enable-mixed-chunk off) and vLLM 0.6 (no chunked "
             "prefill below 32K tokens of context) run a prompt's step alone while the decodes wait; vLLM V1, "
             "TensorRT-LLM and NIM put prefill chunks in the decode steps (replayed: a step carrying prompts is "
             "their step alone, which gives their first token, then the decodes' step)",
    "scheduler_steps": "vLLM 0.6 runs with --num-scheduler-steps 10 schedule once every 10 decode steps: a new "
                       "request waits for the run in progress (replayed: its share p of the 9 steps beyond the "
                       "one the replay waits for, at percentile p, added to TTFT), and tokens stream 10 at a time "
                       "(ITL = 10 TPOT)",
    "api": "each engine's API server is its own (TensorRT-LLM's engine-level runs have none): this runtime's "
           "API process bound (one process's CPU time a request and a streamed token) is not applied",
    "itl": "mean ITL is compared with TPOT; median ITL with a decode step alone where fewer than half the steps "
           "carry a prompt (else TPOT); replayed, median and p99 ITL with the replay's gaps between tokens",
}
# Checkpoints outside the catalog, planned as the catalog model with the same shapes.
SAME_SHAPES = {
    "nvidia/Llama-3.3-70B-Instruct-FP8": "meta-llama/Llama-3.1-70B-Instruct",
    "meta-llama/Llama-3.3-70B-Instruct": "meta-llama/Llama-3.1-70B-Instruct",
    "meta-llama/Meta-Llama-3-70B-Instruct": "meta-llama/Llama-3.1-70B-Instruct",
    "nvidia/Llama-3.1-8B-Instruct-FP8": "meta-llama/Llama-3.1-8B-Instruct",
}
def _max_num_seqs(entry: dict) -> int:
    engine, version = entry["engine"], str(entry.get("engine_version") or "")
    if engine == "vllm":
        return 256 if version.startswith("0.6") else 1024
    return 256 if engine == "nim" else 2048


def _mixes_prefill(entry: dict) -> bool:
    version = str(entry.get("engine_version") or "")
    return not (entry["engine"] == "sglang" or (entry["engine"] == "vllm" and version.startswith("0.6")))


def _chunks_prompts(entry: dict) -> bool:
    version = str(entry.get("engine_version") or "")
    return entry["engine"] == "sglang" or (entry["engine"] == "vllm" and not version.startswith("0.6"))


def _options(entry: dict, workload: dict, trace: Trace | None = None) -> dict:
    """The plan's options; with a trace, its mean lengths (as `plan --traffic` searches on them)."""
    w = workload
    drawn = trace or load_lengths("sharegpt")  # (where a ShareGPT run's lengths are unpublished)
    lengths = ((w["input_len"], w["output_len"]) if trace is None and w.get("input_len") is not None
               else (drawn.mean("input_len"), drawn.mean("output_len")))
    input_len, output_len = round(lengths[0]), max(1, round(lengths[1]))
    opts = {"tensor_parallel_size": entry["tensor_parallel_size"],
            "pipeline_parallel_size": entry.get("pipeline_parallel_size") or 1,
            "data_parallel_size": entry.get("data_parallel_size") or 1,
            "input_len": input_len, "output_len": output_len, "max_num_seqs": _max_num_seqs(entry),
            "max_model_len": max(4096, input_len + output_len)}
    mode, rate = w["mode"], w.get("request_rate")
    if mode == "request_rate" and rate not in (None, "inf"):
        opts["request_rate"] = float(rate)
    elif mode in ("concurrency", "static_batch"):
        opts["concurrency"] = float(w.get("concurrency") or w["batch_size"])
    else:  # offline, or every request at once
        opts["concurrency"] = float(w.get("num_prompts") or DEFAULT_NUM_REQUESTS)
    # a prompt in chunks of 8,192 tokens where the engine chunks long prompts by default (vLLM V1, SGLang), else whole
    whole = 0 if _chunks_prompts(entry) else input_len + 1
    opts["max_num_batched_tokens"] = max(8192, opts["max_num_seqs"], whole)
    if entry["dtype"] == "fp8" and entry["engine"] in ("tensorrt-llm", "nim"):
        opts["kv_cache_dtype"] = "fp8"
    return opts


def predict(entry: dict) -> list[Row]:
    """Every figure of the entry beside the plan's prediction (None, with the reason, where there is none)."""
    return [replace(r, is_burst=_is_burst(entry), at_once=at_once(entry)) for r in _predicted(entry)]


def _predicted(entry: dict) -> list[Row]:
    if entry["dtype"] not in ("bf16", "fp16", "fp8"):
        return [Row(entry["id"], entry["engine"], k, v, None, f"{entry['dtype']} is not served")
                for k, v in entry["measured"].items()]
    trace = _sharegpt_trace(entry)
    try:
        model = load_model(SAME_SHAPES.get(entry["model"], entry["model"]), "fp8" if entry["dtype"] == "fp8" else None)
        opts = _options(entry, entry["workload"], trace)
        plan = _plan(model, entry, opts)
    except PlanError as e:
        return [Row(entry["id"], entry["engine"], k, v, None, str(e)[:80]) for k, v in entry["measured"].items()]
    if trace is not None:
        return _replayed(entry, plan.record(), model, trace)
    rows = []
    by_percentile: dict[int, tuple[Estimates, float, float]] = {}  # the estimates at p50 and at p99, each made once
    for metric, value in entry["measured"].items():
        if metric.startswith("itl_ms_p99"):
            rows.append(Row(entry["id"], entry["engine"], metric, value, None,
                            "per-token spikes (a step carrying a prefill chunk) are not modelled; TPOT is"))
            continue
        percentile = 99 if metric.endswith("_p99") else 50
        if percentile not in by_percentile:
            by_percentile[percentile] = _estimates(plan, model, entry, opts, percentile)
        predicted = _same_quantity(metric, *by_percentile[percentile], opts, entry)
        if predicted is not None:
            rows.append(Row(entry["id"], entry["engine"], metric, value, predicted))
    return rows


def _plan(model, entry: dict, opts: dict, **more):
    """The plan for the entry. SGLang and TensorRT-LLM size their running requests by the memory left: where 2,048
    leave no room, the largest halving that does (written back into `opts`)."""
    dtype = "float16" if entry["dtype"] == "fp16" else "bfloat16"
    hardware = parse_declared(f"{entry['num_gpus']}x{entry['gpu']}")
    while True:
        try:
            return make_plan(model, hardware, PlanOptions(dtype=dtype, **opts, **more))
        except PlanError:
            if entry["engine"] not in ("sglang", "tensorrt-llm") or opts["max_num_seqs"] <= 256:
                raise
            opts["max_num_seqs"] //= 2


def _sharegpt_trace(entry: dict) -> Trace | None:
    """ShareGPT at a rate or all at once: the requests `plan --traffic sharegpt` replays for it; else None."""
    w = entry["workload"]
    if w.get("dataset") != "sharegpt" or w["mode"] not in ("request_rate", "offline", "concurrency"):
        return None
    rate = None if w["mode"] != "request_rate" or w.get("request_rate") in (None, "inf") else float(w["request_rate"])
    in_flight = int(w["concurrency"]) if w["mode"] == "concurrency" else None
    trace = named_trace("sharegpt", w.get("num_prompts") or DEFAULT_NUM_REQUESTS, rate, concurrency=in_flight)
    return trace if w.get("input_len") is None else _with_means(trace, w["input_len"], w["output_len"])


def _with_means(trace: Trace, input_len: float, output_len: float) -> Trace:
    """The trace's lengths scaled to the means the source published for its own sample (its token totals): the
    spread is ShareGPT's, the means the run's."""
    a, b = input_len / trace.mean("input_len"), output_len / trace.mean("output_len")
    requests = tuple(replace(r, input_len=max(1, round(r.input_len * a)), output_len=max(1, round(r.output_len * b)))
                     for r in trace.requests)
    return replace(trace, requests=requests)


def _engine_side(record, model) -> tuple:
    """(the plan record, its replica) without this runtime's API process bound: another engine's API server is its
    own (ASSUMPTIONS["api"])."""
    record = replace(record, estimates=replace(record.estimates, api_max_request_rate=None))
    return record, replace(replica_of(record, model), api_ms=(0.0, 0.0))


def _scheduling_as(replica: Replica, entry: dict) -> Replica:
    """The replica timing a step as the engine measured runs it: where prefill is not mixed into the decode steps,
    a step carrying prompt chunks is the prompts' step alone (one decode token, a step's least, as
    planner/serving.py times it) and then the decodes' own."""
    steps = entry.get("scheduler_steps") or 1
    if _mixes_prefill(entry):
        return replace(replica, scheduler_steps=steps)
    mixed = replica.cycle_ms

    def alone(b: int, chunks: tuple[Chunk, ...], context: int, drafts: int = 0) -> float:
        if not chunks or not b:
            return mixed(b, chunks, context, drafts)
        return mixed(1, chunks, context) + mixed(b, (), context, drafts)
    return replace(replica, cycle_ms=alone, scheduler_steps=steps, mixes_prefill=False)


def _replayed(entry: dict, record, model, trace: Trace) -> list[Row]:
    """The published figures beside the trace replayed on the plan's layout, scheduled as the engine does."""
    record, replica = _engine_side(record, model)
    replica = _scheduling_as(replica, entry)
    est = with_replay(record, model, trace, replica).estimates
    rows = []
    for metric, value in entry["measured"].items():
        predicted = _replayed_quantity(metric, est, replica, trace)
        if predicted is not None:
            rows.append(Row(entry["id"], entry["engine"], metric, value, predicted))
    return rows


def _replayed_quantity(metric: str, est, replica: Replica, trace: Trace) -> float | None:
    """A published figure's prediction from the replay's percentiles (a mean or median: p50); None where the
    figure is the offered load itself or a burst's latency."""
    pct, steps = est.percentiles, replica.scheduler_steps
    at = "p99" if metric.endswith("_p99") else "p50"
    at_once = trace.is_offline and trace.concurrency is None
    if metric.startswith(("ttft", "tpot", "itl", "e2e")):
        if at_once:
            return None
        if metric.startswith("itl_ms_mean"):  # mean ITL: TPOT; tokens stream a run of steps at a time
            return pct.tpot_ms.p50 * steps
        kind = metric.split("_")[0]
        spread = {"ttft": pct.ttft_ms, "tpot": pct.tpot_ms, "itl": pct.itl_ms, "e2e": pct.e2e_ms}[kind]
        ttft_later, e2e_later = _start_ms(replica, pct.itl_ms.p50, 0.99 if at == "p99" else 0.5)
        later = ttft_later if kind == "ttft" else e2e_later if kind == "e2e" else 0.0
        return getattr(spread, at) * (steps if kind == "itl" else 1) + later
    if not trace.is_offline:
        return None
    i, o = trace.mean("input_len"), trace.mean("output_len")
    return {"output_tokens_per_s": est.output_tokens_per_s, "throughput_tokens_per_s": est.output_tokens_per_s,
            "output_tokens_per_s_per_gpu": est.output_tokens_per_s_per_gpu,
            "total_tokens_per_s": est.output_tokens_per_s * (i + o) / o,
            "requests_per_s": est.output_tokens_per_s / o}.get(metric)


def _start_ms(replica: Replica, decode_ms: float, p: float) -> tuple[float, float]:
    """(TTFT, end-to-end time) to add to the replay's where its scheduler cannot start a request as the engine does.
    Every k decode steps scheduled once (vLLM 0.6's --num-scheduler-steps): a new request waits for the rest of
    the run in progress, not of one step; within a run always busy that wait is uniform, its percentile p that
    share of the (k - 1) steps beyond the one the replay waits for. A prompt's step run alone: its first token
    comes out of that step, before the decodes' step the replay times with it (one decode step less TTFT)."""
    held = p * (replica.scheduler_steps - 1) * decode_ms
    return held - (0.0 if replica.mixes_prefill else decode_ms), held


def _is_burst(entry: dict) -> bool:
    return at_once(entry) and entry["workload"].get("dataset") == "sharegpt"


def _estimates(plan, model, entry: dict, opts: dict, percentile: int):
    """(the plan's estimates at the percentile, the mean and the median gap between two streamed pieces)
    with its replicas scheduling as the engine measured did."""
    if percentile != 50:
        plan = _plan(model, entry, opts, target_percentile=percentile)
    steps = entry.get("scheduler_steps") or 1
    record, replica = _engine_side(plan.record(), model)
    replica = replace(replica, scheduler_steps=steps, mixes_prefill=_mixes_prefill(entry))
    est = predict_replicas(record, replica, plan.chosen.estimates.workload)
    w = est.workload
    running = replica.speed(w.per_replica(record.parallel.data_parallel_size)).batch
    # a prompt starts every output_len / running steps: when fewer than half the steps carry one, the
    # median gap is a decode step alone
    median = replica.decode_step_ms(w, running) if running / w.output_len < 0.5 else est.tpot_ms
    return est, est.tpot_ms * steps, median * steps


def _same_quantity(metric: str, est, mean_gap: float, median_gap: float, opts: dict,
                   entry: dict) -> float | None:
    """The prediction of a published figure; None where the figure is the offered load itself."""
    i, o = opts["input_len"], opts["output_len"]
    open_loop, mode = "request_rate" in opts, entry["workload"]["mode"]
    if at_once(entry) and metric.startswith(("ttft", "tpot", "itl", "e2e")):
        return None
    if metric.startswith(("ttft_ms", "first_token_latency")) or metric == "ttft_ms":
        overhead = load_database(entry["gpu"]).host.request_ms if mode == "static_batch" else 0.0
        return est.ttft_ms - overhead
    if metric.startswith("tpot_ms"):
        return est.tpot_ms
    if metric.startswith("itl_ms_median"):
        return median_gap
    if metric.startswith("itl_ms"):
        return mean_gap
    if metric.startswith("e2e_latency_ms"):
        overhead = load_database(entry["gpu"]).host.request_ms if mode == "static_batch" else 0.0
        return est.ttft_ms - overhead + (o - 1) * est.tpot_ms
    if open_loop:
        return None  # throughput at a fixed rate is the rate: nothing predicted
    return {"output_tokens_per_s": est.output_tokens_per_s, "throughput_tokens_per_s": est.output_tokens_per_s,
            "output_tokens_per_s_per_gpu": est.output_tokens_per_s_per_gpu,
            "total_tokens_per_s": est.output_tokens_per_s * (i + o) / o,
            "requests_per_s": est.output_tokens_per_s / o}.get(metric)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with ACCURACY.md instead of writing it")
    args = parser.parse_args()
    entries = yaml.safe_load((HERE / "published_results.yaml").read_text())
    text = render([row for e in entries for row in predict(e)], entries, ASSUMPTIONS)
    target = HERE / "ACCURACY.md"
    if args.check:
        same = target.exists() and target.read_text() == text
        print("ACCURACY.md is current" if same else "ACCURACY.md differs from the planner's predictions now")
        return 0 if same else 1
    target.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
