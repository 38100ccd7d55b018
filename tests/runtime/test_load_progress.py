"""Weight loading progress: log lines every 10% or 5 s without a terminal, the total at the end, only
on rank 0; a real sharded checkpoint reports every shard."""

from __future__ import annotations

import logging

import pytest

from shardserve.runtime import LLM
from shardserve.runtime.worker.load_progress import LoadProgress

LOGGER = "shardserve.runtime.worker.load_progress"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_log_lines_every_tenth_or_five_seconds_then_the_total(caplog):
    clock = FakeClock()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        progress = LoadProgress([4 * 10**9, 6 * 10**9], is_shown=True, is_terminal=False, clock=clock)
        progress.start_file(0)
        for _ in range(40):  # 4 GB in 0.1 GB tensors: a line per GB
            progress.advance(10**8)
        progress.start_file(1)
        progress.advance(10**8)  # 4.1 GB: not a tenth since the last line, and no time passed
        clock.now += 5.0
        progress.advance(10**8)  # 4.2 GB: 5 s since the last line
        clock.now += 37.3
        assert progress.finish() == pytest.approx(42.3)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:4] == [f"loading weights: {p}% ({p / 10:.1f} of 10.0 GB, shard 1 of 2)" for p in (10, 20, 30, 40)]
    assert lines[4:] == ["loading weights: 42% (4.2 of 10.0 GB, shard 2 of 2)", "loaded 10.0 GB in 42.3 s"]


def test_other_ranks_show_nothing(caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        progress = LoadProgress([10**9], is_shown=False, is_terminal=True)
        progress.start_file(0)
        progress.advance(10**9)
        progress.finish()
    assert caplog.records == []


def test_a_sharded_checkpoint_reports_each_shard_and_the_total(checkpoint_factory, kv_bytes_for, caplog):
    folder, _ = checkpoint_factory("llama3", max_shard_size="60KB")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        LLM(folder, device="cpu", kv_cache_memory_bytes=kv_bytes_for(folder, 40, 16)).shutdown()
    lines = [r.getMessage() for r in caplog.records]
    shards = {line.rsplit("shard ", 1)[1].rstrip(")") for line in lines if line.startswith("loading weights")}
    assert len(shards) > 2 and f"{len(shards)} of {len(shards)}" in shards
    assert lines[-1].startswith("loaded ") and lines[-1].endswith(" s")
