"""The scheduler's settings, in a module of their own: the scheduler imports no torch, so `plan --trace` replays
traffic through it (runtime/core/replay.py) in a process that never loads torch."""

from __future__ import annotations

from dataclasses import dataclass

from shardserve.planner.speculative import SpeculativeConfig


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    async_scheduling: bool = False  # schedule step N+1 before step N's tokens are back
    enable_chunked_prefill: bool = True  # always: a prompt beyond the token budget is prefilled over steps
    speculative: SpeculativeConfig | None = None  # speculative_config: drafts verified in one forward
