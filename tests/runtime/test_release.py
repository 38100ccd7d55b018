"""An engine frees its weights and KV pool on shutdown by reference counting alone: no cycle keeps the
model or the pool alive, so a benchmark that builds engine after engine does not run out of memory."""

from __future__ import annotations

import gc
import weakref

import pytest

from shardserve.runtime import LLM, SamplingParams


@pytest.mark.parametrize("family", ["llama3", "mixtral", "gpt2"])
def test_shutdown_and_del_free_weights_and_kv_pool_without_gc(checkpoint_factory, kv_bytes_for, family):
    folder, _ = checkpoint_factory(family)
    gc.collect()
    gc.disable()  # NOTE: only reference counting may free them; a cycle would survive until collected
    try:
        llm = LLM(folder, kv_cache_memory_bytes=kv_bytes_for(folder, 16, 16), enforce_eager=True)
        llm.generate("hello world", SamplingParams(max_tokens=4, temperature=0))
        worker = llm.engine.executor.worker
        param = weakref.ref(next(worker.model.parameters()))
        pool = weakref.ref(worker.kv_cache)
        model = weakref.ref(worker.model)
        del worker
        llm.shutdown()
        del llm
        assert model() is None, "the model outlived its engine"
        assert param() is None, "a parameter outlived its engine"
        assert pool() is None, "the KV pool outlived its engine"
    finally:
        gc.enable()
