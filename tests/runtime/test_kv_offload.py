"""The CPU tier of the prefix cache: its bookkeeping, the copies it orders, and generation that loads
evicted prefixes back (greedy tokens equal transformers', fewer prompt tokens computed)."""

from __future__ import annotations

import pytest

from shardserve.planner.settings import SettingError
from shardserve.runtime import LLM, SamplingParams
from shardserve.runtime.core.block_manager import BlockManager
from shardserve.runtime.core.kv_offload import KVTransfer, OffloadTier
from test_block_manager import make_request
from test_runtime_matches_transformers import random_prompts, reference, token_outputs

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
# four prompts of 8 blocks of 4 (two with a 4-block shared head): a pool of 12 blocks holds one at a time
PROMPTS = random_prompts(21, [33, 34, 35, 36])
PROMPTS[2][:16] = PROMPTS[3][:16] = PROMPTS[1][:16]


def test_the_tier_drops_its_least_recently_used_unpinned_slot():
    tier = OffloadTier(2)
    assert tier.store(b"a") == 0 and tier.store(b"b") == 1
    assert tier.store(b"a") is None  # held already: refreshed, no copy
    assert tier.store(b"c") == 1  # b was the least recently used
    assert tier.lookup(b"b") is None and tier.lookup(b"a") == 0
    tier.pinned.update({0, 1})
    assert tier.store(b"d") is None  # every slot is being read this step
    tier.pinned.clear()
    tier.check_integrity()
    with pytest.raises(ValueError, match="at least one slot"):
        OffloadTier(0)


def computed(pool: BlockManager, request, num_tokens: int) -> None:
    request.num_computed_tokens = num_tokens
    pool.cache_full_blocks(request)


def test_an_evicted_prefix_goes_to_the_tier_and_comes_back_in_order():
    pool = BlockManager(num_blocks=4, block_size=4, num_offload_blocks=4)
    a = make_request("a", list(range(100, 112)))  # three full blocks
    assert pool.allocate_slots(a, 12)
    computed(pool, a, 12)
    a_blocks = pool.block_ids("a")
    pool.free(a)
    b = make_request("b", list(range(200, 216)))
    assert pool.allocate_slots(b, 16)  # evicts a's three hashed blocks: each is copied out first
    assert pool.transfers == [KVTransfer(True, block, slot) for block, slot in zip(reversed(a_blocks), range(3))]
    pool.transfers.clear()
    computed(pool, b, 16)
    pool.free(b)
    again = make_request("c", list(range(100, 112)) + [1])
    assert pool.find_cached_prefix(again) == []
    slots = pool.find_offloaded(again, 0)
    assert slots == [2, 1, 0]  # a's blocks, first to last (they were freed tail first)
    assert pool.allocate_slots(again, 13, (), slots)
    loads = [t for t in pool.transfers if not t.to_host]
    outs = [t for t in pool.transfers if t.to_host]
    assert [t.slot for t in loads] == slots and [t.block_id for t in loads] == pool.block_ids("c")[:3]
    # b's evicted blocks go to the free slot 3, and to a slot being read only once its load is issued
    order = pool.transfers.index
    assert outs and all(order(t) > order(next(x for x in loads if x.slot == t.slot)) for t in outs if t.slot in slots)
    assert all(pool.transfers.index(t) < pool.transfers.index(next(x for x in loads if x.block_id == t.block_id))
               for t in outs if t.block_id in {x.block_id for x in loads})  # a block is emptied before it is loaded
    pool.check_integrity()


def test_a_slot_being_loaded_is_not_overwritten_by_the_evictions_the_load_causes():
    """A tier of 2 slots: loading both evicts two hashed blocks, which must not take those slots."""
    pool = BlockManager(num_blocks=3, block_size=4, num_offload_blocks=2)
    first = make_request("x", list(range(8)) + [99])
    assert pool.allocate_slots(first, 9)
    computed(pool, first, 9)
    pool.free(first)
    filler = make_request("y", list(range(50, 62)))
    assert pool.allocate_slots(filler, 12)  # x's two full blocks go out to both slots
    computed(pool, filler, 12)
    pool.free(filler)
    pool.transfers.clear()
    back = make_request("z", list(range(8)) + [7])
    slots = pool.find_offloaded(back, 0)
    assert len(slots) == 2
    assert pool.allocate_slots(back, 9, (), slots)
    first_load = next(i for i, t in enumerate(pool.transfers) if not t.to_host)
    # both slots pinned while the loaded blocks were taken: those evictions were dropped, and the third
    # block's eviction (after the loads were issued) may reuse a slot, as the loads read it first
    assert not [t for t in pool.transfers[:first_load] if t.to_host]
    assert [t.to_host for t in pool.transfers] == [False, False, True]
    pool.check_integrity()


def test_the_tier_needs_prefix_caching(checkpoint_factory):
    folder, _ = checkpoint_factory("llama3")
    with pytest.raises(SettingError, match="kv_offloading_size needs enable_prefix_caching"):
        LLM(folder, device="cpu", enable_prefix_caching=False, kv_offloading_size=0.01)
    with pytest.raises(ValueError, match="holds no KV block"):
        LLM(folder, device="cpu", kv_offloading_size=1e-9)


def run_rounds(folder: str, kv_bytes: int, **kwargs) -> tuple[list[list[int]], object]:
    """The prompts one after another, twice: the second round finds every prefix evicted from the pool."""
    with LLM(folder, device="cpu", block_size=4, max_model_len=48, kv_cache_memory_bytes=kv_bytes, **kwargs) as llm:
        outputs = [token_outputs(llm, [p], GREEDY)[0] for _ in range(2) for p in PROMPTS]
        llm.engine.block_manager.check_integrity()
        return outputs, llm.engine.get_stats()


@pytest.mark.parametrize("layout", [pytest.param({}, id="tp1"),  # ranks in processes: slow
                                    pytest.param({"tensor_parallel_size": 2}, id="tp2", marks=pytest.mark.slow),
                                    pytest.param({"pipeline_parallel_size": 2}, id="pp2", marks=pytest.mark.slow)])
def test_loaded_prefixes_give_transformers_tokens_with_less_prefill(layout, checkpoint_factory, kv_bytes_for):
    folder, hf_model = checkpoint_factory("llama3")
    expected = reference(hf_model, PROMPTS, GREEDY.max_tokens) * 2
    kv_bytes = kv_bytes_for(folder, 12, 4)
    parallel = {**layout, "distributed_executor_backend": "mp"} if layout else {}
    with_tier, tiered = run_rounds(folder, kv_bytes, kv_offloading_size=0.001, **parallel)
    assert with_tier == expected
    without, plain = run_rounds(folder, kv_bytes, **parallel) if not layout else (expected, None)
    assert without == expected
    # round one hits the 4 shared blocks twice (prompts 3 and 4); round two every full block before each
    # prompt's last token, 8 blocks a prompt: most of them loaded back from the tier
    assert tiered.num_prefix_hit_tokens + tiered.num_offload_hit_tokens == 2 * 16 + 4 * 32
    assert tiered.num_offload_hit_tokens >= 64
    assert tiered.num_offload_query_tokens > tiered.num_offload_hit_tokens
    if plain is not None:  # without the tier the evicted prefixes are computed again
        assert plain.num_offload_hit_tokens == plain.num_offload_query_tokens == 0
        assert plain.num_prefix_hit_tokens == tiered.num_prefix_hit_tokens < 2 * 16 + 4 * 32
