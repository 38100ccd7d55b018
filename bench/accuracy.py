"""The planner's speed predictions beside published measurements (bench/published_results.yaml).

    python bench/accuracy.py                 # writes bench/ACCURACY.md
    python bench/accuracy.py --check         # exit 1 when ACCURACY.md is not what the planner predicts now

Each published result is re-planned with its layout pinned (tp, pp, dp), its GPU, dtype and
workload; each published figure is set beside the plan's prediction of the same quantity.
What the sources leave open is filled by the assumptions in ASSUMPTIONS, stated in the output.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from shardserve.planner import PlanError, PlanOptions, load_model, make_plan, parse_declared
from shardserve.planner.perf_tables import load_database
from shardserve.planner.replay import predict_replicas, replica_of

HERE = Path(__file__).resolve().parent
ASSUMPTIONS = {
    "sharegpt": "ShareGPT lengths where unpublished: 217 in / 202 out, the means GPUStack's runs of the same "
                "data set report",
    "max_num_seqs": "max_num_seqs as each engine defaults: vLLM 0.6 256, newer vLLM 1024, SGLang and "
                    "TensorRT-LLM 2048 (their limits follow memory), NIM 256",
    "offline": "offline runs and infinite rates are closed loops of num_prompts requests; their latencies "
               "(a burst, no steady state) are not compared",
    "engine": "engine-level results (static batches) leave out the server's request overhead",
    "burst": "bursts (every request at once) of ShareGPT's spread of lengths end in a tail of long requests "
             "at small batches; the planner predicts a steady state, so they are summed up apart",
    "percentile": "means and medians are compared with the p50 estimate, p99 figures with the p99 estimate",
    "fp8": "fp8 results serve fp8 weights; TensorRT-LLM fp8 engines an fp8 KV cache too",
    "mixed": "prefill steps as each engine defaults: SGLang (--enable-mixed-chunk off) and vLLM 0.6 (no chunked "
             "prefill below 32K tokens of context) run a prompt's step alone while the decodes wait; vLLM V1, "
             "TensorRT-LLM and NIM put prefill chunks in the decode steps",
    "scheduler_steps": "vLLM 0.6 runs with --num-scheduler-steps 10 schedule once every 10 decode steps: a new "
                       "request waits for the run in progress, and tokens stream 10 at a time (ITL = 10 TPOT)",
    "itl": "mean ITL is compared with TPOT; median ITL with a decode step alone where fewer than half the steps "
           "carry a prompt (else TPOT)",
}
SHAREGPT = (217, 202)
# Checkpoints outside the catalog, planned as the catalog model with the same shapes.
SAME_SHAPES = {
    "nvidia/Llama-3.3-70B-Instruct-FP8": "meta-llama/Llama-3.1-70B-Instruct",
    "meta-llama/Llama-3.3-70B-Instruct": "meta-llama/Llama-3.1-70B-Instruct",
    "meta-llama/Meta-Llama-3-70B-Instruct": "meta-llama/Llama-3.1-70B-Instruct",
    "nvidia/Llama-3.1-8B-Instruct-FP8": "meta-llama/Llama-3.1-8B-Instruct",
}
VLLM_CLASS = ("vllm", "sglang")


@dataclass(frozen=True)
class Row:
    id: str
    engine: str
    metric: str
    measured: float
    predicted: float | None
    note: str = ""
    is_burst: bool = False  # every request at once with ShareGPT's spread of lengths: no steady state

    @property
    def ratio(self) -> float | None:
        return None if self.predicted is None else self.predicted / self.measured


def _max_num_seqs(entry: dict) -> int:
    engine, version = entry["engine"], str(entry.get("engine_version") or "")
    if engine == "vllm":
        return 256 if version.startswith("0.6") else 1024
    return 256 if engine == "nim" else 2048


def _mixes_prefill(entry: dict) -> bool:
    version = str(entry.get("engine_version") or "")
    return not (entry["engine"] == "sglang" or (entry["engine"] == "vllm" and version.startswith("0.6")))


def _options(entry: dict, workload: dict) -> dict:
    w = workload
    lengths = (w.get("input_len"), w.get("output_len"))
    input_len, output_len = (SHAREGPT if lengths[0] is None else (round(lengths[0]), max(1, round(lengths[1]))))
    opts = {"tensor_parallel_size": entry["tensor_parallel_size"],
            "pipeline_parallel_size": entry.get("pipeline_parallel_size") or 1,
            "data_parallel_size": entry.get("data_parallel_size") or 1,
            "input_len": input_len, "output_len": output_len, "max_num_seqs": _max_num_seqs(entry),
            "max_model_len": max(4096, input_len + output_len)}
    mode, rate = w["mode"], w.get("request_rate")
    if mode == "request_rate" and rate not in (None, "inf"):
        opts["request_rate"] = float(rate)
    elif mode in ("concurrency", "static_batch"):
        opts["concurrency"] = float(w.get("concurrency") or w.get("batch_size"))
    else:  # offline, or every request at once
        opts["concurrency"] = float(w.get("num_prompts") or 1000)
    opts["max_num_batched_tokens"] = max(8192, opts["max_num_seqs"], input_len + 1)
    if entry["dtype"] == "fp8" and entry["engine"] in ("tensorrt-llm", "nim"):
        opts["kv_cache_dtype"] = "fp8"
    return opts


def predict(entry: dict) -> list[Row]:
    if entry["dtype"] not in ("bf16", "fp16", "fp8"):
        return [Row(entry["id"], entry["engine"], k, v, None, f"{entry['dtype']} is not served")
                for k, v in entry["measured"].items()]
    opts = _options(entry, entry["workload"])
    model_id = SAME_SHAPES.get(entry["model"], entry["model"])
    try:
        model = load_model(model_id, "fp8" if entry["dtype"] == "fp8" else None)
        dtype = "float16" if entry["dtype"] == "fp16" else "bfloat16"
        plan = make_plan(model, parse_declared(f"{entry['num_gpus']}x{entry['gpu']}"),
                         PlanOptions(dtype=dtype, **opts))
    except PlanError as e:
        return [Row(entry["id"], entry["engine"], k, v, None, str(e)[:80]) for k, v in entry["measured"].items()]
    rows = []
    by_percentile: dict[int, tuple] = {}  # the estimates at p50 and at p99, each made once
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
            rows.append(Row(entry["id"], entry["engine"], metric, value, predicted, "", _is_burst(entry)))
    return rows


def _is_burst(entry: dict) -> bool:
    w = entry["workload"]
    at_once = w["mode"] == "offline" or (w["mode"] == "request_rate" and w.get("request_rate") == "inf")
    return at_once and w.get("dataset") == "sharegpt"


def _estimates(plan, model, entry: dict, opts: dict, percentile: int):
    """(the plan's estimates at the percentile, the mean and the median gap between two streamed pieces)
    with its replicas scheduling as the engine measured did."""
    if percentile != 50:
        dtype = "float16" if entry["dtype"] == "fp16" else "bfloat16"
        plan = make_plan(model, parse_declared(f"{entry['num_gpus']}x{entry['gpu']}"),
                         PlanOptions(dtype=dtype, target_percentile=percentile, **opts))
    steps = entry.get("scheduler_steps") or 1
    record = plan.record()
    replica = replace(replica_of(record, model), scheduler_steps=steps, mixes_prefill=_mixes_prefill(entry))
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
    is_burst = mode == "offline" or (mode == "request_rate" and not open_loop)
    if is_burst and metric.startswith(("ttft", "tpot", "itl", "e2e")):
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


def summary(rows: list[Row]) -> list[str]:
    out = []
    for label, keep in (("vLLM / SGLang", lambda r: r.engine in VLLM_CLASS and not r.is_burst),
                        ("TensorRT-LLM / NIM", lambda r: r.engine not in VLLM_CLASS and not r.is_burst),
                        ("all but bursts", lambda r: not r.is_burst),
                        ("bursts of ShareGPT requests (all engines)", lambda r: r.is_burst)):
        rs = [r.ratio for r in rows if keep(r) and r.ratio]
        if not rs:
            continue
        gm = math.exp(statistics.fmean(abs(math.log(x)) for x in rs))
        within = sum(1 for x in rs if 0.8 <= x <= 1.25)
        out.append(f"| {label} | {len(rs)} | {within} | {gm - 1:.0%} | "
                   f"{math.exp(statistics.fmean(math.log(x) for x in rs)):.2f} |")
    return out


def render(rows: list[Row]) -> str:
    lines = ["# Planner accuracy against published measurements", "",
             "Made by `python bench/accuracy.py` from `bench/published_results.yaml` (sources, quotes and "
             "settings there). Ratio = predicted / measured; a vLLM-class engine is the planner's model, so "
             "TensorRT-LLM figures are expected to run faster than predicted.", "",
             "Assumptions where the sources are silent:", ""]
    lines += [f"- {text}" for text in ASSUMPTIONS.values()]
    lines += ["", "| engines | figures | within 25% | mean abs error (geometric) | mean ratio |",
              "|---|---|---|---|---|", *summary(rows), "",
              "| result | engine | figure | measured | predicted | ratio |", "|---|---|---|---|---|---|"]
    for r in rows:
        pred = "-" if r.predicted is None else f"{r.predicted:,.1f}"
        ratio = r.note or ("-" if r.ratio is None else f"{r.ratio:.2f}")
        lines.append(f"| {r.id}{' (burst)' if r.is_burst else ''} | {r.engine} | {r.metric} | {r.measured:,.1f} | "
                     f"{pred} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with ACCURACY.md instead of writing it")
    args = parser.parse_args()
    entries = yaml.safe_load((HERE / "published_results.yaml").read_text())
    text = render([row for e in entries for row in predict(e)])
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
