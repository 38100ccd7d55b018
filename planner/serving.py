"""Steady-state continuous batching: TTFT, TPOT and output tokens/s of a replica for a workload.

A replica runs `b` requests at once. Every step each decoding request gets one token and the
step's remaining token budget (max_num_batched_tokens - b) goes to prefill chunks of new requests:

    step:  | b decode tokens | chunk of a new prompt (<= budget) |
    TPOT   = the mean step (its share of prefill work included), or a pipeline's cycle; with speculative
             decoding each decoding request also verifies k drafts a step, and TPOT is the step over the
             tokens a verify step yields (planner/speculative.py)
    TTFT   = wait for a step + the prompt's own chunk steps + queueing for the prefill budget

Closed loop (`concurrency`): b = the concurrency, capped by max_num_seqs and the KV cache; the rest
wait their turn. Open loop (`request_rate`): b is where arrivals match completions, b = rate *
(TTFT + (output_len - 1) * TPOT), found by fixed-point iteration; a rate no b sustains is overload:
the replica runs full (`saturated`) while TTFT grows without bound (inf). Prefill queueing is M/D/1
with Poisson arrivals: the wait exceeded by a fraction 1 - p of requests is 0 when p <= 1 - rho,
else mean_wait / rho * ln(rho / (1 - p)). A request arriving at a random time first waits for the
step in progress: a decode step, or now and then a longer one carrying another prompt (what sets
TTFT's tail at light load). An engine that schedules once every k decode steps (vLLM 0.6's
--num-scheduler-steps) makes it wait for the whole run of k.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from shardserve.planner.operators import Chunk
from shardserve.planner.workload import Workload


def _decode_context(w: Workload) -> int:
    """The mean context a decoding request attends over during its life."""
    return w.input_len + w.output_len // 2


def _residual_wait(p: float, steps: list[tuple[float, float]]) -> float:
    """The wait, exceeded by a fraction 1 - p of arrivals at random times, for the step in progress
    to end, when a share of the time goes to steps of each length (the rest idle): within a step of
    length L the wait is uniform over [0, L]. The fraction exceeding x, sum of share * (1 - x / L) over
    the steps longer than x, falls linearly between the lengths: solved segment by segment."""
    target = 1 - p
    steps = sorted((length, share) for share, length in steps if length > 0 and share > 0)
    start = 0.0
    for i, (length, _) in enumerate(steps):
        longer = steps[i:]  # the steps still running past `start`
        level = sum(share for _, share in longer)  # the fraction exceeding x: level - x * slope
        slope = sum(share / step for step, share in longer)
        if level - slope * start <= target:
            return start  # (only on the first segment: each later one starts above the target)
        x = (level - target) / slope
        if x <= length:
            return x
        start = length
    return start


def api_max_request_rate(api_ms: tuple[float, float], w: Workload) -> float:
    """Requests/s the deployment's one API process keeps up with (it serves every replica) at its CPU time a
    request and a streamed token (`api_ms`), each request streaming w.output_len tokens; inf where not counted."""
    busy_ms = api_ms[0] + w.output_len * api_ms[1]
    return 1e3 / busy_ms if busy_ms > 0 else math.inf


@dataclass(frozen=True)
class ReplicaSpeed:
    ttft_ms: float
    tpot_ms: float
    output_tokens_per_s: float  # this replica
    batch: float                # requests running at once
    is_overloaded: bool         # the load outruns the replica (latency grows without bound)


@dataclass(frozen=True)
class Replica:
    """A replica's step times: `cycle_ms(b, chunks, context, drafts=0)` is the time between two steps of a
    request with b requests decoding over `context` tokens each, those prefill chunks and `drafts` drafted
    tokens verified in the step (host time included)."""
    cycle_ms: Callable[..., float]
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_tokens: int  # the pool's pages x block_size (every KV group's blocks, counted as tokens)
    request_ms: float = 0.0  # a request's way through the server before its first step and after its first token
    source: str = ""  # where the step times come from (measured tables or the fitted roofline)
    scheduler_steps: int = 1  # decode steps between two schedules; this runtime schedules every step
    mixes_prefill: bool = True  # prefill chunks share a step with the decodes; else a prompt's steps run alone
    kv_windows: tuple[int | None, ...] = (None,)  # each KV group's window (planner/kv_groups.py)
    num_drafts: int = 0  # speculative decoding: the drafts each decoding request verifies per step
    tokens_per_step: float = 1.0  # the tokens a decoding request gains per step (1 + a + ... + a^k)
    api_ms: tuple[float, float] = (0.0, 0.0)  # the API process's CPU a request and a streamed token (HostModel)

    def api_max_request_rate(self, w: Workload) -> float:
        return api_max_request_rate(self.api_ms, w)

    def max_running(self, w: Workload) -> float:
        """Requests the KV cache holds at once, each at its mean length over its life."""
        per_request = max(1.0, w.input_len - w.prefix_len + w.output_len / 2 + self.num_drafts)
        prefix = self._held(w.prefix_len)  # one copy of the shared prefix; a windowed group holds its window
        fits = max(0.0, self.kv_cache_tokens - prefix) / max(1.0, self._held(w.prefix_len + per_request) - prefix)
        return max(1.0, min(float(self.max_num_seqs), fits))

    def _held(self, tokens: float) -> float:
        """Page-tokens a request of `tokens` holds across the KV groups."""
        return sum(tokens if window is None else min(tokens, window) for window in self.kv_windows)

    def _chunks(self, b: int, w: Workload) -> list[Chunk]:
        """The chunks a new prompt (its uncached part, at least one token) is computed in when b
        requests decode beside it."""
        budget = max(1, self.max_num_batched_tokens - b * (1 + self.num_drafts))
        chunks: list[Chunk] = []
        done = w.prefix_len
        while done < w.input_len or not chunks:
            n = min(budget, max(1, w.input_len - done))
            chunks.append(Chunk(n, done + n))
            done += n
        return chunks

    def decode_step_ms(self, w: Workload, b: float) -> float:
        """A step of b requests decoding over the workload's mean context, no prompt beside them."""
        bi = max(1, math.ceil(b))
        return self.cycle_ms(bi, (), _decode_context(w), bi * self.num_drafts)

    def _prompt_steps(self, bi: int, w: Workload, together: float) -> tuple[list[float], float]:
        """(the steps that carry a new prompt, the time each prompt adds to the decodes' cycle) with bi
        requests decoding and `together` prompts arriving per cycle. Mixed: the prompt's chunks ride in
        decode steps, adding their compute. Not mixed: its steps run alone (one decode token, a step's
        least) while the decodes wait; prompts arriving together share one step's weight reads."""
        context = _decode_context(w)
        if self.mixes_prefill:
            own = [self.cycle_ms(bi, (c,), context, bi * self.num_drafts) for c in self._chunks(bi, w)]
            return own, sum(own) - self.decode_step_ms(w, bi) * len(own)
        chunks = self._chunks(0, w)
        k = 1 if len(chunks) > 1 else max(1, min(math.ceil(together),
                                                 self.max_num_batched_tokens // chunks[0].tokens))
        own = [self.cycle_ms(1, (c,) * k, context) for c in chunks]
        return own, sum(own) / k

    def _steady(self, b: float, w: Workload, per_cycle: float | None = None,
                rate_per_ms: float | None = None) -> tuple[float, float, float]:
        """(mean cycle ms, TTFT ms at the percentile, prefill utilisation) with b requests running and
        new requests arriving `per_cycle` (a closed loop: the next is sent as one finishes, at a step's
        end) or at random times, `rate_per_ms` (an open loop: a request first waits for the running
        step to end). Utilisation 1 or more is overload."""
        bi = max(1, math.ceil(b))
        decode_only = self.decode_step_ms(w, bi)
        own, extra = self._prompt_steps(bi, w, 1.0 if per_cycle is None else per_cycle)
        new = max(1, w.input_len - w.prefix_len)
        room = max(1, self.max_num_batched_tokens - (bi * (1 + self.num_drafts) if self.mixes_prefill else 0))
        busy = 0.0
        if rate_per_ms is not None:  # arrivals per cycle while cycles stretch by the prefills they carry;
            for _ in range(2):  # past saturation (every step's budget full of prefill) overload; a second
                busy = rate_per_ms * extra  # pass when prompts come fast enough to share a step
                per_cycle = room / new if busy >= 1 else min(room / new, rate_per_ms * decode_only / (1 - busy))
                if self.mixes_prefill or per_cycle <= 1:
                    break
                own, extra = self._prompt_steps(bi, w, per_cycle)
        assert per_cycle is not None  # a closed loop gives it; an open loop's rate sets it above
        mean = decode_only + per_cycle * extra
        rho = 1.0 if busy >= 1 or per_cycle >= room / new else per_cycle * new / room
        service = sum(own)
        p = w.percentile / 100
        wait = 0.0
        if 0 < rho < 1 and p > 1 - rho:
            mean_wait = rho * service / (2 * (1 - rho))
            wait = mean_wait / rho * math.log(rho / (1 - p))
        step_wait = 0.0
        if rate_per_ms is not None:  # the rest of the step running when the request arrives
            # the share of time in steps that carry a prompt (alone, a step is shared by the prompts in it)
            in_prefill = min(1.0, rate_per_ms * (service if self.mixes_prefill else extra))
            step_wait = _residual_wait(p, [(in_prefill, service / len(own)),
                                           ((1 - in_prefill) * min(1.0, b), decode_only * self.scheduler_steps)])
        return mean, self.request_ms + step_wait + service + wait, max(rho, busy)

    def closed_loop(self, w: Workload) -> ReplicaSpeed:
        c = w.concurrency or 1.0
        b = min(c, self.max_running(w))
        cycle, ttft, rho = self._steady(b, w, per_cycle=b * self.tokens_per_step / max(1, w.output_len))
        tpot = cycle / self.tokens_per_step
        if c > b:  # the rest wait their turn: (c - b) ahead, b finishing per request lifetime
            ttft += (c - b) / b * (ttft + (w.output_len - 1) * tpot)
        return ReplicaSpeed(ttft, tpot, b / tpot * 1e3, b, rho >= 1)

    def saturated(self, w: Workload) -> ReplicaSpeed:
        """The replica kept full: as many requests running as max_num_seqs and the KV cache allow, the
        next admitted as one finishes (what it serves while a queue waits)."""
        return self.closed_loop(Workload(w.input_len, w.output_len, w.prefix_len, self.max_running(w), None,
                                         w.percentile))

    def open_loop(self, w: Workload) -> ReplicaSpeed:
        rate = (w.request_rate or 0.0) / 1e3  # per ms
        cap = self.max_running(w)
        b = max(1e-3, rate * w.output_len)
        for _ in range(60):
            cycle, ttft, rho = self._steady(b, w, rate_per_ms=rate)
            nxt = rate * (ttft + (w.output_len - 1) * cycle / self.tokens_per_step)
            if rho >= 1 or nxt > cap:
                return self._overloaded(w)
            if abs(nxt - b) <= 1e-3 * max(1.0, b):
                b = nxt
                break
            b = 0.5 * (b + nxt)
        cycle, ttft, rho = self._steady(b, w, rate_per_ms=rate)
        if rho >= 1:
            return self._overloaded(w)
        return ReplicaSpeed(ttft, cycle / self.tokens_per_step, rate * w.output_len * 1e3, b, False)

    def _overloaded(self, w: Workload) -> ReplicaSpeed:
        """Arrivals outrun the replica: it runs full (saturated) while the queue, and so TTFT, grows
        without bound (math.inf); it serves its full batch's tokens, never more than were asked for."""
        full = self.saturated(w)
        asked = (w.request_rate or 0.0) * w.output_len
        return ReplicaSpeed(math.inf, full.tpot_ms, min(asked, full.output_tokens_per_s), full.batch, True)

    def speed(self, w: Workload) -> ReplicaSpeed:
        return self.open_loop(w) if w.request_rate is not None else self.closed_loop(w)

    def max_request_rate(self, w: Workload, meets: Callable[[ReplicaSpeed], bool]) -> float:
        """The highest Poisson rate (requests/s) this replica serves without overload and with
        `meets` true; 0 when not even a trickle meets it."""
        hi = self.saturated(w).output_tokens_per_s / max(1, w.output_len) * 1.05
        lo = 0.0

        def ok(rate: float) -> bool:
            s = self.open_loop(w.with_rate(rate))
            return not s.is_overloaded and meets(s)
        if not ok(hi * 1e-3):
            return 0.0
        for _ in range(16):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        return lo
