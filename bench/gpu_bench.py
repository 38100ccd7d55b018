"""The GPU suite behind bench/run_gpu.sh: decode against the HBM roofline, offline throughput
beside transformers' continuous batching, and records appended to bench/results.json.

    python bench/gpu_bench.py --models llama-3.1-8b qwen3-0.6b          # on an H100/H200
    python bench/gpu_bench.py --small --device cpu                       # smoke run on a CPU

Checkpoints are random bf16 weights of the real shapes (configs from the planner's catalog),
written once under --workdir; prompts are random token ids, ignore_eos, prefix caching off.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import throughput  # noqa: E402  (bench/throughput.py: shared prompt and timing helpers)

from shardserve.planner.catalog import model_catalog  # noqa: E402

SHAPES = {"llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct", "qwen3-0.6b": "Qwen/Qwen3-0.6B"}
SMALL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 2048}
RESULTS_JSON = Path(__file__).parent / "results.json"


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
    return 2 * nbytes / sorted(times)[len(times) // 2]


def make_checkpoint(shape: str, workdir: Path, small: bool, device: str) -> Path:
    """Random weights with the shape's config, saved once; bf16 (float32 for --small on CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    folder = workdir / (shape + ("-small" if small else ""))
    if (folder / "config.json").exists():
        return folder
    config = dict(model_catalog()[SHAPES[shape]])
    if small:
        config |= SMALL | {"max_position_embeddings": 4096}
    arch = config["architectures"][0]
    model_type = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}[arch]
    hf_config = AutoConfig.for_model(model_type, **{k: v for k, v in config.items()
                                                    if k != "architectures"})
    hf_config.architectures = [arch]
    dtype = torch.float32 if small and device == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.save_pretrained(folder)
    del model
    return folder


def decode_batch1(folder: Path, device: str, bandwidth: float, prompt_len: int,
                  output_len: int, enforce_eager: bool) -> dict:
    """Tokens/s of one request's decode, against weights + KV bytes per step over bandwidth."""
    from shardserve.planner import load_model
    from shardserve.runtime import LLM, SamplingParams
    llm = LLM(str(folder), device=device, max_model_len=prompt_len + output_len + 16,
              enable_prefix_caching=False, skip_tokenizer_init=True, enforce_eager=enforce_eager)
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
    tok_s = (output_len - 1) / decode_s
    info = load_model(str(folder))
    dtype_bytes = 2 if "16" in str(llm.engine.config.model.dtype) else 4
    weight_bytes = sum(t.numel for t in info.tensors) * dtype_bytes
    kv_per_token = info.spec.kv_bytes_per_token(dtype_bytes)
    step_bytes = weight_bytes + (prompt_len + output_len / 2) * kv_per_token
    roofline = bandwidth / step_bytes
    return {"benchmark": "decode_batch1", "shardserve_tok_s": round(tok_s, 1),
            "roofline_tok_s": round(roofline, 1), "fraction_of_roofline": round(tok_s / roofline, 3),
            "settings": {"prompt_len": prompt_len, "output_len": output_len, "enforce_eager": enforce_eager,
                         "cuda_graphs": llm.engine.executor.worker.cuda_graphs is not None,
                         "weight_bytes": weight_bytes, "bandwidth_bytes_per_s": round(bandwidth)}}


def offline(folder: Path, device: str, num_prompts: int, input_len: int, output_len: int,
            skip_hf: bool) -> dict:
    args = argparse.Namespace(dtype="auto", device=device, input_len=input_len,
                              output_len=output_len, max_num_seqs=256,
                              max_num_batched_tokens=None, kv_cache_memory_bytes=None,
                              gpu_memory_utilization=0.9, seed=0, hf_batch_size=None,
                              tensor_parallel_size=1, pipeline_parallel_size=1,
                              distributed_executor_backend=None, enforce_eager=False)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    prompts = throughput.random_prompts(vocab, num_prompts, input_len, 0)
    ours = throughput.bench_runtime(args, str(folder), prompts)
    torch.cuda.empty_cache() if device == "cuda" else None
    hf = None if skip_hf else hf_generate_batch(folder, device, prompts, output_len)
    return {"benchmark": "offline_throughput",
            "shardserve_tok_s": ours["output_tokens_per_s"],
            "hf_tok_s": hf["output_tokens_per_s"] if hf else None,
            "ratio": round(ours["output_tokens_per_s"] / hf["output_tokens_per_s"], 2)
            if hf else None,
            "settings": {"num_prompts": num_prompts, "input_len": input_len,
                         "output_len": output_len, "shardserve": ours, "hf": hf}}


def hf_generate_batch(folder: Path, device: str, prompts: list[list[int]],
                      output_len: int) -> dict:
    """transformers' continuous batching (`generate_batch`, paged|sdpa attention)."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype="auto", attn_implementation="paged|sdpa").to(device).eval()
    config = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len,
                              do_sample=False, eos_token_id=-1, pad_token_id=0)
    with torch.no_grad():
        model.generate_batch(prompts[:2], generation_config=config, max_new_tokens=4)
        throughput._synchronize(device)
        start = time.perf_counter()
        outputs = model.generate_batch(prompts, generation_config=config)
        throughput._synchronize(device)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.generated_tokens) for o in outputs.values())
    del model
    return throughput._result(elapsed, prompts, num_out)


def append_results(records: list[dict], path: Path) -> None:
    existing = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps(existing + records, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny shapes, few prompts")
    parser.add_argument("--workdir", default=os.environ.get("TMPDIR", "/tmp") + "/shardserve-bench")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--results", default=str(RESULTS_JSON))
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    bandwidth = measure_bandwidth(args.device, (64 << 20) if args.small else (4 << 30))
    base = {"date": datetime.date.today().isoformat(), "device": device_name(args.device),
            "versions": versions()}
    records = []
    shapes = [(1000, 128, 128), (1000, 1024, 128)] if not args.small else [(8, 32, 16)]
    for shape in args.models:
        folder = make_checkpoint(shape, workdir, args.small, args.device)
        for enforce_eager in (True, False) if args.device == "cuda" else (True,):  # eager, then graphs
            decode = decode_batch1(folder, args.device, bandwidth, 32 if args.small else 128,
                                   16 if args.small else 256, enforce_eager)
            records.append(base | {"model": shape} | decode)
            print(json.dumps(records[-1]), flush=True)
        for num, inp, out in shapes:
            records.append(base | {"model": shape} | offline(folder, args.device, num, inp, out,
                                                             args.skip_hf))
            print(json.dumps(records[-1]), flush=True)
    append_results(records, Path(args.results))


if __name__ == "__main__":
    main()
