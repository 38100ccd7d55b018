"""One finding of `shardserve doctor`: pass, warn, fail or skip, with what to do about it."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # pass | warn | fail | skip
    detail: str
    fix: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)
