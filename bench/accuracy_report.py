"""bench/accuracy.py's report: the rows it compares, their summary by engine and kind of figure, and the engines
measured at one point side by side."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

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
    at_once: bool = False  # every request at once (offline, an infinite rate), whatever the lengths

    @property
    def ratio(self) -> float | None:
        return None if self.predicted is None else self.predicted / self.measured


def at_once(entry: dict) -> bool:
    """Every request sent at once: an offline run or an infinite rate."""
    w = entry["workload"]
    return w["mode"] == "offline" or (w["mode"] == "request_rate" and w.get("request_rate") == "inf")


def summary(rows: list[Row]) -> list[str]:
    out = []
    def ours(r: Row) -> bool:
        return r.engine in VLLM_CLASS and not r.is_burst

    for label, keep in (("vLLM / SGLang", ours),
                        ("  at a rate or concurrency: throughput, TPOT, ITL, end-to-end",
                         lambda r: ours(r) and not r.at_once and not _prompt_step(r.metric)),
                        ("  at a rate or concurrency: first token, ITL p99 (a step carrying a prompt)",
                         lambda r: ours(r) and not r.at_once and _prompt_step(r.metric)),
                        ("  every request at once, fixed lengths (throughput)", lambda r: ours(r) and r.at_once),
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


def _prompt_step(metric: str) -> bool:
    """A figure that a step carrying a prompt decides: the first token, or the p99 gap between two tokens."""
    return metric.startswith(("ttft", "first_token")) or metric == "itl_ms_p99"


SAME_POINT = ("ttft_ms_median", "itl_ms_median", "itl_ms_p99")


def same_point(entries: list[dict], rows: list[Row]) -> list[str]:
    """Engines measured at one point (model, GPU, layout, dtype, workload) by one source, side by side: what a step
    carrying a prompt costs each of them, beside the plan's prediction for each."""
    def point(e: dict) -> tuple:
        return (e["model"], e["gpu"], e["tensor_parallel_size"], e["dtype"], repr(sorted(e["workload"].items())),
                e["source"]["url"])
    groups: dict[tuple, list[dict]] = {}
    for e in (e for e in entries if e["workload"]["mode"] in ("concurrency", "request_rate") and not at_once(e)):
        groups.setdefault(point(e), []).append(e)
    by_id = {(r.id, r.metric): r for r in rows}
    out = []
    for group in (g for g in groups.values() if len({e["engine"] for e in g}) > 1):
        first = group[0]
        w = first["workload"]
        out += ["", f"{first['model']} on {first['tensor_parallel_size']}x {first['gpu']} ({first['dtype']}), "
                f"{w['dataset']} at concurrency {w.get('concurrency')}, one source ({first['source']['url']}):", "",
                "| engine | " + " | ".join(f"{m} measured / predicted" for m in SAME_POINT) + " |",
                "|---|" + "---|" * len(SAME_POINT)]
        for e in group:
            cells = []
            for metric in SAME_POINT:
                r = by_id.get((e["id"], metric))
                cells.append("-" if r is None else f"{r.measured:,.1f} / {r.predicted or 0:,.1f}")
            out.append(f"| {e['engine']} {e.get('engine_version') or ''} | " + " | ".join(cells) + " |")
        out += ["", *_spans(group)]
    return out


def _spans(group: list[dict]) -> list[str]:
    """How far apart the engines' first token and the extra gap a step carrying a prompt opens lie."""
    out = []
    for label, value in (("median TTFT", lambda m: m.get("ttft_ms_median")),
                         ("a prompt's step beyond a decode step (ITL p99 less median)",
                          lambda m: m["itl_ms_p99"] - m["itl_ms_median"] if "itl_ms_p99" in m and "itl_ms_median" in m
                          else None)):
        values = [v for v in (value(e["measured"]) for e in group) if v is not None]
        if len(values) > 1:
            out.append(f"- {label}: {min(values):.1f} to {max(values):.1f} ms ({max(values) / min(values):.1f}x); "
                       "25% either side of one prediction covers at most 1.56x")
    return out


def render(rows: list[Row], entries: list[dict], assumptions: dict[str, str]) -> str:
    lines = ["# Planner accuracy against published measurements", "",
             "Made by `python bench/accuracy.py` from `bench/published_results.yaml` (sources, quotes and "
             "settings there). Ratio = predicted / measured; a vLLM-class engine is the planner's model, so "
             "TensorRT-LLM figures are expected to run faster than predicted.", "",
             "Assumptions where the sources are silent:", ""]
    lines += [f"- {text}" for text in assumptions.values()]
    lines += ["", "| engines | figures | within 25% | mean abs error (geometric) | mean ratio |",
              "|---|---|---|---|---|", *summary(rows), "",
              "Engines measured at one point by one source: what a step carrying a prompt costs each (its first "
              "token, and the gap it opens between two tokens of the requests decoding) is the engine's own.",
              *same_point(entries, rows), "",
              "| result | engine | figure | measured | predicted | ratio |", "|---|---|---|---|---|---|"]
    for r in rows:
        pred = "-" if r.predicted is None else f"{r.predicted:,.1f}"
        ratio = r.note or ("-" if r.ratio is None else f"{r.ratio:.2f}")
        lines.append(f"| {r.id}{' (burst)' if r.is_burst else ''} | {r.engine} | {r.metric} | {r.measured:,.1f} | "
                     f"{pred} | {ratio} |")
    return "\n".join(lines) + "\n"
