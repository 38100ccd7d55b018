"""--record-trace FILE: the traffic a server serves, written as a trace `plan --trace` replays (planner/trace.py):
a JSON line per prompt once it finishes, `arrival_s` (when it reached a replica, from the first one's), `input_len`,
`output_len` (its first sample's tokens), and where the prefix cache served part of its prompt, `prefix_id` (a
digest of those tokens) and `prefix_len`. Never a prompt's text or token ids. A prompt that is aborted or fails is
not written: the trace is of what was served."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

from shardserve.planner.errors import PlanError
from shardserve.planner.trace import SPEC_COLUMNS


class TraceRecorder:
    def __init__(self, path: str):
        self.path = Path(path).expanduser()
        if self.path.exists() and self.path.stat().st_size > 0:
            raise PlanError(f"--record-trace {path}: the file exists; remove it or name another (a trace is "
                            "written from the server's start)")
        try:
            self._file = open(self.path, "w", encoding="utf-8", buffering=1)  # a line at a time
        except OSError as error:
            raise PlanError(f"--record-trace {path}: cannot write it ({error.strerror})") from None
        self._start: float | None = None

    def arrived(self) -> float:
        """The clock a prompt's arrival is read on (monotonic seconds)."""
        now = time.monotonic()
        if self._start is None:
            self._start = now
        return now

    def served(self, arrival: float, prompt_token_ids: Sequence[int], output_len: int,
               num_cached_tokens: int | None, spec_counts: tuple[int, int, int] | None = None) -> None:
        """A prompt that finished: its line (with speculative decoding, its first sample's verify steps, drafts and
        drafts kept, as vLLM's counters name them)."""
        row: dict = {"arrival_s": round(arrival - (self._start or arrival), 4), "input_len": len(prompt_token_ids),
                     "output_len": output_len}
        if num_cached_tokens:
            shared = b"".join(t.to_bytes(4, "little", signed=True) for t in prompt_token_ids[:num_cached_tokens])
            row.update(prefix_id=hashlib.blake2b(shared, digest_size=8).hexdigest(), prefix_len=num_cached_tokens)
        if spec_counts:
            row.update(zip(SPEC_COLUMNS, spec_counts))
        self._file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
