"""Named traffic for `plan --traffic NAME`: a trace drawn from a shipped distribution of request lengths
(catalog/traffic/NAME.json, made by bench/<NAME>_lengths.py from the public data set), for teams without a trace
of their own.

    sharegpt   ShareGPT's first turns as vLLM's and SGLang's serving benchmarks sample them (Llama-3 tokens):
               input mean 221, p50 108, p99 885; output mean 199, p50 130, p99 772

The requests are a seeded sample of the shipped pairs, as the benchmarks draw num_prompts of them (without
replacement while there are enough; the rest drawn again, as vLLM oversamples). With a request rate they arrive
as the benchmarks send them: the first at 0 s, then Poisson gaps; with a concurrency N, as `bench serve
--max-concurrency N` sends them: N in flight, the next sent as one finishes (a closed loop); without either, all at
once (an offline burst)."""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from pathlib import Path

from shardserve.planner.errors import PlanError
from shardserve.planner.trace import Trace, TraceRequest

TRAFFIC_DIR = Path(__file__).parent / "catalog" / "traffic"
# NOTE: the benchmarks' own default count: vLLM's `bench serve --num-prompts` and SGLang's bench_serving both
# default to 1,000 prompts, enough for a stable p99 (ten requests above it) and replayed in a few seconds.
DEFAULT_NUM_REQUESTS = 1000
DEFAULT_SEED = 0  # vLLM's benchmark seed


@dataclass(frozen=True)
class Lengths:
    """A shipped distribution: its (input_len, output_len) pairs and the header that says where they come from."""

    name: str
    pairs: tuple[tuple[int, int], ...]
    header: dict

    def mean(self, field: str) -> float:
        return float(self.header[field]["mean"])


def traffic_names() -> tuple[str, ...]:
    return tuple(sorted(path.stem for path in TRAFFIC_DIR.glob("*.json")))


@functools.cache
def load_lengths(name: str) -> Lengths:
    path = TRAFFIC_DIR / f"{name}.json"
    if not path.is_file():
        raise PlanError(f"--traffic {name}: no such traffic (named: {', '.join(traffic_names())})")
    data = json.loads(path.read_text())
    pairs = data.pop("pairs")
    return Lengths(name, tuple((int(i), int(o)) for i, o in pairs), data)


def named_trace(name: str, num: int = DEFAULT_NUM_REQUESTS, request_rate: float | None = None,
                seed: int = DEFAULT_SEED, concurrency: int | None = None) -> Trace:
    """`num` requests drawn from the named lengths; Poisson arrivals at `request_rate`, or `concurrency` of them in
    flight (a closed loop), else all at once."""
    if num < 1:
        raise PlanError(f"--traffic {name}: {num} requests: at least 1")
    if request_rate is not None and not request_rate > 0:
        raise PlanError(f"--traffic {name}: request rate {request_rate}: more than 0 requests/s")
    if request_rate is not None and concurrency is not None:
        raise PlanError(f"--traffic {name}: a request rate and a concurrency: give one of them")
    if concurrency is not None and concurrency < 1:
        raise PlanError(f"--traffic {name}: concurrency {concurrency}: at least 1 request in flight")
    lengths = load_lengths(name)
    rng = random.Random(seed)
    drawn = rng.sample(lengths.pairs, min(num, len(lengths.pairs)))
    drawn += rng.choices(lengths.pairs, k=num - len(drawn))
    clock, requests = 0.0, []
    for index, (input_len, output_len) in enumerate(drawn):
        if request_rate is not None and index:
            clock += rng.expovariate(request_rate)
        requests.append(TraceRequest(clock, input_len, output_len))
    load = (f"Poisson {request_rate:g} req/s" if request_rate is not None
            else f"{concurrency:,} in flight (a closed loop)" if concurrency is not None else "at once")
    return Trace(tuple(requests), f"{name} ({num:,} requests {load}, seed {seed})", concurrency)
