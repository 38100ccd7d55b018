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


@pytest.mark.parametrize("family", ["llama3", "phi3", "gemma3"])
def test_one_rope_table_per_model_not_per_layer(checkpoint_factory, kv_bytes_for, family):
    """Every layer rotates alike (Gemma: alike per layer type), so the cos/sin tables exist once: at 128k
    positions a table is 64 MiB, which per layer would be GiBs the plan never counted."""
    folder, _ = checkpoint_factory(family)
    pages = 32 if family == "gemma3" else 16  # a block table per kind of layer: 16 pages each at 256 tokens
    with LLM(folder, kv_cache_memory_bytes=kv_bytes_for(folder, pages, 16)) as llm:
        model = llm.engine.executor.worker.model
        tables = {id(m.cos) for m in model.modules() if hasattr(m, "cos") and hasattr(m, "sin")}
        attentions = [m for m in model.modules() if hasattr(m, "rotary_emb")]
        assert len(attentions) > 1
        assert len(tables) == (2 if family == "gemma3" else 1)
