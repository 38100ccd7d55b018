"""Block pool invariants: reference counts, the free list, prefix caching and eviction."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.runtime.core.block_manager import BlockManager
from shardserve.runtime.core.request import Request
from shardserve.runtime.sampling_params import SamplingParams


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_tokens=4), seed=0)


def test_allocate_and_free_return_every_block():
    pool = BlockManager(num_blocks=8, block_size=4)
    a, b = make_request("a", list(range(10))), make_request("b", list(range(5)))
    assert pool.allocate_slots(a, 10) and pool.allocate_slots(b, 5)
    assert len(pool.block_ids("a")) == 3 and len(pool.block_ids("b")) == 2
    assert pool.num_free_blocks == 3
    assert pool.allocate_slots(a, 12)  # still inside the third block
    assert pool.num_free_blocks == 3
    pool.check_integrity()
    pool.free(a)
    pool.free(b)
    assert pool.num_free_blocks == 8
    pool.check_integrity()


def test_failed_allocation_changes_nothing():
    pool = BlockManager(num_blocks=4, block_size=4)
    a, b = make_request("a", list(range(12))), make_request("b", list(range(8)))
    assert pool.allocate_slots(a, 12)
    assert not pool.allocate_slots(b, 8)
    assert pool.block_ids("b") == [] and pool.num_free_blocks == 1
    pool.check_integrity()


def test_prefix_blocks_are_shared_and_counted():
    pool = BlockManager(num_blocks=10, block_size=4)
    prompt = list(range(100, 110))  # two full blocks and a partial one
    a = make_request("a", prompt)
    assert pool.find_cached_prefix(a) == []
    assert pool.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    pool.cache_full_blocks(a)
    b = make_request("b", prompt + [7, 8])
    hits = pool.find_cached_prefix(b)
    assert hits == pool.block_ids("a")[:2]
    assert pool.allocate_slots(b, 12, hits)
    assert pool.block_ids("b")[:2] == hits
    pool.check_integrity()  # ref count 2 on the shared blocks, verified against the tables
    pool.free(a)
    assert all(block in pool.block_ids("b") for block in hits)
    pool.check_integrity()


def test_prefix_hit_leaves_the_last_token_to_compute():
    pool = BlockManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(8)))
    pool.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    pool.cache_full_blocks(a)
    same = make_request("b", list(range(8)))
    assert len(pool.find_cached_prefix(same)) == 1  # not 2: the model must still see token 7


def test_blocks_filled_by_decode_are_published_when_their_last_token_is_known():
    """Decode steps one token at a time (the calls that mostly return at once): a block is
    published at the first call where it is both computed and known, never before, never skipped."""
    pool = BlockManager(num_blocks=10, block_size=4)
    a = make_request("a", [5, 6, 7])
    assert pool.allocate_slots(a, 3)
    a.num_computed_tokens = 3
    pool.cache_full_blocks(a)
    num_published = []
    for token in (8, 9, 10, 11, 12):
        assert pool.allocate_slots(a, a.num_computed_tokens + 1)  # the step computes the last known token
        a.num_computed_tokens += 1  # ... and samples one more, pending: its id is not known yet
        pool.cache_full_blocks(a)
        before = len(pool.find_cached_prefix(make_request("probe", a.all_token_ids + [0])))
        a.output_token_ids.append(token)  # the pending token lands: computed == known again
        pool.cache_full_blocks(a)
        num_published.append((before, len(pool.find_cached_prefix(make_request("probe", a.all_token_ids + [0])))))
    # tokens 5..8 fill block 0 when 8 lands; 9..12 fill block 1 when 12 lands
    assert num_published == [(0, 1), (1, 1), (1, 1), (1, 1), (1, 2)]
    pool.check_integrity()


def test_freed_cached_blocks_are_revived_or_evicted():
    pool = BlockManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(9)))
    pool.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    pool.cache_full_blocks(a)
    pool.free(a)
    assert pool.num_free_blocks == 4
    again = make_request("b", list(range(9)))
    hits = pool.find_cached_prefix(again)
    assert len(hits) == 2
    assert pool.allocate_slots(again, 9, hits)
    pool.check_integrity()
    pool.free(again)
    big = make_request("c", list(range(500, 516)))  # needs all four blocks: evicts the cached ones
    assert pool.allocate_slots(big, 16)
    pool.check_integrity()
    assert pool.find_cached_prefix(make_request("d", list(range(9)))) == []


def test_prefix_caching_off_never_hits():
    pool = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a = make_request("a", list(range(9)))
    pool.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    pool.cache_full_blocks(a)
    assert pool.find_cached_prefix(make_request("b", list(range(9)))) == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "grow", "free"]), st.integers(0, 5), st.integers(1, 20)),
                max_size=40))
def test_random_operations_keep_integrity(operations):
    pool = BlockManager(num_blocks=12, block_size=4)
    requests: dict[int, Request] = {}
    for op, key, length in operations:
        if op == "alloc" and key not in requests:
            request = make_request(str(key), [key % 3] * length)  # repeated contents -> prefix hits
            hits = pool.find_cached_prefix(request)
            if pool.allocate_slots(request, length, hits):
                request.num_computed_tokens = length
                pool.cache_full_blocks(request)
                requests[key] = request
        elif op == "grow" and key in requests:
            request = requests[key]
            request.output_token_ids.extend([1] * length)
            if pool.allocate_slots(request, request.num_tokens):
                request.num_computed_tokens = request.num_tokens
                pool.cache_full_blocks(request)
        elif op == "free" and key in requests:
            pool.free(requests.pop(key))
        pool.check_integrity()
    for request in requests.values():
        pool.free(request)
    assert pool.num_free_blocks == 12
