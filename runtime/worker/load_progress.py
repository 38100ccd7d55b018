"""Weight loading progress on rank 0: a rich bar by shard and bytes on a terminal, else periodic log lines."""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable

logger = logging.getLogger(__name__)

LOG_EVERY_FRACTION = 0.1  # without a terminal: a line each 10% of the bytes ...
LOG_EVERY_SECONDS = 5.0  # ... or each 5 s, whichever comes first


class LoadProgress:
    """Counts checkpoint bytes as tensors are read, file (shard) by file. Shown on a terminal as a rich
    bar, otherwise as log lines; hidden (`is_shown` False) on every rank but rank 0. The total time is
    logged at the end either way: "loaded 16.1 GB in 42.3 s"."""

    def __init__(self, file_sizes: list[int], is_shown: bool, is_terminal: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.file_sizes, self.is_shown, self.clock = file_sizes, is_shown, clock
        self.total_bytes = sum(file_sizes)
        self.num_done = 0  # bytes read
        self.file_index = -1
        self._bar = _RichBar(self.total_bytes, len(file_sizes)) if is_shown and is_terminal else None
        self._start = self._last_log = clock()
        self._last_logged_bytes = 0

    def start_file(self, index: int) -> None:
        """Shard `index` is next; the previous one is done (its header counted too)."""
        self.num_done = sum(self.file_sizes[:index])
        self.file_index = index
        self._show()

    def advance(self, num_bytes: int) -> None:
        self.num_done = min(self.num_done + num_bytes, sum(self.file_sizes[:self.file_index + 1]))
        self._show()

    def finish(self) -> float:
        """Close the bar and log the total; returns the seconds it took."""
        self.num_done = self.total_bytes
        seconds = self.clock() - self._start
        if self._bar is not None:
            self._bar.update(self.num_done, len(self.file_sizes))
            self._bar.close()
        if self.is_shown:
            logger.info("loaded %.1f GB in %.1f s", self.total_bytes / 1e9, seconds)
        return seconds

    def abort(self) -> None:
        """Loading failed: take the bar off the terminal, log nothing."""
        if self._bar is not None:
            self._bar.close()

    def _show(self) -> None:
        if not self.is_shown:
            return
        if self._bar is not None:
            self._bar.update(self.num_done, self.file_index + 1)
            return
        now = self.clock()
        step = LOG_EVERY_FRACTION * self.total_bytes
        if self.num_done - self._last_logged_bytes >= step or now - self._last_log >= LOG_EVERY_SECONDS:
            logger.info("loading weights: %d%% (%.1f of %.1f GB, shard %d of %d)",
                        100 * self.num_done // max(self.total_bytes, 1), self.num_done / 1e9,
                        self.total_bytes / 1e9, self.file_index + 1, len(self.file_sizes))
            self._last_log, self._last_logged_bytes = now, self.num_done


class _RichBar:
    """rich's progress bar on stderr: bytes, speed, and the shard being read."""

    def __init__(self, total_bytes: int, num_files: int) -> None:
        from rich.console import Console
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TransferSpeedColumn)

        self.num_files = num_files
        self.progress = Progress(TextColumn("loading weights"), BarColumn(), DownloadColumn(),
                                 TransferSpeedColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                 console=Console(stderr=True))
        self.task = self.progress.add_task("", total=total_bytes)
        self.progress.start()

    def update(self, num_done: int, file_number: int) -> None:
        self.progress.update(self.task, completed=num_done, description=f"shard {file_number}/{self.num_files}")

    def close(self) -> None:
        self.progress.stop()


def is_terminal() -> bool:
    return sys.stderr.isatty()
