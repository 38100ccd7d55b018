"""Host time per engine step: the engine run on a micro model whose forward costs almost nothing.

The engine runs as is; each phase is timed by wrapping the method that does it (~1 us a call).
Phases: schedule (Scheduler.schedule), inputs (numpy arrays of the step and their copy to the
device), forward (the model, logits included), sampling, update (the scheduler's bookkeeping),
output (OutputProcessor.process: stop checks, deltas) of which detokenize is the incremental
detokenizer's share. host_ms is the step less forward and sampling (both run on the device on a
GPU): the host's loop per step. bench/host_overhead.py prints the phases; `shardserve calibrate`
fits host_ms = step_ms + per_request_ms * batch for the planner."""

from __future__ import annotations

import random
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

PHASES = ("schedule", "inputs", "forward", "sampling", "update", "output", "detokenize")


def save_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """One word per id ("w0" ... "w{vocab_size - 1}"): any token a random model samples has text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0").save_pretrained(folder)


# The micro model's shape (a Llama): what calibrate times of its layer is launches and dispatch, not math
MICRO = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
         "vocab_size": 32000}
MICRO_HEAD_DIM = MICRO["hidden_size"] // MICRO["num_attention_heads"]
EAGER_REPEATS = 3


def make_micro_model(folder: str, num_layers: int = 1) -> None:
    """A Llama of `num_layers` layers, hidden 64, vocab 32k with a word-per-id tokenizer: the forward
    costs almost nothing, so what remains of a step is host work."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(hidden_size=MICRO["hidden_size"], intermediate_size=MICRO["intermediate_size"],
                            num_hidden_layers=num_layers, num_attention_heads=MICRO["num_attention_heads"],
                            num_key_value_heads=MICRO["num_key_value_heads"], max_position_embeddings=4096,
                            vocab_size=MICRO["vocab_size"])
    tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    save_word_tokenizer(Path(folder), config.vocab_size)


def random_prompts(vocab_size: int, num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    low = min(100, vocab_size // 4)  # stay clear of the special ids at the start of most vocabularies
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(num)]


class PhaseTimer:
    """Wraps methods so that each call adds its wall time to a phase; restore() unwraps them."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.enabled = False
        self._wrapped: list[tuple[object, str, object]] = []

    def wrap(self, owner, name: str, phase: str) -> None:
        inner = getattr(owner, name)
        self._wrapped.append((owner, name, owner.__dict__.get(name) if hasattr(owner, "__dict__") else None))

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.enabled:
                    self.seconds[phase] += time.perf_counter() - start

        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name, original in reversed(self._wrapped):
            if original is None:
                delattr(owner, name)  # an instance attribute over its class's method
            else:
                setattr(owner, name, original)
        self._wrapped.clear()


def instrument(llm, timer: PhaseTimer) -> None:
    import shardserve.runtime.worker.worker as worker_module
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
    timer.wrap(llm.output_processor, "process", "output")
    for name in ("IncrementalDetokenizer", "StreamDetokenizer"):  # (a baseline checkout may lack one)
        if hasattr(detokenizer, name):
            timer.wrap(getattr(detokenizer, name), "push", "detokenize")


def measure(folder: str, batch: int, steps: int, prompt_len: int, top_p: float = 1.0, is_async: bool = False,
            device: str = "cpu") -> dict:
    """Decode steps of `batch` requests (prefill done first), eagerly on a GPU: per-step times by phase."""
    from shardserve.runtime import LLM, SamplingParams

    extra = {"async_scheduling": True} if is_async else {}  # (a baseline without the setting runs without it)
    if device != "cpu":
        extra["enforce_eager"] = True
    llm = LLM(folder, device=device, max_num_seqs=batch, max_model_len=prompt_len + steps + 8,
              kv_cache_memory_bytes=batch * (prompt_len + steps + 16) * 1024, enable_prefix_caching=False, **extra)
    timer = PhaseTimer()
    instrument(llm, timer)
    try:
        engine = llm.engine
        params = SamplingParams(temperature=0.8, top_p=top_p, max_tokens=steps, ignore_eos=True, seed=1)
        for i, prompt in enumerate(random_prompts(engine.config.model.vocab_size, batch, prompt_len, 0)):
            llm.add_request(str(i), {"prompt_token_ids": prompt}, params)
        while engine.scheduler.waiting:  # prefill everything first: the timed steps are decode steps
            llm.step()
        num_steps, start = 0, time.perf_counter()
        timer.enabled = True
        while llm.has_unfinished_requests():
            llm.step()
            num_steps += 1
        elapsed = time.perf_counter() - start
    finally:
        timer.restore()
        llm.shutdown()
    per_step = {phase: round(timer.seconds[phase] / num_steps * 1e3, 3) for phase in PHASES}
    host = elapsed / num_steps * 1e3 - per_step["forward"] - per_step["sampling"]
    return {"batch": batch, "top_p": top_p, "async_scheduling": is_async, "steps": num_steps,
            "step_ms": round(elapsed / num_steps * 1e3, 3), "host_ms": round(host, 3), "phases_ms": per_step}


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


@dataclass(frozen=True)
class HostFit:
    """Host time per engine step = step_ms + per_request_ms * requests (the planner's HostModel)."""

    step_ms: float
    per_request_ms: float
    points: tuple[tuple[int, float], ...]  # (batch, host ms) measured

    def to_dict(self) -> dict:
        return {"step_ms": round(self.step_ms, 4), "per_request_ms": round(self.per_request_ms, 5)}


def fit_host(points: list[tuple[int, float]]) -> HostFit:
    """Least squares over (batch, host ms); neither coefficient below zero (noise at small batches)."""
    xs, ys = [float(b) for b, _ in points], [ms for _, ms in points]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var) if var else 0.0
    return HostFit(max(0.0, mean_y - slope * mean_x), slope, tuple(points))


def measure_host(batches: tuple[int, ...], steps: int, prompt_len: int = 32) -> HostFit:
    """Host ms per decode step at each batch size (one CPU thread, as a GPU server's host loop)."""
    import torch
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # the micro model's save
    keep_large_tensors_on_the_heap()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory(prefix="shardserve-host-") as folder:
            make_micro_model(folder)
            points = [(b, measure(folder, b, steps, prompt_len)["host_ms"]) for b in batches]
    finally:
        torch.set_num_threads(threads)
    return fit_host(points)


def measure_eager_layer(device: str, steps: int, prompt_len: int = 32) -> float:
    """Milliseconds one more decoder layer adds to an eager decode step's forward at batch 1: micro
    models of 1 and 3 layers, half the difference. On a GPU the forward returns once its kernels are
    queued, and a micro layer's kernels take microseconds: this is the host's time to issue a layer.
    On a CPU it is a layer's dispatch and (tiny) compute."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    forward: dict[int, list[float]] = {1: [], 3: []}
    with tempfile.TemporaryDirectory(prefix="shardserve-eager-") as root:
        for num_layers in forward:
            make_micro_model(f"{root}/{num_layers}", num_layers)
        for _ in range(EAGER_REPEATS):  # alternately; the least of each (other work on the machine only adds)
            for num_layers, times in forward.items():  # with the engine's threads: a CPU's dispatch depends on them
                times.append(measure(f"{root}/{num_layers}", 1, steps, prompt_len, device=device)["phases_ms"]["forward"])
    return max(0.0, (min(forward[3]) - min(forward[1])) / 2)
