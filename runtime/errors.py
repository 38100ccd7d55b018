"""Errors the engine raises to its callers."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """A worker rank died or failed; every other rank has been shut down and the engine is unusable."""
