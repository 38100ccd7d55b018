"""Each tensor-parallel rank reads only its slices: its peak memory while loading stays near its own
shard, clearly below the whole checkpoint (on a model large enough to tell)."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest

CHECKPOINT_BYTES_MIN = 50 * 10**6


def rss_anon() -> int:
    """Anonymous resident bytes of this process. NOTE: not VmHWM: safetensors maps the file, and
    its page-cache pages (shared, evictable) would count as the process's own."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def load_rank(folder: str, tp_rank: int, tp_size: int, results) -> None:
    """One rank's loading, in a fresh process: (param bytes, peak anonymous growth while loading)."""
    import torch

    from shardserve.runtime.config import load_model_config
    from shardserve.runtime.worker.loader import load_model
    from shardserve.runtime.distributed.parallel_state import ParallelState, set_parallel_state

    torch.set_num_threads(1)
    config = load_model_config(folder)
    set_parallel_state(ParallelState(tp_rank=tp_rank, tp_size=tp_size))
    before, peak, done = rss_anon(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    model = load_model(config, torch.device("cpu"))
    done.set()
    sampler.join()
    peak[0] = max(peak[0], rss_anon())
    results.put((tp_rank, sum(p.numel() * p.element_size() for p in model.parameters()), peak[0] - before))


@pytest.fixture(scope="module")
def large_checkpoint(tmp_path_factory):
    import torch
    import transformers as tf

    folder = str(tmp_path_factory.mktemp("large_llama"))
    config = tf.LlamaConfig(vocab_size=320, hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
    tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_each_rank_peaks_near_its_own_shard(large_checkpoint):
    checkpoint_bytes = os.path.getsize(os.path.join(large_checkpoint, "model.safetensors"))
    assert checkpoint_bytes > CHECKPOINT_BYTES_MIN
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=load_rank, args=(large_checkpoint, rank, 2, results)) for rank in range(2)]
    for process in ranks:
        process.start()
    measured = sorted(results.get(timeout=120) for _ in ranks)
    for process in ranks:
        process.join()
    for rank, param_bytes, peak_growth in measured:
        assert abs(param_bytes - checkpoint_bytes / 2) < 0.02 * checkpoint_bytes, rank
        assert peak_growth >= 0.9 * param_bytes, "the probe missed the load"
        assert peak_growth < 0.6 * checkpoint_bytes, (rank, peak_growth, checkpoint_bytes)
