"""Offline throughput of the bundled runtime beside transformers' generate (`vllm bench throughput`).

    python bench/throughput.py --model PATH --num-prompts 64 --input-len 128 --output-len 128
    python bench/throughput.py --tiny-random llama --num-prompts 32   # no checkpoint needed (CPU smoke run)
    python bench/throughput.py --model PATH --tensor-parallel-size 2 --pipeline-parallel-size 2

Random token prompts, ignore_eos, prefix caching off; both engines get the same checkpoint and prompts
in the same run. Prints requests/s, output tokens/s and total tokens/s, and our/transformers ratios.
On a CPU shared with other work pass --threads 1: small ops in contended OpenMP threads slow both
engines several-fold and make the comparison noise.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="local folder with config.json and safetensors")
    source.add_argument("--tiny-random", choices=["llama", "qwen3", "gpt2"],
                        help="build a small random checkpoint in a temporary folder")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    from shardserve.planner.settings import BY_NAME  # the one table of defaults

    parser.add_argument("--dtype", default=BY_NAME["dtype"].default)
    parser.add_argument("--device", default=BY_NAME["device"].default)
    parser.add_argument("--max-num-seqs", type=int, default=BY_NAME["max_num_seqs"].default)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=BY_NAME["gpu_memory_utilization"].default)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    parser.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default=None)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    parser.add_argument("--async-scheduling", action="store_true", help="overlap the host with the device")
    parser.add_argument("--hf-batch-size", type=int, default=None, help="transformers batch size (default: all)")
    parser.add_argument("--skip-hf", action="store_true", help="measure the runtime only")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    return parser.parse_args()


def make_tiny_random(family: str, folder: str) -> None:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    if family == "gpt2":
        config = tf.GPT2Config(n_embd=256, n_layer=4, n_head=8, n_positions=2048, vocab_size=8192)
    else:
        cls = tf.LlamaConfig if family == "llama" else tf.Qwen3Config
        config = cls(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=4, max_position_embeddings=2048, vocab_size=8192)
    tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)


def random_prompts(vocab_size: int, num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    low = min(100, vocab_size // 4)  # stay clear of the special ids at the start of most vocabularies
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(num)]


def bench_runtime(args, folder: str, prompts: list[list[int]]) -> dict:
    from shardserve.runtime import LLM, SamplingParams

    llm = LLM(folder, dtype=args.dtype, device=args.device, max_model_len=args.input_len + args.output_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes, gpu_memory_utilization=args.gpu_memory_utilization,
              enable_prefix_caching=False, seed=args.seed, skip_tokenizer_init=True,
              tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
              distributed_executor_backend=args.distributed_executor_backend, enforce_eager=args.enforce_eager,
              async_scheduling=args.async_scheduling, load_format=getattr(args, "load_format", "auto"))
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.output_len, ignore_eos=True)
    with llm:
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=4, ignore_eos=True))
        _synchronize(llm.engine.config.device)  # the workers' steps end before their results come back
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        _synchronize(llm.engine.config.device)
        elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    info = llm.kv_cache_info
    # the KV budget's inputs on CUDA, where the worker is in this process (one rank)
    memory_profile = getattr(getattr(llm.engine.executor, "worker", None), "memory_profile", None)
    return _result(elapsed, prompts, num_out) | {"kv_cache_tokens": info.num_tokens,
                                                 "max_concurrency": round(info.max_concurrency, 2),
                                                 "device": llm.engine.config.device,
                                                 "tensor_parallel_size": args.tensor_parallel_size,
                                                 "pipeline_parallel_size": args.pipeline_parallel_size,
                                                 "enforce_eager": args.enforce_eager,
                                                 "async_scheduling": args.async_scheduling,
                                                 "preemptions": llm.engine.scheduler.num_preemptions,
                                                 "memory_profile": memory_profile}


def bench_transformers(args, folder: str, prompts: list[list[int]], device: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    batch_size = args.hf_batch_size or len(prompts)
    kwargs = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=True,
                  top_k=0, top_p=1.0, temperature=1.0, pad_token_id=0)
    with torch.no_grad():
        warm = torch.tensor(prompts[:2], device=device)
        model.generate(warm, attention_mask=torch.ones_like(warm), **(kwargs | {"max_new_tokens": 4,
                                                                                  "min_new_tokens": 4}))
        _synchronize(device)
        start = time.perf_counter()
        num_out = 0
        for i in range(0, len(prompts), batch_size):
            ids = torch.tensor(prompts[i:i + batch_size], device=device)  # equal lengths: no padding
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            num_out += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        _synchronize(device)
    return _result(time.perf_counter() - start, prompts, num_out)


def _synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _result(elapsed: float, prompts: list[list[int]], num_out: int) -> dict:
    num_in = sum(len(p) for p in prompts)
    return {"elapsed_s": round(elapsed, 3), "requests_per_s": round(len(prompts) / elapsed, 3),
            "output_tokens_per_s": round(num_out / elapsed, 1),
            "total_tokens_per_s": round((num_in + num_out) / elapsed, 1), "output_tokens": num_out}


def main() -> None:
    args = parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model
        if args.tiny_random:
            folder = tmp
            make_tiny_random(args.tiny_random, folder)
        from transformers import AutoConfig

        prompts = random_prompts(AutoConfig.from_pretrained(folder).vocab_size, args.num_prompts, args.input_len,
                                 args.seed)
        ours = bench_runtime(args, folder, prompts)
        report = {"model": args.model or f"tiny-random-{args.tiny_random}", "num_prompts": args.num_prompts,
                  "input_len": args.input_len, "output_len": args.output_len, "shardserve": ours}
        if not args.skip_hf:
            theirs = bench_transformers(args, folder, prompts, ours["device"])
            report["transformers"] = theirs
            report["ratio_output_tokens_per_s"] = round(ours["output_tokens_per_s"] / theirs["output_tokens_per_s"], 2)
            report["ratio_total_tokens_per_s"] = round(ours["total_tokens_per_s"] / theirs["total_tokens_per_s"], 2)
    print_report(report)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)


def print_report(report: dict) -> None:
    print(f"model {report['model']}: {report['num_prompts']} prompts x ({report['input_len']} in, "
          f"{report['output_len']} out)")
    print(f"{'engine':<14}{'elapsed s':>11}{'req/s':>10}{'out tok/s':>12}{'total tok/s':>14}")
    for name in ("shardserve", "transformers"):
        if name in report:
            r = report[name]
            print(f"{name:<14}{r['elapsed_s']:>11.2f}{r['requests_per_s']:>10.2f}{r['output_tokens_per_s']:>12.1f}"
                  f"{r['total_tokens_per_s']:>14.1f}")
    if "ratio_output_tokens_per_s" in report:
        print(f"ratio shardserve / transformers: output {report['ratio_output_tokens_per_s']:.2f}x, "
              f"total {report['ratio_total_tokens_per_s']:.2f}x")
    ours = report["shardserve"]
    print(f"KV cache: {ours['kv_cache_tokens']} tokens, max concurrency {ours['max_concurrency']}x, "
          f"preemptions {ours['preemptions']}")


if __name__ == "__main__":
    main()
