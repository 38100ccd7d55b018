"""Where a step's updates become deltas: in the step loop itself, or (async scheduling) on a thread beside it.

Both stages take the same calls from the engine, so its loops never ask which one runs:

    add_prompt / abort(prompt_id) -> the prompt's request ids / in_use(prompt_id)
    process(updates) -> (deltas, request ids a stop string ended)    (the thread's: earlier steps' results)
    before_wait()       the step loop is about to wait on the device: the thread's turn
    take(wait) -> (deltas, stopped)    what is ready now, or (wait) everything still to come
    busy                updates handed over (or held) whose results were not taken yet"""

from __future__ import annotations

import queue
import threading

from shardserve.runtime.core.messages import RequestUpdate
from shardserve.runtime.core.output_processor import OutputProcessor
from shardserve.runtime.outputs import PromptDelta
from shardserve.runtime.sampling_params import SamplingParams

Results = tuple[list[PromptDelta], list[str]]  # deltas, and the requests a stop string ended


class InlineOutputs:
    """Output processing inside the step loop: a step's deltas come back from the same step."""

    def __init__(self, output_processor: OutputProcessor):
        self.output_processor = output_processor

    @property
    def busy(self) -> bool:
        return False

    def in_use(self, prompt_id: str) -> bool:
        return self.output_processor.has_prompt(prompt_id)

    def add_prompt(self, prompt_id: str, params: SamplingParams, request_ids: list[str]) -> None:
        self.output_processor.add_prompt(prompt_id, params, request_ids)

    def abort(self, prompt_id: str) -> list[str]:
        request_ids = self.output_processor.request_ids(prompt_id)
        self.output_processor.abort(prompt_id)
        return request_ids

    def process(self, updates: list[RequestUpdate]) -> Results:
        return self.output_processor.process(updates)

    def before_wait(self) -> None:
        pass

    def take(self, wait: bool) -> Results:
        return [], []

    def stop(self) -> None:
        pass


class ThreadedOutputs(InlineOutputs):
    """With async scheduling a step's updates are held until the step loop next waits on the device, then
    processed on a thread; the deltas, and the requests a stop string ended, come back on a later call:

        step loop:  update N | schedule N+2, submit | before_wait (N), wait for N+1 | update N+1 (takes N) ...
        this thread:                                | process N                      |

    NOTE: a thread shares the GIL with the step loop: its work is free only while the loop waits
    without the GIL (on a GPU, for the device's step; on a CPU, inside torch's kernels). Handed
    over at once, it took the GIL at the torch calls that build the next step, delaying its launch;
    on a CPU, where the step is done when collected, it still contends with the loop (bench/RESULTS.md).
    An aborted prompt's id stays in use until its earlier outputs are all taken (they would reach a new
    prompt of that id). The engine's calls into the output processor take `lock`, as the thread does."""

    def __init__(self, output_processor: OutputProcessor):
        super().__init__(output_processor)
        self.lock = threading.Lock()
        self._held: list[RequestUpdate] | None = None  # the last step's updates, not handed over yet
        self._draining: set[str] = set()  # aborted prompts whose earlier outputs are not all taken yet
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._num_pending = 0  # batches handed over whose results were not taken yet
        self._thread = threading.Thread(target=self._run, name="shardserve-output", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._held is not None or self._num_pending > 0

    def in_use(self, prompt_id: str) -> bool:
        with self.lock:
            return self.output_processor.has_prompt(prompt_id) or prompt_id in self._draining

    def add_prompt(self, prompt_id: str, params: SamplingParams, request_ids: list[str]) -> None:
        with self.lock:
            super().add_prompt(prompt_id, params, request_ids)

    def abort(self, prompt_id: str) -> list[str]:
        with self.lock:
            request_ids = super().abort(prompt_id)
        if self.busy:
            self._draining.add(prompt_id)  # its last outputs are still on the way
        return request_ids

    def process(self, updates: list[RequestUpdate]) -> Results:
        self._held = updates
        return self.take(wait=False)

    def before_wait(self) -> None:
        if self._held is not None:
            self._num_pending += 1
            self._todo.put(self._held)
            self._held = None

    def take(self, wait: bool) -> Results:
        """An error in the thread is raised here."""
        if wait:
            self.before_wait()
        deltas: list[PromptDelta] = []
        stopped: list[str] = []
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
        if self._draining and not self.busy:
            self._draining.clear()
        return deltas, stopped

    def stop(self) -> None:
        self._todo.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (updates := self._todo.get()) is not None:
            result: Results | BaseException
            try:
                with self.lock:
                    result = self.output_processor.process(updates)
            except BaseException as error:  # handed to the step loop, which raises it
                result = error
            self._done.put(result)
