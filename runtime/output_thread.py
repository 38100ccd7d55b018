"""Output processing (detokenization, stop strings, deltas) on a thread beside the step loop."""

from __future__ import annotations

import queue
import threading

from shardserve.runtime.messages import RequestUpdate
from shardserve.runtime.output_processor import OutputProcessor
from shardserve.runtime.outputs import PromptDelta


class OutputThread:
    """With async scheduling the step loop hands each step's updates here when it next waits on
    the device (engine.py holds them until then); the deltas, and the requests a stop string
    ended, come back on a later call:

        step loop:  update N | schedule N+2, submit | put N, wait for N+1 | update N+1, take (N) ...
        this thread:                                | process N           |

    NOTE: a thread shares the GIL with the step loop: its work is free only while the loop waits
    without the GIL (on a GPU, for the device's step; on a CPU, inside torch's kernels). Handed
    over at once, it took the GIL at the torch calls that build the next step, delaying its launch;
    on a CPU, where the step is done when collected, it still contends with the loop (bench/RESULTS.md).
    A process of its own would make it parallel. The engine's own calls into the
    output processor (add, abort) take `lock`, as process() does here."""

    def __init__(self, output_processor: OutputProcessor):
        self.output_processor = output_processor
        self.lock = threading.Lock()
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._num_pending = 0  # batches put whose results were not taken yet
        self._thread = threading.Thread(target=self._run, name="shardserve-output", daemon=True)
        self._thread.start()

    @property
    def is_busy(self) -> bool:
        return self._num_pending > 0

    def put(self, updates: list[RequestUpdate]) -> None:
        self._num_pending += 1
        self._todo.put(updates)

    def take(self, wait: bool) -> tuple[list[PromptDelta], list[str]]:
        """The results ready now, or (wait) every result still to come; an error in the thread is
        raised here."""
        deltas, stopped = [], []
        while self._num_pending:
            try:
                result = self._done.get(block=wait)
            except queue.Empty:
                break
            self._num_pending -= 1
            if isinstance(result, BaseException):
                raise result
            deltas.extend(result[0])
            stopped.extend(result[1])
        return deltas, stopped

    def stop(self) -> None:
        self._todo.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (updates := self._todo.get()) is not None:
            result: tuple[list[PromptDelta], list[str]] | BaseException
            try:
                with self.lock:
                    result = self.output_processor.process(updates)
            except BaseException as error:  # handed to the step loop, which raises it
                result = error
            self._done.put(result)
