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
import tempfile
from pathlib import Path

# the engine instrumented by phase lives in the runtime, where `shardserve calibrate` uses it too
from shardserve.runtime.timing.host_timing import PHASES, keep_large_tensors_on_the_heap, make_micro_model, measure


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
