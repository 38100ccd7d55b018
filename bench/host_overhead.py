"""Host work per decode step at batch 1, 64 and 256 on a micro model, split by phase.

    python bench/host_overhead.py                       # CPU: a 1-layer, 64-wide Llama (forward ~ free)
    python bench/host_overhead.py --batches 256 --steps 64 --output-json out.json

The engine runs as is; each phase is timed by wrapping the method that does it (the wrappers add
~1 us a call). Phases: schedule (Scheduler.schedule), inputs (numpy arrays of the step and their
copy to the device), forward (the model, logits included), sampling, update (the scheduler's
bookkeeping), output (OutputProcessor.process: stop checks, deltas) of which detokenize is the
incremental detokenizer's share. host_ms is the step less forward and sampling (both run on the
device on a GPU): the host's loop per step. Without --async-scheduling a GPU waits for all of it
every step; with it, step N+1 is queued before the host reads step N, so a GPU waits only for
what of the loop exceeds its own step time, max(0, host_ms - device step). The goal is under 2 ms
a step at batch 256.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import throughput  # noqa: E402  (bench/throughput.py: random prompts)

PHASES = ("schedule", "inputs", "forward", "sampling", "update", "output", "detokenize")


def make_micro_model(folder: str) -> None:
    """A Llama of one layer, hidden 64, vocab 32k with a word-per-id tokenizer: the forward costs
    almost nothing, so what remains of a step is host work."""
    import gpu_bench
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, max_position_embeddings=4096, vocab_size=32000)
    tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    gpu_bench.save_word_tokenizer(Path(folder), config.vocab_size)


class PhaseTimer:
    """Wraps methods so that each call adds its wall time to a phase."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.enabled = False

    def wrap(self, owner, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.enabled:
                    self.seconds[phase] += time.perf_counter() - start

        setattr(owner, name, timed)


def instrument(llm, timer: PhaseTimer) -> None:
    import shardserve.runtime.worker as worker_module
    from shardserve.runtime import detokenizer

    engine, worker = llm.engine, llm.engine.executor.worker
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(worker_module, "build_host_inputs", "inputs")
    timer.wrap(worker_module, "to_device", "inputs")
    timer.wrap(worker.model, "forward", "forward")
    timer.wrap(worker.model, "compute_logits", "forward")
    # sampling: the device draw (this tree's worker) or draw and read-back together (a baseline's)
    timer.wrap(worker_module, "sample_on_device" if hasattr(worker_module, "sample_on_device") else "sample",
               "sampling")
    timer.wrap(engine.scheduler, "update_from_output", "update")
    timer.wrap(engine.output_processor, "process", "output")
    for name in ("IncrementalDetokenizer", "StreamDetokenizer"):  # (a baseline checkout may lack one)
        if hasattr(detokenizer, name):
            timer.wrap(getattr(detokenizer, name), "push", "detokenize")


def measure(folder: str, batch: int, steps: int, prompt_len: int, top_p: float, is_async: bool) -> dict:
    from shardserve.runtime import LLM, SamplingParams

    overlap = {"async_scheduling": True} if is_async else {}  # (a baseline without the setting runs without it)
    llm = LLM(folder, device="cpu", max_num_seqs=batch, max_model_len=prompt_len + steps + 8,
              kv_cache_memory_bytes=batch * (prompt_len + steps + 16) * 1024, enable_prefix_caching=False, **overlap)
    timer = PhaseTimer()
    instrument(llm, timer)
    engine = llm.engine
    params = SamplingParams(temperature=0.8, top_p=top_p, max_tokens=steps, ignore_eos=True, seed=1)
    for i, prompt in enumerate(throughput.random_prompts(engine.config.model.vocab_size, batch, prompt_len, 0)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while engine.scheduler.waiting:  # prefill everything first: the timed steps are decode steps
        engine.step()
    num_steps, start = 0, time.perf_counter()
    timer.enabled = True
    while engine.has_unfinished_requests():
        engine.step()
        num_steps += 1
    elapsed = time.perf_counter() - start
    llm.shutdown()
    per_step = {phase: round(timer.seconds[phase] / num_steps * 1e3, 3) for phase in PHASES}
    host = elapsed / num_steps * 1e3 - per_step["forward"] - per_step["sampling"]
    return {"batch": batch, "top_p": top_p, "async_scheduling": is_async, "steps": num_steps, "step_ms": round(elapsed / num_steps * 1e3, 3),
            "host_ms": round(host, 3), "phases_ms": per_step}


def keep_large_tensors_on_the_heap() -> None:
    """NOTE: glibc serves a [256, 32k] float tensor by mmap and returns it by munmap, ~1-2 ms a
    step for the logits and the sampler's temporaries, paid wherever the last reference dies (in
    the worker, after sampling: it read as host work). A GPU's caching allocator frees in
    microseconds, so big blocks are kept on the heap here, as a device would keep them."""
    import ctypes
    import ctypes.util
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if hasattr(libc, "mallopt"):
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 1 << 30)
        libc.mallopt(m_trim_threshold, (1 << 31) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0: no row needs the top-p sort")
    parser.add_argument("--async-scheduling", action="store_true", help="overlap the host with the device")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    keep_large_tensors_on_the_heap()
    import torch
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        make_micro_model(folder)
        results = [measure(folder, batch, args.steps, args.prompt_len, args.top_p, args.async_scheduling)
                   for batch in args.batches]
    print(f"{'batch':>6} {'step ms':>8} {'host ms':>8} " + " ".join(f"{p:>10}" for p in PHASES))
    for r in results:
        print(f"{r['batch']:>6} {r['step_ms']:>8} {r['host_ms']:>8} "
              + " ".join(f"{r['phases_ms'][p]:>10}" for p in PHASES))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
