"""`plan ... --plot FILE` (PNG or SVG by the suffix): the plan as a picture. Left, every layout's output tok/s per
GPU against tok/s per user, the Pareto front joined, the plan's layout marked and the TPOT target drawn (a user's
tok/s is 1000 / TPOT); right, with --trace, the replayed latencies at p50, p90 and p99 beside the targets.
matplotlib is an optional extra (pip install 'shardserve[plot]'); the plan itself never imports it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from shardserve.launch.plan_view import plan_row
from shardserve.planner.errors import PlanError
from shardserve.planner.plan_file import PlanFile

SUFFIXES = (".png", ".svg")


def write_plot(plan: PlanFile, path: Path) -> None:
    """The chart, written whole or not at all."""
    path = path.expanduser()
    if path.suffix.lower() not in SUFFIXES:
        raise PlanError(f"--plot {path}: a .png or .svg file (the suffix says which)")
    if not path.parent.is_dir():
        raise PlanError(f"--plot {path}: folder {path.parent} does not exist")
    try:
        import matplotlib
    except ImportError:
        raise PlanError("--plot needs matplotlib: pip install 'shardserve[plot]'") from None
    matplotlib.use("Agg")  # no display: a file
    import matplotlib.pyplot as plt

    has_latencies = plan.estimates.percentiles is not None
    figure, axes = plt.subplots(1, 2 if has_latencies else 1, figsize=(13 if has_latencies else 7, 5), squeeze=False)
    _pareto(axes[0][0], plan)
    if has_latencies:
        _latencies(axes[0][1], plan)
    figure.suptitle(f"{plan.model.id} on {plan.hardware.nodes}x{plan.hardware.gpus_per_node}x{plan.hardware.gpu.name}")
    figure.tight_layout()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    umask = os.umask(0o022)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # a chart is no secret: the mode any new file gets, not mkstemp's 0600
    os.close(fd)
    try:
        figure.savefig(tmp, format=path.suffix[1:].lower(), dpi=120)
        os.replace(tmp, path)
    finally:
        plt.close(figure)
        if os.path.exists(tmp):
            os.unlink(tmp)


def _layout(row: dict) -> str:
    return f"tp{row['tensor_parallel_size']} pp{row['pipeline_parallel_size']} dp{row['data_parallel_size']}"


def _pareto(ax, plan: PlanFile) -> None:
    est = plan.estimates
    others = [a for a in plan.alternatives if a["output_tokens_per_s_per_user"] and a["output_tokens_per_s_per_gpu"]]
    ax.scatter([a["output_tokens_per_s_per_user"] for a in others], [a["output_tokens_per_s_per_gpu"] for a in others],
               color="0.6", label="other layouts")
    front = sorted((a for a in others if a["on_pareto_front"]), key=lambda a: a["output_tokens_per_s_per_user"])
    if front:
        ax.plot([a["output_tokens_per_s_per_user"] for a in front], [a["output_tokens_per_s_per_gpu"] for a in front],
                color="tab:blue", marker="o", label="Pareto front")
    x, y = est.output_tokens_per_s_per_user, est.output_tokens_per_s_per_gpu
    ax.scatter([x], [y], marker="*", s=300, color="tab:red", zorder=5, label="the plan")
    ax.annotate(_layout(plan_row(plan)), (x, y), textcoords="offset points", xytext=(8, 8))
    if plan.service.tpot_ms:
        ax.axvline(1000 / plan.service.tpot_ms, color="tab:green", linestyle="--",
                   label=f"TPOT target {plan.service.tpot_ms:g} ms")
    unit = "CPU rank" if plan.hardware.gpu.is_cpu else "GPU"
    ax.set(xlabel="output tok/s per user", ylabel=f"output tok/s per {unit}", title="Layouts")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")


def _latencies(ax, plan: PlanFile) -> None:
    pct, svc = plan.estimates.percentiles, plan.service
    assert pct is not None  # (write_plot's condition)
    names = [(label, spread) for label, spread in (("TTFT", pct.ttft_ms), ("TPOT", pct.tpot_ms), ("ITL", pct.itl_ms),
                                                   ("E2E", pct.e2e_ms)) if spread is not None]
    width = 0.25
    for i, (q, color) in enumerate((("p50", "tab:blue"), ("p90", "tab:orange"), ("p99", "tab:red"))):
        ax.bar([j + (i - 1) * width for j in range(len(names))], [getattr(s, q) for _, s in names], width,
               label=q, color=color)
    for label, target in (("TTFT", svc.ttft_ms), ("TPOT", svc.tpot_ms)):
        if target and label in [n for n, _ in names]:
            j = [n for n, _ in names].index(label)
            ax.hlines(target, j - 1.5 * width, j + 1.5 * width, colors="tab:green", linestyles="--")
    ax.set_xticks(range(len(names)), [n for n, _ in names])
    ax.set_yscale("log")
    trace = plan.estimates.trace
    ax.set(ylabel="ms", title=f"The trace replayed ({trace.num_requests:,} requests)" if trace else "Latencies")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize="small")
