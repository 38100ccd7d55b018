"""Continuous batching: choose which requests run each step under the token and request budgets."""

from __future__ import annotations

import time
from collections import deque

from shardserve.planner.kv_groups import max_pages_per_request
from shardserve.runtime.core.block_manager import BlockManager
from shardserve.runtime.core.scheduler_config import SchedulerConfig
from shardserve.runtime.core.lora_slots import LoRASlots
from shardserve.runtime.lora_request import LoRARequest
from shardserve.runtime.core.messages import (CachedRequestData, ModelRunnerOutput, NewRequestData, RequestUpdate,
                                         SchedulerOutput)
from shardserve.runtime.core.request import Request, RequestStatus, first_token_times, unsent_prompt_logprobs
from shardserve.runtime.core.spec_decode import SpecDecodeStats, propose


class Scheduler:
    """First come, first served. Each step first advances running requests (decode tokens or the
    next prefill chunk), then admits waiting ones while budget and blocks remain. When blocks run
    out, the newest running request is preempted: its blocks are freed and it is recomputed later.

    NOTE: one token-based loop covers prefill, chunked prefill and decode alike (each request just
    has num_tokens - num_computed_tokens left to compute), so there is no separate prefill phase.

    With pipeline parallelism several batches are in flight at once: a request scheduled in one is
    left out of the next until its output is back, and is never preempted meanwhile (its blocks are
    being written). Ranks run batches in order, so blocks freed by an abort are safe to reuse.

    With async_scheduling (one rank) step N+1 is scheduled while step N runs: a request in flight
    is scheduled again for the token step N samples (pending: the worker reads it on the device),
    and its real token and finish are learned one step late:

        schedule:  N   N+1  N+2 ...           a request that step N finished has its step N+1
        update:        N-1  N   N+1 ...       token dropped and its blocks freed at update(N)

    A request whose pending token is its last (max_tokens, max_model_len) is not scheduled again,
    and any request may be preempted: its blocks are reused only by steps that run after the one
    in flight, and its sampled token is dropped (recomputed, it samples the same: see sampler.py).
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 lora_slots: LoRASlots | None = None) -> None:
        self.config = config
        self.lora_slots = lora_slots  # enable_lora's: a batch holds at most that many adapters
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: set[str] = set()  # to tell the worker next step
        self.in_flight: set[str] = set()  # scheduled in a batch whose output is not back yet
        self.num_preemptions = 0
        self.last_step_tokens = 0  # the last update's tokens as vLLM counts an iteration (the engine's histogram)
        self.num_prefix_hit_tokens = 0  # prompt tokens served from the prefix cache
        self.num_prefix_query_tokens = 0  # prompt tokens looked up in it
        self.num_offload_hit_tokens = 0  # prompt tokens loaded from the CPU tier instead of computed
        self.num_offload_query_tokens = 0  # prompt tokens looked up there (past the GPU pool's hits)
        self.spec_stats = SpecDecodeStats()  # speculative decoding's drafts and acceptances

    def add_request(self, request: Request) -> None:
        self.check_can_ever_fit(request)
        if request.request_id in self.requests or request.request_id in self.in_flight:
            # (in flight after an abort: the step's token must not reach a new request of that id)
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check_can_ever_fit(self, request: Request) -> None:
        """Reject up front what this pool could never hold, rather than leave it waiting forever
        (the prompt itself was checked against max_model_len by the input processor)."""
        pool = self.block_manager
        needed = max_pages_per_request(pool.windows, request.max_total_tokens or self.max_model_len,
                                       pool.block_size, self.config.max_num_batched_tokens)
        if needed > pool.num_blocks:
            raise ValueError(f"request {request.request_id!r} needs {needed} KV blocks but the pool has "
                             f"{pool.num_blocks}; lower max_tokens or give the KV cache more memory")

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self, max_num_requests: int | None = None) -> SchedulerOutput:
        """`max_num_requests` caps this batch below max_num_seqs (to share requests among the
        batches in flight)."""
        limit = min(self.config.max_num_seqs, max_num_requests or self.config.max_num_seqs)
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        cached: list[CachedRequestData] = []
        drafts: dict[str, tuple[int, ...]] = {}  # request id -> the tokens drafted for it
        num_preemptions_before = self.num_preemptions
        budget = self._schedule_running(budget, limit, num_scheduled, cached, drafts)
        # NOTE: after a preemption nobody is admitted this step; the preempted request heads the
        # queue and admitting it now would only evict someone else.
        new = [] if self.num_preemptions > num_preemptions_before else self._admit_waiting(budget, num_scheduled,
                                                                                           limit)
        self.in_flight.update(num_scheduled)
        return self._finish_output(new, cached, num_scheduled, drafts)

    def _schedule_running(self, budget: int, limit: int, num_scheduled: dict[str, int],
                          cached: list[CachedRequestData], drafts: dict[str, tuple[int, ...]]) -> int:
        """Advance the running requests in order (decode tokens or the next prefill chunk); returns
        the budget left. NOTE: every running request passes here every step: the common path makes
        three calls per request (the in-flight check, allocate_slots, whose fast path is a token that
        fits in the last block, and the diff) and reads each count once."""
        running, allocate = self.running, self.block_manager.allocate_slots
        index = 0
        while index < len(running) and budget > 0 and len(num_scheduled) < limit:
            request = running[index]
            if not self._can_schedule_again(request):
                index += 1
                continue
            num_target = request.num_tokens + request.num_pending_tokens  # after the steps in flight
            proposed = self._propose(request, budget) if self.config.speculative is not None else ()
            num_target += len(proposed)
            num_new = min(num_target - request.num_computed_tokens, budget)
            if not allocate(request, request.num_computed_tokens + num_new) and \
                    not self._allocate_or_preempt(request, num_new):
                break  # it preempted itself: everything after it is gone too
            cached.append(self._cached_data(request))
            request.num_computed_tokens += num_new  # (_commit's rule, inline)
            if request.num_computed_tokens == num_target:
                request.num_pending_tokens += 1
            num_scheduled[request.request_id] = num_new
            if proposed:
                drafts[request.request_id] = proposed
            budget -= num_new
            index += 1
        return budget

    def _propose(self, request: Request, budget: int) -> tuple[int, ...]:
        """Drafts for a request decoding its next token (all it knows computed but the last): at most
        num_speculative_tokens, the budget less its own token, and what max_tokens and max_model_len leave after
        the token the step samples anyway; under a grammar, those it allows (none before its matcher is made)."""
        spec = self.config.speculative
        assert spec is not None  # the caller's check
        if (request.num_computed_tokens != request.num_tokens - 1 or request.num_pending_tokens
                or (request.sampling_params.structured_outputs is not None and request.grammar_matcher is None)):
            return ()
        max_tokens = request.sampling_params.max_tokens
        left = self.max_model_len - request.num_tokens if max_tokens is None else min(
            self.max_model_len - request.num_tokens, max_tokens - request.num_output_tokens)
        k = min(spec.num_speculative_tokens, budget - 1, left - 1)
        return propose(request, spec, k) if k > 0 else ()

    def _can_schedule_again(self, request: Request) -> bool:
        """Without async_scheduling: not while in flight. With it: unless its last token is pending."""
        if not self.config.async_scheduling:
            return request.request_id not in self.in_flight
        params, num_tokens = request.sampling_params, request.num_tokens + request.num_pending_tokens
        if params.max_tokens is not None and num_tokens - request.num_prompt_tokens >= params.max_tokens:
            return False  # the step in flight samples its last token
        return num_tokens < self.max_model_len

    def _commit(self, request: Request, num_new: int) -> None:
        """Count the step's tokens as computed; a step that reaches the end of the request samples."""
        request.num_computed_tokens += num_new
        if request.num_computed_tokens == request.num_tokens + request.num_pending_tokens:
            request.num_pending_tokens += 1

    def _allocate_or_preempt(self, request: Request, num_new: int) -> bool:
        """Allocate for `request`, preempting the newest running requests until it fits. Returns
        False if `request` itself had to be preempted."""
        total = request.num_computed_tokens + num_new
        while not self.block_manager.allocate_slots(request, total):
            # the newest request not in flight (any, with async_scheduling); `request` qualifies
            victim = next(r for r in reversed(self.running)
                          if self.config.async_scheduling or r.request_id not in self.in_flight)
            self.running.remove(victim)
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        self._release_lora(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_pending_tokens = 0  # a token still in flight is dropped when it lands
        request.num_synced_tokens = 0
        request.num_synced_blocks = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._finished_ids.add(request.request_id)  # the worker rebuilds it when it comes back
        self.waiting.appendleft(request)

    def _admit_waiting(self, budget: int, num_scheduled: dict[str, int], limit: int) -> list[NewRequestData]:
        new = []
        while (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
               and len(num_scheduled) < limit):
            request = self._next_waiting()
            if request is None:
                break  # every waiting request's adapter waits for a slot
            # NOTE: a request that scores or pools its whole prompt recomputes it all: cached positions
            # would go unscored (or unpooled)
            pool = self.block_manager
            hits = [] if request.needs_every_prompt_token else pool.find_cached_prefix(request)
            loads = [] if request.needs_every_prompt_token else pool.find_offloaded(request, len(hits))
            num_cached = (len(hits) + len(loads)) * pool.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not pool.allocate_slots(request, num_cached + num_new, hits, loads):
                break  # FCFS: nobody overtakes the head of the queue (but for a request waiting for a slot)
            self.waiting.remove(request)
            if request.lora is not None:
                assert self.lora_slots is not None  # the engine refuses adapters without enable_lora
                request.lora_slot = self.lora_slots.take(request.lora)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens is None:  # the first admission's (a preempted request comes back)
                request.num_cached_tokens = num_cached
            self._count_hits(request, len(hits), len(loads))
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.num_synced_tokens = request.num_tokens
            request.num_synced_blocks = len(self.block_manager.block_ids(request.request_id))
            self.running.append(request)
            new.append(self._new_data(request))
            self._commit(request, num_new)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
        return new

    def _count_hits(self, request: Request, num_hits: int, num_loads: int) -> None:
        """The prefix cache's counters, per tier, for an admitted request."""
        block_size = self.block_manager.block_size
        self.num_prefix_hit_tokens += num_hits * block_size
        self.num_prefix_query_tokens += request.num_tokens
        if self.block_manager.offload is not None:
            self.num_offload_hit_tokens += num_loads * block_size
            self.num_offload_query_tokens += request.num_tokens - num_hits * block_size

    def _new_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            request_id=request.request_id, token_ids=tuple(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens, sampling_params=request.sampling_params,
            seed=request.seed, stop_token_ids=request.stop_token_ids,
            block_ids=tuple(self.block_manager.block_ids(request.request_id)),
            num_computed_tokens=request.num_computed_tokens, pooling_params=request.pooling_params,
            lora_slot=request.lora_slot,
            group_block_ids=tuple(map(tuple, self.block_manager.group_block_ids(request.request_id))))

    def _cached_data(self, request: Request) -> CachedRequestData:
        num_tokens = request.num_tokens
        new_tokens = () if request.num_synced_tokens == num_tokens else \
            tuple(request.token_ids_slice(request.num_synced_tokens, num_tokens))
        request.num_synced_tokens = num_tokens
        blocks = self.block_manager.block_ids(request.request_id)
        # blocks only ever grow while running; a new one comes once per block_size tokens
        synced = request.num_synced_blocks
        if synced == len(blocks):
            return CachedRequestData(request.request_id, new_tokens, (), request.num_computed_tokens)
        request.num_synced_blocks = len(blocks)
        others = tuple(tuple(t[synced:]) for t in self.block_manager.group_block_ids(request.request_id))
        return CachedRequestData(request.request_id, new_tokens, tuple(blocks[synced:]), request.num_computed_tokens,
                                 others)

    def _finish_output(self, new, cached, num_scheduled, drafts) -> SchedulerOutput:
        transfers = tuple(self.block_manager.transfers)  # made only by allocations, which schedule tokens
        self.block_manager.transfers.clear()
        lora_loads = self._take_lora_loads()  # made only by admissions, which schedule tokens
        if not num_scheduled and self.in_flight:  # the engine sends no empty batch behind others:
            assert not transfers and not lora_loads, "KV copies or adapter loads in a batch that is not sent"
            return SchedulerOutput((), (), {}, frozenset())  # the finished ids wait for the next one
        finished = frozenset(self._finished_ids)
        self._finished_ids.clear()
        return SchedulerOutput(new_requests=tuple(new), cached_requests=tuple(cached),
                               num_scheduled_tokens=num_scheduled, finished_request_ids=finished,
                               kv_transfers=transfers, lora_loads=lora_loads, spec_token_ids=drafts)

    def _take_lora_loads(self) -> tuple:
        if self.lora_slots is None or not self.lora_slots.loads:
            return ()
        loads = tuple(self.lora_slots.loads)
        self.lora_slots.loads.clear()
        return loads

    def _next_waiting(self) -> Request | None:
        """The head of the queue, or with adapters the first waiting request whose adapter has a slot."""
        if self.lora_slots is None:
            return self.waiting[0]
        slots = self.lora_slots
        return next((r for r in self.waiting if r.lora is None or slots.can_take(r.lora)), None)

    def _release_lora(self, request: Request) -> None:
        if request.lora_slot >= 0:
            assert self.lora_slots is not None  # a slot was taken from it
            self.lora_slots.release(request.lora_slot)
            request.lora_slot = -1

    def update_from_output(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[RequestUpdate]:
        """Append the tokens the step sampled (its work was counted when it was scheduled), finish
        requests. A token for a request finished, aborted or preempted since is dropped."""
        updates = []
        self.in_flight.difference_update(output.num_scheduled_tokens)
        self.last_step_tokens = 0
        for request_id in output.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted (or preempted) while the step ran
            num_drafts = len(output.spec_token_ids.get(request_id, ()))
            if num_drafts:  # the rejected drafts' KV is left behind: it is overwritten
                accepted = len(runner_output.accepted_drafts.get(request_id, ()))
                request.num_computed_tokens -= num_drafts - accepted
                self.spec_stats.observe(num_drafts, accepted)
                steps, drafted, kept = request.spec_counts
                request.spec_counts = (steps + 1, drafted + num_drafts, kept + accepted)
            self.block_manager.cache_full_blocks(request)
            update = self._update_request(request, runner_output)
            if update is not None:
                updates.append(update)
                # vLLM's iteration tokens: each sampled token, and a whole prompt with its first one
                self.last_step_tokens += len(update.new_token_ids) + (request.num_prompt_tokens if update.times else 0)
        return updates

    def _update_request(self, request: Request, runner_output: ModelRunnerOutput) -> RequestUpdate | None:
        request_id = request.request_id
        scored = runner_output.prompt_logprobs.get(request_id) if runner_output.prompt_logprobs else None
        prompt_logprobs = () if scored is None else unsent_prompt_logprobs(request, scored)
        pooled = runner_output.pooled.get(request_id) if runner_output.pooled else None
        if pooled is not None:  # a pooling request's prompt is done: its vector is its one output
            request.num_pending_tokens -= 1
            self._finish(request, RequestStatus.FINISHED_STOPPED)
            return RequestUpdate(request_id, (), (), RequestStatus.FINISHED_STOPPED.value, pooled=pooled)
        token = runner_output.sampled_token_ids.get(request_id)
        if token is None:  # mid-prefill: nothing sampled yet
            return RequestUpdate(request_id, (), (), None, new_prompt_logprobs=prompt_logprobs) \
                if prompt_logprobs else None
        request.num_pending_tokens -= 1
        if request.sampling_params.max_tokens == 0:  # the prompt alone was asked for (its logprobs)
            self._finish(request, RequestStatus.FINISHED_LENGTH)
            return RequestUpdate(request_id, (), (), "length", new_prompt_logprobs=prompt_logprobs,
                                 num_cached_tokens=request.num_cached_tokens)
        drafts = runner_output.accepted_drafts.get(request_id, ())
        tokens, finish = (*drafts, token), None
        for num_appended, next_token in enumerate(tokens, 1):  # (one, but for accepted drafts)
            request.output_token_ids.append(next_token)
            finish = self._check_stop(request, next_token)
            if finish is not None:
                self._finish(request, finish)
                tokens = tokens[:num_appended]
                break
        logprobs = runner_output.logprobs.get(request_id) if runner_output.logprobs else None
        all_logprobs = () if logprobs is None else (*runner_output.draft_logprobs.get(request_id, ()), logprobs)
        is_first = len(request.output_token_ids) == 1
        times = first_token_times(request) if is_first else None
        return RequestUpdate(request_id, tokens, all_logprobs[:len(tokens)], finish.value if finish else None,
                             request.stop_reason, times, prompt_logprobs,
                             num_cached_tokens=request.num_cached_tokens if is_first else None,
                             spec_counts=request.spec_counts if finish and request.spec_counts[0] else None)

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens and token in request.stop_token_ids:
            if token in params.stop_token_ids:
                request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_requests(self, request_ids, status: RequestStatus) -> None:
        """End requests from outside (abort, or a stop string found by the detokenizer)."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and not request.status.is_finished:
                self._finish(request, status)

    def fail_adapter(self, lora: LoRARequest) -> list[str]:
        """Finish every unfinished request of an adapter its ranks could not load, and empty its slot; the
        ids of the requests (their tokens in batches still in flight are dropped as an abort's are)."""
        failed = [r.request_id for r in (*self.running, *self.waiting)
                  if r.lora is not None and r.lora.lora_int_id == lora.lora_int_id]
        self.finish_requests(failed, RequestStatus.FINISHED_ABORTED)
        if self.lora_slots is not None:
            self.lora_slots.empty(lora)
        return failed

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.block_manager.free(request)
        self._release_lora(request)
        self._finished_ids.add(request.request_id)
        del self.requests[request.request_id]

