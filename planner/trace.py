"""Traffic as a team records it, for `plan --trace FILE`: one request a line, as JSON lines or CSV (by the file's
suffix) with the same columns:

    arrival_s     seconds from the trace's start (all 0: offline, every request there at once)
    input_len     prompt tokens
    output_len    tokens generated
    prefix_id     optional: requests with the same id share their first prefix_len prompt tokens
    prefix_len    optional, with prefix_id (a system prompt, a conversation's earlier turns)
    num_drafts, num_draft_tokens, num_accepted_tokens
                  optional, all three: speculative decoding's verify steps, drafts and drafts kept for the request
                  (vLLM's counters; `launch --record-trace` writes them), from which a plan with speculative_config
                  takes its acceptance rate when none is given

A line that is not one of these is an error naming the file, the line and the field."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

from shardserve.planner.errors import PlanError
from shardserve.planner.speculative import acceptance_for

SPEC_COLUMNS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
COLUMNS = ("arrival_s", "input_len", "output_len", "prefix_id", "prefix_len", *SPEC_COLUMNS)
MAX_REQUESTS = 1_000_000


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_len: int
    output_len: int
    prefix_id: str | None = None
    prefix_len: int = 0
    spec_counts: tuple[int, int, int] | None = None  # (verify steps, drafts, drafts kept): SPEC_COLUMNS


@dataclass(frozen=True)
class Trace:
    requests: tuple[TraceRequest, ...]  # by arrival
    source: str
    # a closed loop (vLLM's `bench serve --max-concurrency`): this many in flight, the next request sent as one
    # finishes, the arrival times not read; None: each request sent at its arrival_s
    concurrency: int | None = None

    @property
    def is_offline(self) -> bool:
        return all(r.arrival_s == 0 for r in self.requests)

    @property
    def span_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    def mean(self, field: str) -> float:
        return sum(getattr(r, field) for r in self.requests) / len(self.requests)

    def measured_acceptance(self) -> tuple[float, int] | None:
        """(the acceptance rate its speculative decoding ran at, its verify steps), or None when it records none:
        a kept drafts a verify step of k = its mean drafts a step (rounded) solves a + ... + a^k = a's mean kept."""
        counted = [r.spec_counts for r in self.requests if r.spec_counts is not None]
        steps, drafts, kept = (sum(column) for column in zip(*counted)) if counted else (0, 0, 0)
        if not steps:
            return None
        k = max(1, round(drafts / steps))
        rate = acceptance_for(1.0 + min(kept / steps, float(k)), k)
        return min(max(rate, 0.01), 0.99), steps  # (the setting's range)


def read_trace(path: str | Path) -> Trace:
    path = Path(path).expanduser()
    if not path.is_file():
        raise PlanError(f"--trace {path}: no such file")
    with open(path, newline="", encoding="utf-8") as f:
        rows = _csv_rows(f, path) if path.suffix.lower() == ".csv" else _json_rows(f, path)
        requests = [_request(row, path, line) for line, row in rows]
    if not requests:
        raise PlanError(f"--trace {path}: no requests in it (one a line: {', '.join(COLUMNS[:3])})")
    requests.sort(key=lambda r: r.arrival_s)
    return Trace(tuple(requests), str(path))


def _json_rows(f, path: Path):
    for line, text in enumerate(f, 1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except ValueError:
            raise PlanError(f"{path}, line {line}: not a JSON object") from None
        if not isinstance(row, dict):
            raise PlanError(f"{path}, line {line}: not a JSON object")
        yield line, row
        if line > MAX_REQUESTS:
            raise PlanError(f"{path}: more than {MAX_REQUESTS:,} requests; sample it")


def _csv_rows(f, path: Path):
    reader = csv.DictReader(f)
    for line, row in enumerate(reader, 2):  # (line 1: the header)
        if None in row:
            raise PlanError(f"{path}, line {line}: more values than the header's columns")
        yield line, {key: value for key, value in row.items() if value not in (None, "")}


def _request(row: dict, path: Path, line: int) -> TraceRequest:
    where = f"{path}, line {line}"
    unknown = sorted(set(row) - set(COLUMNS))
    if unknown:
        raise PlanError(f"{where}: {unknown[0]}: not a trace column (they are {', '.join(COLUMNS)})")
    arrival = _number(row, "arrival_s", where)
    input_len, output_len = _count(row, "input_len", where, 1), _count(row, "output_len", where, 1)
    prefix_id, prefix_len = row.get("prefix_id"), _count(row, "prefix_len", where, 0, required=False)
    if prefix_len and prefix_id is None:
        raise PlanError(f"{where}: prefix_len without prefix_id: name what the requests share")
    if prefix_id is not None and not isinstance(prefix_id, (str, int)):
        raise PlanError(f"{where}: prefix_id: a string or a number")
    if prefix_len > input_len:
        raise PlanError(f"{where}: prefix_len {prefix_len} is more than input_len {input_len}")
    return TraceRequest(arrival, input_len, output_len, None if prefix_id is None else str(prefix_id), prefix_len,
                        _spec_counts(row, where))


def _spec_counts(row: dict, where: str) -> tuple[int, int, int] | None:
    given = [c for c in SPEC_COLUMNS if c in row]
    if not given:
        return None
    if len(given) < len(SPEC_COLUMNS):
        missing = next(c for c in SPEC_COLUMNS if c not in row)
        raise PlanError(f"{where}: {missing}: missing (speculative decoding's counts come as {', '.join(SPEC_COLUMNS)})")
    steps, drafts, kept = (_count(row, c, where, 0) for c in SPEC_COLUMNS)
    if kept > drafts or drafts < steps:
        raise PlanError(f"{where}: num_accepted_tokens {kept} must be at most num_draft_tokens {drafts}, itself at "
                        f"least num_drafts {steps}")
    return steps, drafts, kept


def _number(row: dict, field: str, where: str) -> float:
    value = row.get(field)
    if value is None:
        raise PlanError(f"{where}: {field}: missing")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PlanError(f"{where}: {field}: {value!r} is not a number") from None
    if not math.isfinite(number) or number < 0:
        raise PlanError(f"{where}: {field}: {value!r} must be a finite number of seconds, at least 0")
    return number


def _count(row: dict, field: str, where: str, least: int, required: bool = True) -> int:
    value = row.get(field)
    if value is None:
        if required:
            raise PlanError(f"{where}: {field}: missing")
        return 0
    try:
        number = int(value) if not isinstance(value, float) or value.is_integer() else None
    except (TypeError, ValueError):
        number = None
    if number is None or isinstance(value, bool) or number < least:
        raise PlanError(f"{where}: {field}: {value!r} must be a whole number of tokens, at least {least}")
    return number


def spread(values: list[float]) -> tuple[float, float, float]:
    """p50, p90 and p99 of `values`."""
    ordered = sorted(values)
    return at_percentile(ordered, 50), at_percentile(ordered, 90), at_percentile(ordered, 99)


def at_percentile(ordered: list[float], percentile: float) -> float:
    """The percentile of sorted values, linear between the nearest ranks (numpy's default)."""
    position = percentile / 100 * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
