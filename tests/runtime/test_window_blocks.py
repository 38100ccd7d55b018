"""Sliding-window KV freeing: the block manager releases blocks behind every layer's window, the
planner's per-request block count is exactly what it then holds, and prefix caching stays correct."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.planner.hf_config import uniform_sliding_window
from shardserve.planner.memory import longest_fitting_len, max_blocks_per_request
from shardserve.runtime.core.block_manager import BlockManager
from shardserve.runtime.config import SchedulerConfig
from shardserve.runtime.core.request import Request
from shardserve.runtime.sampling_params import SamplingParams
from shardserve.runtime.core.scheduler import Scheduler
from test_scheduler import make_requests, run_step


def held_after_step(num_tokens: int, block_size: int, window: int, num_computed: int, num_new: int) -> int:
    """Blocks the pool holds for one request once a step computing [num_computed, +num_new) is allocated."""
    pool = BlockManager(num_blocks=num_tokens, block_size=block_size, enable_prefix_caching=False,
                        sliding_window=window)
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
    assert longest_fitting_len(100, 16, None, 8192, limit=32768) == 1600
    assert longest_fitting_len(300, 16, 4096, 64, limit=32768) == 32768
    assert longest_fitting_len(100, 16, 4096, 64, limit=32768) == 1600
    assert longest_fitting_len(0, 16, None, 64, limit=32768) is None


def test_uniform_window_only_when_every_layer_has_it():
    mistral = {"architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    assert uniform_sliding_window(mistral) == 4096
    assert uniform_sliding_window({**mistral, "sliding_window": None}) is None  # Mistral v0.2+
    assert uniform_sliding_window({**mistral, "architectures": ["LlamaForCausalLM"]}) is None  # key ignored
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 64, "use_sliding_window": True}
    assert uniform_sliding_window({**qwen2, "max_window_layers": 0}) == 64
    assert uniform_sliding_window({**qwen2, "max_window_layers": 1}) is None  # layer 0 sees everything
    assert uniform_sliding_window({**qwen2, "use_sliding_window": False, "max_window_layers": 0}) is None
    assert uniform_sliding_window({**qwen2, "layer_types": ["sliding_attention"] * 3}) == 64
    gemma = {"architectures": ["Gemma2ForCausalLM"], "sliding_window": 4096}
    assert uniform_sliding_window(gemma) is None  # local and global layers alternate
    assert uniform_sliding_window({**gemma, "layer_types": ["sliding_attention", "full_attention"]}) is None


def make_window_scheduler(num_blocks, window=8, block_size=4, max_num_batched_tokens=16, prefix_caching=False):
    pool = BlockManager(num_blocks, block_size, prefix_caching, sliding_window=window)
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
    pool = BlockManager(num_blocks=8, block_size=4, sliding_window=4)
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
    assert not taken & set(pool.find_cached_prefix(d))  # a reused block is never a hit
    c.num_computed_tokens = 16
    pool.cache_full_blocks(c)
    b.num_computed_tokens = 20
    pool.cache_full_blocks(b)  # b's stale entries (now c's blocks) are not published as b's prefix
    pool.check_integrity()
    for request in (a, b, c):
        pool.free(request)
    assert pool.num_free_blocks == 8
    pool.check_integrity()
