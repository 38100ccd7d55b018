"""Times the tensor-parallel all-reduce over this machine's ranks (each `python -m` this module).

    python -m shardserve.runtime.timing.allreduce_timing RANK WORLD_SIZE PORT DEVICE DTYPE OUT PARENT_PID BYTES...

Each rank joins the caller's rendezvous as the runtime's ranks do (distributed.init_distributed:
NCCL on GPUs, gloo on CPUs; the store's secret comes in SHARDSERVE_RENDEZVOUS_SECRET, never on the
command line), then all-reduces a tensor of each size through
parallel_state.tensor_parallel_all_reduce; rank 0 writes {bytes: milliseconds} to OUT as JSON.
A size's time is the median of a few repeats after a warm-up, each repeat a barrier then `calls`
all-reduces back to back (CUDA events on a GPU, the wall clock on a CPU)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

TIMEOUT_SECONDS = 300
REPEATS = 5
MODULE = "shardserve.runtime.timing.allreduce_timing"
SECRET_ENV = "SHARDSERVE_RENDEZVOUS_SECRET"  # the environment is the owner's alone; argv is anyone's (ps)


def time_allreduce(num_ranks: int, sizes: list[int], device: torch.device, dtype: torch.dtype) -> dict[int, float]:
    """{bytes: milliseconds} of an all-reduce over num_ranks local ranks (GPUs 0..num_ranks-1)."""
    from shardserve.runtime.distributed.process_group import start_rendezvous
    from shardserve.runtime.distributed.child_process import SAFE_PATH, stop_process

    store, rendezvous = start_rendezvous("127.0.0.1", num_ranks)
    with tempfile.TemporaryDirectory(prefix="shardserve-allreduce-") as folder:
        out = Path(folder) / "times.json"
        logs = [Path(folder) / f"rank{r}.log" for r in range(num_ranks)]
        processes = [subprocess.Popen(
            [sys.executable, *SAFE_PATH, "-m", MODULE, str(rank), str(num_ranks), str(rendezvous.port),
             device.type, str(dtype).removeprefix("torch."), str(out), str(os.getpid()), *map(str, sizes)],
            stdin=subprocess.DEVNULL, stdout=log.open("w"), stderr=subprocess.STDOUT,
            env={**os.environ, SECRET_ENV: rendezvous.secret}) for rank, log in enumerate(logs)]
        try:
            _wait(processes, logs)
        finally:
            for process in processes:
                stop_process(process, 0.0)
        del store
        return {int(k): v for k, v in json.loads(out.read_text()).items()}


def _wait(processes: list[subprocess.Popen], logs: list[Path]) -> None:
    deadline = time.monotonic() + TIMEOUT_SECONDS
    while any(p.poll() is None for p in processes):
        failed = [r for r, p in enumerate(processes) if p.poll() not in (None, 0)]
        if failed:
            raise RuntimeError(f"all-reduce timing: rank {failed[0]} exited with {processes[failed[0]].returncode}:\n"
                               + logs[failed[0]].read_text(errors="replace")[-2000:])
        if time.monotonic() > deadline:
            raise TimeoutError(f"all-reduce timing over {len(processes)} ranks did not finish in {TIMEOUT_SECONDS} s")
        time.sleep(0.1)
    failed = [r for r, p in enumerate(processes) if p.returncode != 0]
    if failed:
        raise RuntimeError(f"all-reduce timing: rank {failed[0]} exited with {processes[failed[0]].returncode}:\n"
                           + logs[failed[0]].read_text(errors="replace")[-2000:])


def _time_one(x: torch.Tensor, device: torch.device) -> float:
    """Milliseconds of one all-reduce of x, the median of REPEATS after a warm-up."""
    import torch.distributed as dist

    from shardserve.runtime.distributed.parallel_state import tensor_parallel_all_reduce

    calls = 10 if x.numel() * x.element_size() <= (1 << 20) else 2
    for _ in range(2):
        tensor_parallel_all_reduce(x)
    samples = []
    for _ in range(REPEATS):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                tensor_parallel_all_reduce(x)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / calls)
        else:
            begin = time.perf_counter()
            for _ in range(calls):
                tensor_parallel_all_reduce(x)
            samples.append((time.perf_counter() - begin) * 1e3 / calls)
    return statistics.median(samples)


def run_rank(rank: int, world_size: int, port: int, device: torch.device, dtype: torch.dtype,
             sizes: list[int]) -> dict[int, float]:
    from shardserve.runtime.distributed.process_group import Rendezvous, destroy_distributed, init_distributed
    from shardserve.runtime.distributed.parallel_state import ParallelState

    if device.type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    rendezvous = Rendezvous("127.0.0.1", port, os.environ.pop(SECRET_ENV))
    init_distributed(ParallelState(tp_rank=rank, tp_size=world_size), rendezvous, device)
    try:
        times = {}
        for size in sizes:
            x = torch.ones(max(1, size // dtype.itemsize), dtype=dtype, device=device)
            times[size] = _time_one(x, device)
        return times
    finally:
        destroy_distributed()


def main() -> None:
    from shardserve.runtime.distributed.child_process import watch_parent

    rank, world_size, port = (int(a) for a in sys.argv[1:4])
    device, dtype, out = torch.device(sys.argv[4]), getattr(torch, sys.argv[5]), sys.argv[6]
    watch_parent(int(sys.argv[7]))
    times = run_rank(rank, world_size, port, device, dtype, [int(a) for a in sys.argv[8:]])
    if rank == 0:
        Path(out).write_text(json.dumps(times))


if __name__ == "__main__":
    main()
