"""The GPU benchmarks behind bench/run_gpu.sh, one kind per call so that each fits one device call:
batch-1 decode against the HBM roofline measured in the same run, offline throughput beside
transformers' continuous batching, and serving through the OpenAI API at fixed concurrency.

    python bench/gpu_bench.py decode  --model llama-3.1-8b                      # on an H100/H200
    python bench/gpu_bench.py offline --model llama-3.1-8b --shapes 128/128
    python bench/gpu_bench.py serve   --model llama-3.1-8b --concurrency 1 16 64
    python bench/gpu_bench.py steps   --model llama-3.1-8b --batches 1 8 32 128   # the plan's step beside ours
    python bench/gpu_bench.py decode  --model qwen3-0.6b --small --device cpu   # smoke run on a CPU
    python bench/gpu_bench.py decode  --model llama-3.1-8b --quantization awq   # also fp8 (online)

Checkpoints are random bf16 weights of the real shapes (configs from the planner's catalog),
written once under --workdir; prompts are random token ids, ignore_eos, prefix caching off.
Each record is appended to --results the moment it is measured (a later crash loses nothing),
with the plan's estimate for the same model and GPU beside the measured figure.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_checkpoints import SHAPES, make_awq_checkpoint, make_checkpoint  # noqa: E402
import gpu_serve  # noqa: E402  (bench/gpu_serve.py: the serving benchmark's server and client)
import plan_vs_engine  # noqa: E402  (bench/plan_vs_engine.py: the plan's decode step beside the engine's)
import throughput  # noqa: E402  (bench/throughput.py: shared prompt and timing helpers)

from shardserve.planner.settings import BY_NAME  # noqa: E402

RESULTS_JSON = Path(__file__).parent / "results.json"
GPU_NAMES = {"H100": "H100-80GB", "H200": "H200"}  # torch's device name -> the planner's catalog


def versions() -> dict:
    import transformers
    from shardserve.launch import __version__
    out = {"torch": torch.__version__, "transformers": transformers.__version__,
           "shardserve": __version__, "python": platform.python_version()}
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        pass
    return out


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"


def append_record(record: dict, path: Path) -> None:
    """Append one record at once, rewriting the file atomically."""
    existing = json.loads(path.read_text()) if path.exists() else []
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(existing + [record], indent=1) + "\n")
    os.replace(tmp, path)
    print(json.dumps(record), flush=True)


def free_device_memory(device: str) -> None:
    """Between engines: whatever the last one left is collected and handed back to the driver."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def measure_bandwidth(device: str, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        throughput._synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        throughput._synchronize(device)
        times.append(time.perf_counter() - start)
    del src, dst
    free_device_memory(device)
    return 2 * nbytes / sorted(times)[len(times) // 2]


def planner_gpu(device: str) -> str | None:
    """The hardware the planner plans this device as: a catalog GPU, "cpu", or None (a GPU without data)."""
    if device == "cpu":
        return "cpu"
    return next((name for key, name in GPU_NAMES.items() if key in device_name(device)), None)


def plan_estimate(folder: Path, device: str, input_len: int, output_len: int,
                  concurrency: float | None = None, enforce_eager: bool = False) -> dict | None:
    """The planner's figures for this checkpoint on this GPU and workload (None off a catalog GPU);
    without a concurrency, full batches."""
    from shardserve.planner import PlanOptions, load_model, make_plan, parse_declared
    gpu = planner_gpu(device) if device == "cuda" else None
    if gpu is None:
        return None
    plan = make_plan(load_model(str(folder)), parse_declared(gpu), PlanOptions(
        max_model_len=input_len + output_len + 16, input_len=input_len, output_len=output_len,
        concurrency=concurrency, enforce_eager=enforce_eager))
    e = plan.chosen.estimates
    return {"hardware": gpu, "input_len": input_len, "output_len": output_len,
            "concurrency": e.workload.concurrency, "ttft_ms": round(e.ttft_ms, 1), "tpot_ms": round(e.tpot_ms, 2),
            "output_tokens_per_s": round(e.output_tokens_per_s, 1),
            "decode_tok_s_batch1": round(e.decode_tokens_per_s_batch1, 1), "source": e.source}


def burst_estimate(folder: Path, device: str, num_prompts: int, input_len: int, output_len: int) -> dict | None:
    """The plan for an offline run: all the prompts at once, replayed through the engine's scheduler as
    `plan --trace` does (the steady-state figure assumes every step carries a prompt's chunk)."""
    import tempfile

    from shardserve.launch.plan_view import make_plan_from
    gpu = planner_gpu(device) if device == "cuda" else None
    if gpu is None:
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".csv") as trace:
        trace.write("arrival_s,input_len,output_len\n" + f"0,{input_len},{output_len}\n" * num_prompts)
        trace.flush()
        plan = make_plan_from({"model": str(folder), "hardware": gpu, "max_model_len": input_len + output_len + 16},
                              None, None, trace_path=Path(trace.name))
    e = plan.estimates
    return {"hardware": gpu, "input_len": input_len, "output_len": output_len, "num_prompts": num_prompts,
            "output_tokens_per_s": round(e.output_tokens_per_s, 1), "kv_cache_tokens": plan.memory.kv_cache_tokens,
            "source": e.source + "; a burst replayed"}


def decode_batch1(folder: Path, device: str, bandwidth: float, prompt_len: int,
                  output_len: int, enforce_eager: bool, quantization: str | None = None,
                  load_format: str = "auto", async_scheduling: bool = False) -> dict:
    """Tokens/s of one request's decode, against weights + KV bytes per step over bandwidth."""
    from shardserve.planner import load_model
    from shardserve.runtime import LLM, SamplingParams
    llm = LLM(str(folder), device=device, max_model_len=prompt_len + output_len + 16,
              enable_prefix_caching=False, skip_tokenizer_init=True, enforce_eager=enforce_eager,
              quantization="fp8" if quantization == "fp8" else None, load_format=load_format,
              async_scheduling=async_scheduling)
    try:
        prompt = [{"prompt_token_ids": throughput.random_prompts(
            llm.engine.config.model.vocab_size, 1, prompt_len, 0)[0]}]

        def timed(n: int) -> float:
            throughput._synchronize(device)
            start = time.perf_counter()
            llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            throughput._synchronize(device)
            return time.perf_counter() - start

        timed(8)  # warm-up: compilation, allocator (graphs were captured when the engine started)
        decode_s = min(timed(output_len) for _ in range(2)) - min(timed(1) for _ in range(2))
        dtype_bytes = llm.engine.config.model.dtype.itemsize
        has_graphs = llm.engine.executor.worker.cuda_graphs is not None
        model = llm.engine.executor.worker.model
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # as held: packed, fp8
    finally:
        llm.shutdown()
        llm = None  # the closure above holds it too
        free_device_memory(device)
    tok_s = (output_len - 1) / decode_s
    info = load_model(str(folder))
    step_bytes = weight_bytes + (prompt_len + output_len / 2) * info.spec.kv_bytes_per_token(dtype_bytes)
    roofline = bandwidth / step_bytes
    return {"benchmark": "decode_batch1", "shardserve_tok_s": round(tok_s, 1),
            "roofline_tok_s": round(roofline, 1), "fraction_of_roofline": round(tok_s / roofline, 3),
            "settings": {"prompt_len": prompt_len, "output_len": output_len, "enforce_eager": enforce_eager,
                         "quantization": quantization, "load_format": load_format,
                         "async_scheduling": async_scheduling,
                         "cuda_graphs": has_graphs, "weight_bytes": weight_bytes,
                         "bandwidth_bytes_per_s": round(bandwidth)}}


def offline_prompts(folder: Path, num_prompts: int, input_len: int) -> list[list[int]]:
    """The offline benchmark's prompts (seed 0): the same for every engine measured on them."""
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    return throughput.random_prompts(vocab, num_prompts, input_len, 0)


def offline(folder: Path, device: str, num_prompts: int, input_len: int, output_len: int,
            skip_hf: bool, load_format: str = "auto") -> dict:
    defaults = {name: BY_NAME[name].default for name in (
        "dtype", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes", "gpu_memory_utilization",
        "seed", "distributed_executor_backend", "enforce_eager")}
    args = argparse.Namespace(**defaults, device=device, input_len=input_len, output_len=output_len,
                              hf_batch_size=None, tensor_parallel_size=1, pipeline_parallel_size=1,
                              async_scheduling=False, load_format=load_format)
    prompts = offline_prompts(folder, num_prompts, input_len)
    ours = throughput.bench_runtime(args, str(folder), prompts)
    free_device_memory(device)
    overlapped = throughput.bench_runtime(argparse.Namespace(**vars(args) | {"async_scheduling": True}),
                                          str(folder), prompts)
    free_device_memory(device)
    hf, hf_error = None, None
    if not skip_hf:
        try:  # NOTE: the peer's failure is a finding to record, not a reason to lose our number
            hf = hf_generate_batch(folder, device, prompts, output_len)
        except Exception as e:  # noqa: BLE001
            hf_error = "".join(traceback.format_exception_only(e)).strip()[-2000:]
        free_device_memory(device)
    return {"benchmark": "offline_throughput",
            "shardserve_tok_s": ours["output_tokens_per_s"],
            "shardserve_async_scheduling_tok_s": overlapped["output_tokens_per_s"],
            "hf_tok_s": hf["output_tokens_per_s"] if hf else None,
            "ratio": round(ours["output_tokens_per_s"] / hf["output_tokens_per_s"], 2) if hf else None,
            "settings": {"num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
                         "shardserve": ours, "shardserve_async_scheduling": overlapped, "hf": hf,
                         "hf_error": hf_error}}


def hf_generate_batch(folder: Path, device: str, prompts: list[list[int]], output_len: int) -> dict:
    """transformers' continuous batching (`generate_batch`, paged|sdpa attention)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    if any(folder.glob("*.safetensors")):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto", attn_implementation="paged|sdpa")
    else:  # a dummy folder (config and tokenizer): the same shapes with transformers' own random weights
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.bfloat16,
                                                     attn_implementation="paged|sdpa")
    model = model.to(device).eval()
    config = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len,
                              do_sample=False, eos_token_id=-1, pad_token_id=0)
    cache = {}
    if device == "cpu":  # NOTE: sized from the host's free memory, its paged cache took 13 GB for 4 prompts
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        blocks = -(-len(prompts) * (max(map(len, prompts)) + output_len) // 256) + 4  # 256-token pages
        cache = {"continuous_batching_config": ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=2048)}
    try:
        with torch.no_grad():
            model.generate_batch(prompts[:2], generation_config=config, max_new_tokens=4, **cache)
            throughput._synchronize(device)
            start = time.perf_counter()
            outputs = model.generate_batch(prompts, generation_config=config, **cache)
            throughput._synchronize(device)
    finally:
        del model
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.generated_tokens) for o in outputs.values())
    return throughput._result(elapsed, prompts, num_out)


def run_decode(args, folder: Path, base: dict) -> None:
    bandwidth = measure_bandwidth(args.device, (64 << 20) if args.small else (4 << 30))
    prompt_len, output_len = (32, 16) if args.small else (128, 256)
    planned = folder
    if args.quantization == "awq":
        folder = make_awq_checkpoint(folder)
    eager_variants = (True, False) if args.device == "cuda" else (True,)  # eager, then graphs
    for enforce_eager in (False,) if args.async_scheduling else eager_variants:
        estimate = plan_estimate(planned, args.device, prompt_len, output_len, concurrency=1,
                                 enforce_eager=enforce_eager)
        record = decode_batch1(folder, args.device, bandwidth, prompt_len, output_len, enforce_eager,
                               args.quantization, args.load_format, args.async_scheduling)
        append_record(base | record | {"plan_estimate": estimate}, Path(args.results))


def run_steps(args, folder: Path, base: dict) -> None:
    """The plan's decode step (from this GPU's calibration where part 7 left one, else the shipped
    tables) beside the engine's, batch by batch."""
    gpu = planner_gpu(args.device)
    if gpu is None:
        raise SystemExit(f"steps: {device_name(args.device)} is not a GPU the planner has data for")
    prompt_len, steps = (16, 8) if args.small else (128, 64)
    result = plan_vs_engine.compare(str(folder), args.device, gpu, args.batches, prompt_len, steps, repeats=3,
                                    load_format=args.load_format)
    append_record(base | {"benchmark": "decode_steps", "rows": result["rows"],
                          "plan_estimate": {"hardware": gpu, "source": result["source"]}}, Path(args.results))


def run_offline(args, folder: Path, base: dict) -> None:
    for shape in args.shapes:
        input_len, output_len = (int(n) for n in shape.split("/"))
        record = offline(folder, args.device, args.num_prompts, input_len, output_len, args.skip_hf,
                         args.load_format)
        estimate = burst_estimate(folder, args.device, args.num_prompts, input_len, output_len)
        append_record(base | record | {"plan_estimate": estimate}, Path(args.results))


def run_offline_hf(args, folder: Path, base: dict) -> None:
    """transformers' continuous batching alone on the offline prompts (a record of its own, so that a
    bounded run keeps our figures when the peer's is cut off)."""
    for shape in args.shapes:
        input_len, output_len = (int(n) for n in shape.split("/"))
        prompts = offline_prompts(folder, args.num_prompts, input_len)
        hf = hf_generate_batch(folder, args.device, prompts, output_len)
        append_record(base | {"benchmark": "offline_throughput_transformers", "hf_tok_s": hf["output_tokens_per_s"],
                              "settings": {"num_prompts": args.num_prompts, "input_len": input_len,
                                           "output_len": output_len, "hf": hf}}, Path(args.results))


def run_serve(args, folder: Path, base: dict) -> None:
    for record in gpu_serve.serve_levels(folder, args.device, args.concurrency, args.num_prompts,
                                         args.input_len, args.output_len):
        estimate = plan_estimate(folder, args.device, args.input_len, args.output_len,
                                 concurrency=record.get("concurrency"))
        append_record(base | record | {"plan_estimate": estimate}, Path(args.results))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("benchmark", choices=["decode", "offline", "offline-hf", "serve", "steps"])
    parser.add_argument("--model", required=True, choices=list(SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quantization", choices=["fp8", "awq"], help="decode: fp8 (online) or awq weights")
    parser.add_argument("--small", action="store_true", help="tiny shapes, few prompts (a smoke run)")
    parser.add_argument("--async-scheduling", action="store_true", help="decode: graphs with async scheduling alone")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                        help="dummy: no checkpoint written, the engine draws random weights (vLLM's flag)")
    parser.add_argument("--workdir", default=os.environ.get("TMPDIR", "/tmp") + "/shardserve-bench")
    parser.add_argument("--results", default=str(RESULTS_JSON))
    parser.add_argument("--shapes", nargs="+", default=["128/128"], help="offline: INPUT/OUTPUT lengths")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--skip-hf", action="store_true", help="offline: no transformers peer")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64], help="serve")
    parser.add_argument("--input-len", type=int, default=128, help="serve")
    parser.add_argument("--output-len", type=int, default=128, help="serve")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128], help="steps")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    folder = make_checkpoint(args.model, workdir, args.small, args.device, args.load_format == "dummy")
    base = {"date": datetime.date.today().isoformat(), "device": device_name(args.device),
            "versions": versions(), "model": args.model + ("-small" if args.small else "")
            + (f"-{args.quantization}" if args.quantization else ""), "load_format": args.load_format}
    {"decode": run_decode, "offline": run_offline, "offline-hf": run_offline_hf, "serve": run_serve,
     "steps": run_steps}[args.benchmark](
        args, folder, base)


if __name__ == "__main__":
    main()
