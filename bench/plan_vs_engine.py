"""The plan's decode step beside the engine's: what the speed model predicts for this runtime on this
device (from the calibration `plan` reads for it), and what the engine takes, batch by batch.

    shardserve calibrate --device cpu && python bench/plan_vs_engine.py                # the demo model
    python bench/plan_vs_engine.py --model /path/to/folder --device cuda --batches 1 16 64 --json
    bash bench/run_gpu.sh --part 8     # on a GPU: the Llama-3.1-8B shape, after part 7's calibration

Each batch of requests is prefilled first, then `--steps` decode steps are timed on the wall clock
(schedule, forward, sampling, update: the whole step, as the plan's cycle counts it) at a mean
context of prompt + steps / 2 tokens, the context the prediction is asked for. Greedy sampling.
"""

from __future__ import annotations

import argparse
import json
import time

from shardserve.planner import PlanOptions, load_model, make_plan, parse_declared
from shardserve.planner.replay import replica_of


def predicted_ms(model: str, hardware: str, options: PlanOptions, batches: list[int], context: int) -> dict:
    """The plan's cycle (ms between two tokens of a request) for each batch decoding over `context`."""
    info = load_model(model)
    replica = replica_of(make_plan(info, parse_declared(hardware), options).record(), info)
    return {"source": replica.source, **{b: replica.cycle_ms(b, (), context) for b in batches}}


def measured_ms(llm, batch: int, prompt_len: int, steps: int, vocab_size: int) -> float:
    """The engine's mean decode step (wall ms) with `batch` requests decoding."""
    from shardserve.runtime import SamplingParams
    from shardserve.runtime.timing.host_timing import random_prompts

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(vocab_size, batch, prompt_len, batch)):
        engine.add_request(f"{batch}-{i}", {"prompt_token_ids": prompt}, params)
    while engine.scheduler.waiting:  # prefill first: the timed steps are decode steps
        engine.step()
    num_steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        num_steps += 1
    return (time.perf_counter() - start) / num_steps * 1e3


def compare(folder: str, device: str, hardware: str, batches: list[int], prompt_len: int, steps: int,
            repeats: int, load_format: str = "auto") -> dict:
    """{"source": where the plan's operator times come from, "rows": per batch the measured and
    predicted decode step (ms) and their ratio}; each measurement the least of `repeats` runs."""
    from shardserve.runtime import LLM

    max_model_len, kv_bytes = prompt_len + steps + 16, 1 << 28
    on_cpu = {"kv_cache_memory_bytes": kv_bytes} if device == "cpu" else {}
    context = prompt_len + steps // 2
    plan = predicted_ms(folder, hardware, PlanOptions(max_model_len=max_model_len, max_num_seqs=max(batches),
                                                      **on_cpu), batches, context)
    llm = LLM(folder, device=device, max_model_len=max_model_len, max_num_seqs=max(batches),
              enable_prefix_caching=False, skip_tokenizer_init=True, load_format=load_format, **on_cpu)
    vocab, rows = llm.engine.config.model.vocab_size, []
    try:
        for b in batches:
            ms = min(measured_ms(llm, b, prompt_len, steps, vocab) for _ in range(repeats))
            rows.append({"batch": b, "context": context, "measured_ms": round(ms, 3),
                         "predicted_ms": round(plan[b], 3), "ratio": round(plan[b] / ms, 3)})
    finally:
        llm.shutdown()
    return {"source": plan["source"], "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model folder (default: the bundled demo model)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--hardware", default=None, help="declared hardware (default: cpu, or 1x<the GPU>)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="the least of this many runs per batch")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from shardserve.launch.calibrate import gpu_name
    from shardserve.launch.demo import DEMO_MODEL_DIR

    folder = args.model or str(DEMO_MODEL_DIR)
    hardware = args.hardware or ("cpu" if args.device == "cpu" else f"1x{gpu_name('cuda')[0]}")
    result = compare(folder, args.device, hardware, args.batches, args.prompt_len, args.steps, args.repeats)
    if args.json:
        print(json.dumps({"model": folder, "device": args.device, "hardware": hardware, **result}))
        return
    print(f"{folder} on {hardware}; predicted from {result['source']}")
    print(f"{'batch':>6} {'context':>8} {'measured ms':>12} {'predicted ms':>13} {'ratio':>6}")
    for r in result["rows"]:
        print(f"{r['batch']:>6} {r['context']:>8} {r['measured_ms']:>12.2f} {r['predicted_ms']:>13.2f} {r['ratio']:>6.2f}")


if __name__ == "__main__":
    main()
