"""forward_context: refuses nesting, always resets, and is private to each thread."""

from __future__ import annotations

import threading

import pytest

from shardserve.runtime.attention.torch_backend import TorchAttentionBackend
from shardserve.runtime.worker.forward_context import ForwardContext, forward_context, get_forward_context


def make_context() -> ForwardContext:
    return ForwardContext(attn_metadata=None, backend=TorchAttentionBackend())


def test_nesting_is_refused_and_the_context_resets():
    with pytest.raises(RuntimeError, match="outside forward_context"):
        get_forward_context()
    context = make_context()
    with forward_context(context):
        assert get_forward_context() is context
        with pytest.raises(RuntimeError, match="do not nest"):
            with forward_context(make_context()):
                pass
    with pytest.raises(ValueError):
        with forward_context(context):
            raise ValueError("the forward pass failed")
    with pytest.raises(RuntimeError, match="outside forward_context"):
        get_forward_context()


def test_threads_each_have_their_own_context():
    """Two engines stepping in two threads of one process (data-parallel replicas) must not collide."""
    entered, release = threading.Event(), threading.Event()
    seen = {}

    def other_engine():
        context = make_context()
        with forward_context(context):
            entered.set()
            release.wait(timeout=10)
            seen["other"] = get_forward_context() is context

    thread = threading.Thread(target=other_engine)
    thread.start()
    assert entered.wait(timeout=10)
    mine = make_context()
    with forward_context(mine):
        seen["mine"] = get_forward_context() is mine
    release.set()
    thread.join()
    assert seen == {"mine": True, "other": True}
