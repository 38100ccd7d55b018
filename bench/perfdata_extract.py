"""Make planner/perfdata/ from aiconfigurator-core's measured vLLM operator data (an optional tool).

    pip install aiconfigurator-core pandas pyarrow
    python bench/perfdata_extract.py            # or --wheel-dir DIR: an unpacked wheel

For each GPU of our catalog that the database measured with vLLM kernels it writes
`planner/perfdata/<gpu>.json.gz`: grids of latencies in milliseconds (GEMM by m, n, k; prefill and
decode attention; all-reduce by GPUs and bytes; the fused MoE layer of each measured model shape),
and `roofline_fit.json`: the efficiencies a roofline
reaches on those GPUs, which the planner uses for GPUs with no data. The planner reads only these
files (no pandas, no torch). Source and licence: aiconfigurator-core (Apache-2.0), NVIDIA.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path

import pandas as pd
import yaml

OUT = Path(__file__).resolve().parent.parent / "planner" / "perfdata"
# aiconfigurator system folder -> our catalog's GPU name; the vLLM version its data was taken with.
SYSTEMS = {"h100_sxm": "H100-80GB", "h200_sxm": "H200", "b200_sxm": "B200", "a100_sxm": "A100-80GB",
           "l40s": "L40S"}
GEMM_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
HEAD_DIMS = (64, 128, 256)


def _version(folder: Path) -> Path:
    """The newest version folder under `folder` (they are named by the engine version)."""
    def key(p: Path):
        return tuple(int(x) if x.isdigit() else 0 for x in p.name.replace("post", ".").split("."))
    return max((p for p in folder.iterdir() if p.is_dir()), key=key)


def _main_kernel(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows of the kernel measured most: the engine's default for that case."""
    if frame.empty:
        return frame
    top = frame["kernel_source"].value_counts().index[0]
    return frame[frame["kernel_source"] == top]


def _grid(frame: pd.DataFrame, axes: dict[str, tuple], value: str = "latency") -> dict:
    """A dense grid over `axes` (column -> values), the median where cells repeat, None where missing."""
    cells = frame.groupby(list(axes))[value].median().to_dict()
    names, flat = list(axes), []

    def walk(prefix: tuple, depth: int) -> None:
        if depth == len(names):
            v = cells.get(prefix)
            flat.append(None if v is None or v != v else float(f"{v:.4g}"))
            return
        for x in axes[names[depth]]:
            walk(prefix + (x,), depth + 1)
    walk((), 0)
    return {"axes": [[n, [int(x) for x in axes[n]]] for n in names], "ms": flat}


def _gemm(folder: Path) -> dict:
    frame = pd.read_parquet(_version(folder / "gemm" / "vllm") / "gemm_perf.parquet")
    out = {}
    for dtype, name in (("bfloat16", "bfloat16"), ("fp8", "fp8")):
        rows = _main_kernel(frame[frame["gemm_dtype"] == dtype])
        if rows.empty:
            continue
        ns = tuple(sorted(rows["n"].unique()))
        out[f"gemm.{name}"] = _grid(rows, {"m": GEMM_M, "n": ns, "k": tuple(sorted(rows["k"].unique()))})
    return out


def _attention(folder: Path) -> dict:
    base = _version(folder / "attention" / "vllm")
    out = {}
    prefill = pd.read_parquet(base / "context_attention_perf.parquet")
    decode = pd.read_parquet(base / "generation_attention_perf.parquet")
    prefill = prefill.rename(columns={"batch_size": "batch"})
    decode = decode.rename(columns={"batch_size": "batch", "num_key_value_heads": "num_kv_heads"})
    decode = decode.assign(context=decode["step"] + 1)
    for frame in (prefill, decode):  # older data has no window column: every row is full attention
        if "window_size" not in frame:
            frame["window_size"] = 0
    for kv in ("bfloat16", "fp8"):
        p = _main_kernel(prefill[(prefill["kv_cache_dtype"] == kv) & (prefill["window_size"] == 0)])
        if not p.empty:
            out[f"prefill_attention.{kv}"] = _grid(p, {
                "head_dim": HEAD_DIMS, "num_heads": tuple(sorted(p["num_heads"].unique())),
                "batch": tuple(sorted(p["batch"].unique())), "isl": tuple(sorted(p["isl"].unique()))})
        d = _main_kernel(decode[(decode["kv_cache_dtype"] == kv) & (decode["window_size"] == 0)])
        if not d.empty:
            out[f"decode_attention.{kv}"] = _grid(d, {
                "head_dim": HEAD_DIMS, "num_kv_heads": tuple(sorted(d["num_kv_heads"].unique())),
                "batch": tuple(sorted(d["batch"].unique())),
                "context": tuple(sorted(d["context"].unique()))})
    return out


def _allreduce(folder: Path) -> dict:
    """vLLM's all-reduce: its custom kernel under CUDA graphs, else NCCL; the faster per size."""
    frames = []
    custom = folder / "comm" / "vllm"
    if custom.exists():
        c = pd.read_parquet(_version(custom) / "custom_allreduce_perf.parquet")
        frames.append(c[c["backend"] == "vllm_graph"])
    nccl = folder / "comm" / "nccl"
    if nccl.exists():
        n = pd.read_parquet(_version(nccl) / "nccl_perf.parquet")
        frames.append(n[(n["op_name"] == "all_reduce") & (n["nccl_dtype"].isin(["bfloat16", "half"]))])
    frame = pd.concat(frames)
    frame = frame.rename(columns={"message_size": "bytes"})
    frame = frame.groupby(["num_gpus", "bytes"], as_index=False)["latency"].min()
    return {"allreduce": _grid(frame, {"num_gpus": tuple(sorted(frame["num_gpus"].unique())),
                                      "bytes": tuple(sorted(frame["bytes"].unique()))})}


def _moe(folder: Path) -> dict:
    """vLLM's fused MoE layer (bf16, balanced routing) for each model shape measured: one table per
    shape over the experts' tensor-parallel and expert-parallel sizes and the tokens of a step."""
    base = folder / "moe" / "vllm"
    if not base.exists():
        return {}
    frame = pd.read_parquet(_version(base) / "moe_perf.parquet")
    frame = _main_kernel(frame[(frame["moe_dtype"] == "bfloat16") & (frame["distribution"] == "balanced")])
    frame = frame.rename(columns={"moe_tp_size": "tp", "moe_ep_size": "ep"})
    out = {}
    for (h, i, k, e), rows in frame.groupby(["hidden_size", "inter_size", "topk", "num_experts"]):
        out[f"moe.bfloat16@{h}x{i}x{k}x{e}"] = _grid(rows, {
            "tp": tuple(sorted(rows["tp"].unique())), "ep": tuple(sorted(rows["ep"].unique())),
            "num_tokens": tuple(sorted(rows["num_tokens"].unique()))})
    return out


def extract(systems_dir: Path, version: str) -> dict[str, dict]:
    made = {}
    for system, gpu in SYSTEMS.items():
        folder = systems_dir / "data" / system
        if not (folder / "gemm" / "vllm").exists():
            continue
        tables = {**_gemm(folder), **_attention(folder), **_allreduce(folder), **_moe(folder)}
        vllm = _version(folder / "gemm" / "vllm").name
        made[gpu] = {"gpu": gpu, "source": f"aiconfigurator-core {version} (Apache-2.0, NVIDIA): "
                     f"systems/data/{system}, vLLM {vllm} kernels", "tables": tables}
    return made


def _peaks(gpu: str) -> dict:
    catalog = yaml.safe_load((OUT.parent / "catalog" / "gpus.yaml").read_text())
    e = catalog[gpu]
    return {"flops": e["bf16_tflops"] * 1e12, "hbm": e["hbm_gbps"] * 1e9, "link": e["link_gbps"] * 1e9}


def _cells(table: dict):
    """(coordinates as a dict, ms) for every measured cell."""
    names = [a[0] for a in table["axes"]]
    sizes = [len(a[1]) for a in table["axes"]]
    for flat, ms in enumerate(table["ms"]):
        if ms is None:
            continue
        coords, rest = {}, flat
        for name, size, axis in reversed(list(zip(names, sizes, [a[1] for a in table["axes"]]))):
            coords[name] = axis[rest % size]
            rest //= size
        yield coords, ms


def fit_roofline(made: dict[str, dict]) -> dict:
    """Efficiencies a roofline reaches on the measured GPUs (medians across them)."""
    fits = {"gemm_compute": [], "gemm_memory": [], "floor_ms": [], "prefill_attention_compute": [],
            "decode_attention_memory": [], "allreduce_link": [], "allreduce_floor_ms": []}
    for gpu, data in made.items():
        peak, t = _peaks(gpu), data["tables"]
        gemm = list(_cells(t["gemm.bfloat16"]))
        fits["gemm_compute"].append(statistics.median(
            2 * c["m"] * c["n"] * c["k"] / (ms * 1e-3) / peak["flops"] for c, ms in gemm
            if c["m"] >= 4096 and c["n"] >= 4096 and c["k"] >= 4096))
        fits["gemm_memory"].append(statistics.median(
            2 * c["n"] * c["k"] / (ms * 1e-3) / peak["hbm"] for c, ms in gemm
            if c["m"] == 1 and c["n"] * c["k"] >= 4096 * 4096))
        fits["floor_ms"].append(min(ms for _, ms in gemm))
        pre = [(c, ms) for c, ms in _cells(t["prefill_attention.bfloat16"])
               if c["isl"] >= 4096 and c["head_dim"] == 128 and c["num_heads"] >= 32]
        fits["prefill_attention_compute"].append(statistics.median(
            2 * c["batch"] * c["isl"] ** 2 * c["num_heads"] * c["head_dim"] / (ms * 1e-3) / peak["flops"]
            for c, ms in pre))
        dec = [(c, ms) for c, ms in _cells(t["decode_attention.bfloat16"])
               if c["batch"] * c["context"] >= 64 * 4096 and c["head_dim"] == 128]
        fits["decode_attention_memory"].append(statistics.median(
            4 * c["batch"] * c["context"] * c["num_kv_heads"] * c["head_dim"] / (ms * 1e-3) / peak["hbm"]
            for c, ms in dec))
        ar = list(_cells(t["allreduce"]))
        fits["allreduce_link"].append(statistics.median(
            2 * (c["num_gpus"] - 1) / c["num_gpus"] * c["bytes"] / (ms * 1e-3) / peak["link"]
            for c, ms in ar if c["bytes"] >= 64 << 20))
        fits["allreduce_floor_ms"].append(min(ms for _, ms in ar))
    return {"source": "fitted by bench/perfdata_extract.py to " + ", ".join(sorted(made)),
            **{k: round(statistics.median(v), 4) for k, v in fits.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel-dir", type=Path, help="an unpacked aiconfigurator-core wheel")
    args = parser.parse_args()
    if args.wheel_dir:
        root = args.wheel_dir / "aiconfigurator_core"
        meta = next(args.wheel_dir.glob("aiconfigurator_core-*.dist-info"))
        version = meta.name.removesuffix(".dist-info").split("-")[1]
    else:
        import importlib.metadata

        import aiconfigurator_core
        root, version = Path(aiconfigurator_core.__file__).parent, importlib.metadata.version("aiconfigurator-core")
    made = extract(root / "systems", version)
    OUT.mkdir(exist_ok=True)
    for gpu, data in made.items():
        with gzip.open(OUT / f"{gpu.lower()}.json.gz", "wt", compresslevel=9) as f:
            json.dump(data, f, separators=(",", ":"))
        print(f"{gpu}: {', '.join(data['tables'])}")
    (OUT / "roofline_fit.json").write_text(json.dumps(fit_roofline(made), indent=1) + "\n")


if __name__ == "__main__":
    main()
