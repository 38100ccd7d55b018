"""Timings of the attention-path kernels alone at Llama-3.1-8B shapes (32 heads, 8 KV heads, head_dim 128,
block_size 16, bf16), each replayed from a CUDA graph so that launch overhead does not count:
grouped split-KV decode against the HBM copy bandwidth measured in the same run, the GQA-packed prefill
in TFLOP/s, rotary + KV write and SiLU-and-mul per token.

    python bench/kernel_bench.py                  # on an H100/H200; records go to bench/results.json
    python bench/kernel_bench.py --small --device cpu --results /tmp/r.json   # smoke run (interpreter)

On a CPU the kernels run under TRITON_INTERPRET=1 at tiny shapes in float16, timed by the wall clock:
the numbers mean nothing, the run proves the script works before a GPU call is spent on it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. at the imports below

import torch  # noqa: E402

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]  # gpu_bench; tests/ helpers
from gpu_bench import RESULTS_JSON, append_record, device_name, measure_bandwidth, versions  # noqa: E402

from shardserve.runtime.attention import triton_decode, triton_prefill  # noqa: E402
from shardserve.runtime.attention.triton_rotary_kv import rotary_store_kv  # noqa: E402
from shardserve.runtime.layers.rotary import RotaryEmbedding  # noqa: E402
from shardserve.runtime.layers.triton_activation import silu_and_mul  # noqa: E402
from tests.runtime.attention_cases import make_batch  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
SMALL_HEADS, SMALL_KV_HEADS, SMALL_HEAD_DIM = 4, 2, 16
DEVICE, DTYPE = torch.device("cuda"), torch.bfloat16  # a --small --device cpu run changes them (main)
DECODE_CASES = ((1, 1024), (1, 8192), (1, 32768), (8, 1024), (8, 8192), (64, 1024), (64, 4096), (256, 1024))
PREFILL_CASES = ([(0, 2048)], [(0, 512)] * 4, [(4096, 512)], [(0, 8192)])
FUSED_TOKENS, MLP_WIDTH = (1, 64, 256, 4096), 14336


def graph_time_us(fn, calls: int = 20, replays: int = 10) -> float:
    """Mean GPU time of one fn() from `replays` replays of a graph of `calls` calls (on a CPU: one
    call's wall time)."""
    fn()  # compile
    if DEVICE.type == "cpu":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (calls * replays)


def attention_case(shapes):
    num_blocks = sum(-(-(c + n) // BLOCK_SIZE) for c, n in shapes) + 1
    meta = make_batch(shapes, BLOCK_SIZE, num_blocks, DEVICE)
    q = torch.randn(meta.query_start_loc_cpu[-1], HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    return meta, q, cache


def decode_records(bandwidth: float):
    for batch, context in DECODE_CASES:
        meta, q, cache = attention_case([(context - 1, 1)] * batch)
        us = graph_time_us(lambda: triton_decode.paged_decode(q, cache, meta, HEAD_DIM**-0.5))
        kv_per_s = batch * context * KV_HEADS * HEAD_DIM * 2 * 2 / (us * 1e-6)  # K and V, bf16
        yield {"kernel": "paged_decode", "batch": batch, "context": context, "us": round(us, 2),
               "max_splits": triton_decode.max_decode_splits(batch, KV_HEADS, meta.max_seq_len),
               "kv_gb_per_s": round(kv_per_s / 1e9, 1), "fraction_of_copy": round(kv_per_s / bandwidth, 3)}


def prefill_records():
    for shapes in PREFILL_CASES:
        meta, q, cache = attention_case(shapes)
        us = graph_time_us(lambda: triton_prefill.paged_prefill(q, cache, meta, HEAD_DIM**-0.5), calls=5)
        pairs = sum(n * c + n * (n + 1) // 2 for c, n in shapes)  # (query, key) pairs under the causal mask
        flops = 4 * HEADS * HEAD_DIM * pairs
        yield {"kernel": "paged_prefill", "shapes": shapes, "us": round(us, 1),
               "tflop_per_s": round(flops / us / 1e6, 1), "tile": triton_prefill.prefill_tile(q.dtype, HEAD_DIM, HEADS // KV_HEADS)}


def fused_records():
    rotary = RotaryEmbedding(HEAD_DIM, 8192, {"rope_type": "default", "rope_theta": 500000.0}).to(DEVICE)
    for num_tokens in FUSED_TOKENS:
        qkv = torch.randn(num_tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=DEVICE, dtype=DTYPE)
        sizes = [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]
        q, k, v = (x.unflatten(1, (-1, HEAD_DIM)) for x in qkv.split(sizes, dim=-1))
        positions = torch.arange(num_tokens, device=DEVICE)
        cache = torch.zeros(2, num_tokens // BLOCK_SIZE + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=DEVICE,
                            dtype=DTYPE)
        slots = torch.arange(num_tokens, device=DEVICE)
        us = graph_time_us(lambda: rotary_store_kv(q, k, v, positions, rotary.cos, rotary.sin, cache, slots))
        yield {"kernel": "rotary_store_kv", "num_tokens": num_tokens, "us": round(us, 2)}
        gate_up = torch.randn(num_tokens, 2 * MLP_WIDTH, device=DEVICE, dtype=DTYPE)
        us = graph_time_us(lambda: silu_and_mul(gate_up))
        yield {"kernel": "silu_and_mul", "num_tokens": num_tokens, "us": round(us, 2)}


def use_small_shapes(device: torch.device) -> None:
    global HEADS, KV_HEADS, HEAD_DIM, DEVICE, DTYPE, DECODE_CASES, PREFILL_CASES, FUSED_TOKENS, MLP_WIDTH
    HEADS, KV_HEADS, HEAD_DIM, DEVICE = SMALL_HEADS, SMALL_KV_HEADS, SMALL_HEAD_DIM, device
    DTYPE = torch.float16 if device.type == "cpu" else DTYPE  # the interpreter's bf16 dots are wrong
    DECODE_CASES, PREFILL_CASES = ((1, 40), (2, 20)), ([(0, 24)], [(8, 8)] * 2)
    FUSED_TOKENS, MLP_WIDTH = (1, 16), 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(RESULTS_JSON))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--small", action="store_true", help="tiny shapes (a smoke run; with --device cpu)")
    args, _ = parser.parse_known_args()  # run_gpu.sh hands every part the same arguments
    if args.small:
        use_small_shapes(torch.device(args.device))
    bandwidth = measure_bandwidth(args.device, (64 << 20) if args.small else (4 << 30))
    base = {"date": datetime.date.today().isoformat(), "device": device_name(args.device), "versions": versions(),
            "benchmark": "kernels", "copy_bandwidth_gb_per_s": round(bandwidth / 1e9, 1)}
    for records in (decode_records(bandwidth), prefill_records(), fused_records()):
        for record in records:
            append_record(base | record, Path(args.results))


if __name__ == "__main__":
    main()
