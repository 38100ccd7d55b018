"""Split decoder layers into pipeline stages, balancing memory. The runtime uses it too."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from itertools import accumulate


def split_layers(layer_costs: Sequence[float], num_stages: int,
                 first_extra: float = 0.0, last_extra: float = 0.0) -> list[int]:
    """Layers per stage: contiguous, each stage at least one layer, smallest largest stage.

    `layer_costs[i]` is what layer i weighs (bytes); the first stage also holds `first_extra`
    (the embedding) and the last `last_extra` (final norm and LM head). Among splits with the
    same largest stage, the one with the smallest sum of squared stage costs wins, so the
    split is as even as the extras allow; remaining ties give earlier stages more layers.
    Equal layers and no extras give the even split: 10 layers, 3 stages -> [4, 3, 3].
    """
    n = len(layer_costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers into {num_stages} pipeline stages")
    if num_stages == 1:
        return [n]
    if sum(layer_costs) + first_extra + last_extra <= 0:
        layer_costs = [1.0] * n  # nothing weighs anything: split evenly
    prefix = [0.0, *accumulate(layer_costs)]
    extras = [0.0] * num_stages
    extras[0] += first_extra
    extras[-1] += last_extra

    def cost(stage: int, start: int, end: int) -> float:
        return prefix[end] - prefix[start] + extras[stage]

    # NOTE: first the smallest feasible largest stage by bisection (greedy check, O(n) each),
    # then an exact programme restricted to stages under that bound, which keeps it O(n^2/s).
    bound = _min_bottleneck(cost, n, num_stages)
    if max(layer_costs) - min(layer_costs) <= 1e-9 * max(layer_costs):
        return _fill_uniform(n, num_stages, layer_costs[0], extras, bound)
    limit = bound * (1 + 1e-9) + 1e-12
    best: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
    for s in range(num_stages):
        last_end = n - (num_stages - 1 - s)
        nxt: dict[int, tuple[float, tuple[int, ...]]] = {}
        for start, (squares, counts) in best.items():
            for end in range(start + 1, last_end + 1):
                c = cost(s, start, end)
                if c > limit:
                    break
                # squares of costs relative to the bound, rounded so that float noise ties
                key = (round(squares + (c / bound) ** 2, 9), counts + (-(end - start),))
                if end not in nxt or key < nxt[end]:
                    nxt[end] = key
        best = nxt
    return [-c for c in best[n][1]]


def _min_bottleneck(cost, n: int, num_stages: int) -> float:
    def fits(bound: float) -> bool:
        # greedy: each stage takes as many layers as fit under the bound
        start = 0
        for s in range(num_stages):
            last_end = n - (num_stages - 1 - s)
            if cost(s, start, start + 1) > bound:
                return False
            lo, hi = start + 1, last_end  # the largest end in [lo, hi] under the bound
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if cost(s, start, mid) <= bound else (lo, mid - 1)
            start = lo
        return start == n

    lo, hi = 0.0, cost(0, 0, n) + cost(num_stages - 1, 0, 0) + 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        if hi - lo <= 1e-10 * hi:
            break
    return hi


def _fill_uniform(n: int, num_stages: int, layer_cost: float, extras: list[float],
                  bound: float) -> list[int]:
    """Equal layers: add layers one at a time where the stage stays cheapest (earlier on ties).

    Greedy is exact here: stage costs are convex in their layer counts and only the counts'
    sum is fixed, so filling the cheapest stage first minimises the sum of squares under the
    bound, and contiguity is free (any counts make a contiguous split).
    """
    counts = [1] * num_stages
    limit = bound * (1 + 1e-9) + 1e-12

    def entry(s: int) -> tuple[float, int]:
        return (round(((counts[s] + 1) * layer_cost + extras[s]) / bound, 9), s)

    heap = [entry(s) for s in range(num_stages)]
    heapq.heapify(heap)
    for _ in range(n - num_stages):
        while True:
            _, s = heapq.heappop(heap)
            if (counts[s] + 1) * layer_cost + extras[s] <= limit:
                break  # a stage over the bound never reopens: its cost only grows
        counts[s] += 1
        heapq.heappush(heap, entry(s))
    return counts
