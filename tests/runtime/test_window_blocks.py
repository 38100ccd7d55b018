"""Sliding-window KV freeing: the block manager releases blocks behind every layer's window, the
planner's per-request block count is exactly what it then holds, and prefix caching stays correct."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.planner.kv_groups import attention_windows, kv_groups  # noqa: I001
from shardserve.planner.kv_groups import longest_fitting_len, max_blocks_per_request
from shardserve.runtime.core.block_manager import BlockManager
from shardserve.runtime.config import SchedulerConfig
from shardserve.runtime.core.request import Request
from shardserve.runtime.sampling_params import SamplingParams
from shardserve.runtime.core.scheduler import Scheduler
from test_scheduler import make_requests, run_step


def held_after_step(num_tokens: int, block_size: int, window: int, num_computed: int, num_new: int) -> int:
    """Blocks the pool holds for one request once a step computing [num_computed, +num_new) is allocated."""
    pool = BlockManager(num_blocks=num_tokens, block_size=block_size, enable_prefix_caching=False,
                        windows=(window,))
    request = Request("r", list(range(num_tokens)), SamplingParams(), seed=0)
    assert pool.allocate_slots(request, max(num_computed, 1))
    request.num_computed_tokens = num_computed
    assert pool.allocate_slots(request, num_computed + num_new)
    pool.check_integrity()
    return len(pool.held_block_ids("r"))


@settings(max_examples=150, deadline=None)
@given(num_tokens=st.integers(1, 70), block_size=st.sampled_from([1, 2, 4, 8, 16]),
       window=st.integers(1, 80), max_chunk=st.integers(1, 40))
def test_planner_count_is_the_most_the_block_manager_holds(num_tokens, block_size, window, max_chunk):
    held = max(held_after_step(num_tokens, block_size, window, c, min(max_chunk, num_tokens - c))
               for c in range(num_tokens))
    assert held == max_blocks_per_request(num_tokens, block_size, window, max_chunk)


def test_the_window_bounds_a_long_request_without_a_window_it_holds_every_block():
    assert max_blocks_per_request(4096, 16, None, 8192) == 256
    # decode: the window's 4096 keys starting on the last token of a block span 257 blocks
    assert max_blocks_per_request(32768, 16, 4096, 1) == 257
    assert max_blocks_per_request(32768, 16, 4096, 8192) == -(-(4096 - 1 + 8192 + 15) // 16)  # a chunk on top
    # auto: the longest length whose request fits; with a window every length does once the window fits
    assert longest_fitting_len(100, 16, (None,), 8192, limit=32768) == 1600
    assert longest_fitting_len(300, 16, (4096,), 64, limit=32768) == 32768
    assert longest_fitting_len(100, 16, (4096,), 64, limit=32768) == 1600
    assert longest_fitting_len(0, 16, (None,), 64, limit=32768) is None


def test_each_layers_window_as_transformers_applies_it():
    def windows(config):
        return attention_windows({"num_hidden_layers": 3, **config})[0]

    mistral = {"architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    assert windows(mistral) == (4096,) * 3
    assert windows({**mistral, "sliding_window": None}) == (None,) * 3  # Mistral v0.2+
    assert windows({**mistral, "architectures": ["LlamaForCausalLM"]}) == (None,) * 3  # key ignored
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 64, "use_sliding_window": True}
    assert windows({**qwen2, "max_window_layers": 0}) == (64,) * 3
    assert windows({**qwen2, "max_window_layers": 1}) == (None, 64, 64)  # layer 0 sees everything
    assert windows({**qwen2, "use_sliding_window": False, "max_window_layers": 0}) == (None,) * 3
    assert windows({**qwen2, "layer_types": ["sliding_attention"] * 3}) == (64,) * 3
    gemma = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "sliding_window": 4096, "num_hidden_layers": 2}
    assert windows(gemma) == (4096, None)  # local and global layers alternate
    assert windows({**gemma, "layer_types": ["full_attention", "sliding_attention"]}) == (None, 4096)


def test_groups_of_equal_size_one_per_kind_or_more():
    gemma3 = [1024] * 5 + [None] + [1024] * 5 + [None]  # 2 global, 10 local: groups of 2
    groups = kv_groups(gemma3)
    assert groups.windows == (None,) + (1024,) * 5 and groups.group_size == 2
    assert groups.layer_slots[5] == (0, 0) and groups.layer_slots[11] == (0, 1) and groups.layer_slots[:2] == ((1, 0), (1, 1))
    assert groups.tensors_on(range(0, 6)) == 2 and groups.tensors_on(range(6, 12)) == 2
    uneven = kv_groups([None, 8, 8, 8, 8])  # 1 full, 4 windowed: groups of one layer
    assert uneven.windows == (None, 8, 8, 8, 8) and uneven.group_size == 1
    assert kv_groups([None, None]).windows == (None,) and kv_groups([8] * 4).group_size == 4


def make_window_scheduler(num_blocks, window=8, block_size=4, max_num_batched_tokens=16, prefix_caching=False):
    pool = BlockManager(num_blocks, block_size, prefix_caching, windows=(window,))
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(config, pool, max_model_len=256)


def test_long_requests_run_in_a_pool_they_would_overflow_without_the_window():
    """4 requests of 10 + 60 tokens (18 blocks each without a window) in 24 blocks, at once."""
    scheduler = make_window_scheduler(num_blocks=24)
    requests = make_requests(4, prompt_len=10, max_tokens=60)
    for request in requests:
        scheduler.add_request(request)
    most = 0
    while scheduler.has_unfinished_requests:
        run_step(scheduler)
        pool = scheduler.block_manager
        most = max([most] + [len(pool.held_block_ids(r.request_id)) for r in scheduler.running])
    assert scheduler.num_preemptions == 0 and all(r.num_output_tokens == 60 for r in requests)
    # decode holds the window's blocks (3), under the bound for chunks of up to 16 tokens (7)
    assert most == max_blocks_per_request(70, 4, 8, 1) == 3 and most <= max_blocks_per_request(70, 4, 8, 16)
    assert scheduler.block_manager.num_free_blocks == 24


def test_preempted_window_request_recomputes_from_scratch():
    scheduler = make_window_scheduler(num_blocks=7, max_num_batched_tokens=8)
    requests = make_requests(3, prompt_len=6, max_tokens=30)
    for request in requests:
        scheduler.add_request(request)
    for _ in range(400):
        if not scheduler.has_unfinished_requests:
            break
        run_step(scheduler)
    assert not scheduler.has_unfinished_requests and scheduler.num_preemptions > 0
    assert all(r.num_output_tokens == 30 for r in requests)
    assert scheduler.block_manager.num_free_blocks == 7


def test_freed_blocks_keep_their_prefix_until_reused_and_are_never_matched_after():
    """A block released behind the window still holds its prefix's KV: a later request with the same
    prefix takes it back. Once another request has taken the block, its hash is gone."""
    pool = BlockManager(num_blocks=8, block_size=4, windows=(4,))
    prompt = list(range(100, 120))  # 5 full blocks
    a = Request("a", prompt, SamplingParams(), seed=0)
    assert pool.allocate_slots(a, 20)
    a.num_computed_tokens = 20
    pool.cache_full_blocks(a)
    assert pool.allocate_slots(a, 21)  # the query at 20 sees 17..20: blocks 0..3 released
    assert pool.num_behind_window(20) == 4 and len(pool.held_block_ids("a")) == 2
    pool.check_integrity()
    b = Request("b", prompt + [7], SamplingParams(), seed=1)
    hits = pool.find_cached_prefix(b)
    assert hits == pool.block_ids("a")[:5]  # every leading block still cached, freed or not
    assert pool.allocate_slots(b, 21, hits)
    # b computes from token 20: blocks 0..3 go in its table unreferenced, only block 4 is shared
    assert pool.held_block_ids("b") == [hits[4], pool.block_ids("b")[5]]
    pool.check_integrity()
    c = Request("c", list(range(500, 516)), SamplingParams(), seed=2)
    assert pool.allocate_slots(c, 16)  # takes the free blocks, released ones first: their hashes go
    pool.check_integrity()
    d = Request("d", prompt + [8], SamplingParams(), seed=3)
    taken = set(pool.held_block_ids("c"))
    hit = pool.find_cached_prefix(d)  # d computes from token 20: only block 4 is read, the rest are stale entries
    assert len(hit) == 5 and hit[4] == pool.block_ids("a")[4]
    assert not taken & set(hit[pool.num_behind_window(20):])  # a reused block is never a hit
    c.num_computed_tokens = 16
    pool.cache_full_blocks(c)
    b.num_computed_tokens = 20
    pool.cache_full_blocks(b)  # b's stale entries (now c's blocks) are not published as b's prefix
    pool.check_integrity()
    for request in (a, b, c):
        pool.free(request)
    assert pool.num_free_blocks == 8
    pool.check_integrity()


def test_a_table_per_group_frees_only_the_windowed_one_and_hits_need_only_the_window():
    """Full attention (group 0) and a window of 4 (group 1): the windowed table is released behind its window
    while the full one keeps every block; a prefix hit needs group 0's every leading block but group 1's only
    from the first block its next query reads."""
    pool = BlockManager(num_blocks=40, block_size=4, windows=(None, 4))
    prompt = list(range(100, 120))  # 5 full blocks
    a = Request("a", prompt, SamplingParams(), seed=0)
    assert pool.allocate_slots(a, 20) and pool.num_free_blocks == 30
    a.num_computed_tokens = 20
    pool.cache_full_blocks(a)
    assert pool.allocate_slots(a, 21)  # group 1 releases blocks 0..3; each group takes block 5
    assert len(pool.block_ids("a")) == len(pool.group_block_ids("a")[0]) == 6
    assert len(pool.held_block_ids("a")) == 6 + 2 and pool.num_free_blocks == 32
    pool.check_integrity()
    b = Request("b", prompt + [7], SamplingParams(), seed=1)
    hit = pool.find_cached_prefix(b)
    assert list(hit) == pool.block_ids("a")[:5] and hit.others[0][4] == pool.group_block_ids("a")[0][4]
    assert pool.allocate_slots(b, 21, hit)
    assert set(pool.held_block_ids("b")) & set(pool.held_block_ids("a")) == set(hit[:5]) | {hit.others[0][4]}
    pool.check_integrity()
    # a prompt sharing 3 blocks: group 0 could resume at 3, but group 1's block 2 was released and then taken
    filler = Request("f", list(range(500, 600)), SamplingParams(), seed=2)
    assert pool.allocate_slots(filler, 60) and pool.num_free_blocks == 0  # evicting the released pages too
    c = Request("c", prompt[:12] + [1, 2, 3, 4, 5], SamplingParams(), seed=3)
    hit = pool.find_cached_prefix(c)
    assert len(hit) == 0  # group 1 holds none of blocks 0..2 any more (a and b hold only blocks 4 and 5)
    for request in (a, b, filler):
        pool.free(request)
    assert pool.num_free_blocks == 40
    pool.check_integrity()
