"""The router's choice between replicas: the longest cached prefix, the conversation's replica, the load
bound, the pool's capacity, and least-loaded routing as the baseline."""

from shardserve.launch.server.prefix_router import (LEAST_LOADED, LOAD_SLACK, CachedBlocks, PrefixRouter, Route,
                                             block_hashes, session_key)

BLOCK = 4


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def test_block_hashes_chain_every_full_block_to_what_came_before():
    prompt = tokens(0, 10)
    hashes = block_hashes(prompt, BLOCK)
    assert len(hashes) == 2  # the last 2 tokens fill no block
    assert block_hashes(prompt + [99, 98], BLOCK)[:2] == hashes
    changed = [7] + prompt[1:]
    assert not set(block_hashes(changed, BLOCK)) & set(hashes)  # a change in block 0 changes every later one


def test_the_replica_holding_the_longest_prefix_wins_over_an_idle_one():
    router = PrefixRouter(3, BLOCK, 100)
    shared = tokens(0, 12)
    router.record(Route(1, "least_loaded"), shared[:8])
    router.record(Route(2, "least_loaded"), shared)
    route = router.choose([0, 1, 1], shared + [5, 5])
    assert route == Route(2, "prefix", 3)
    assert router.choose([0, 1, 1], tokens(50, 12)) == Route(0, "least_loaded")


def test_a_busy_replica_loses_its_affinity_past_the_bound():
    router = PrefixRouter(2, BLOCK, 100)
    prompt = tokens(0, 8)
    router.record(Route(1, "least_loaded"), prompt)
    assert router.choose([0, LOAD_SLACK], prompt).index == 1
    assert router.choose([0, LOAD_SLACK + 1], prompt) == Route(0, "least_loaded")
    assert router.choose([10, 20], prompt).index == 1  # twice the least loaded's prompts: still within
    assert router.choose([10, 21], prompt).index == 0


def test_a_conversation_goes_back_to_its_replica():
    router = PrefixRouter(2, BLOCK, 100)
    router.record(Route(1, "least_loaded"), tokens(0, 2), session="alice")  # too short for any block
    assert router.choose([0, 2], tokens(0, 3), session="alice") == Route(1, "session")
    assert router.choose([0, 2], tokens(0, 3), session="bob") == Route(0, "least_loaded")
    assert router.choose([0, 9], tokens(0, 3), session="alice") == Route(0, "least_loaded")


def test_the_estimate_forgets_the_least_recently_used_blocks_first():
    cache = CachedBlocks(capacity=2)
    first, second = block_hashes(tokens(0, 4), BLOCK), block_hashes(tokens(10, 4), BLOCK)
    cache.add(first)
    cache.add(second)
    cache.add(first)  # used again: now the most recent
    cache.add(block_hashes(tokens(20, 4), BLOCK))
    assert cache.matched(first) == 1 and cache.matched(second) == 0


def test_least_loaded_routing_ignores_the_cache():
    router = PrefixRouter(2, BLOCK, 100, policy=LEAST_LOADED)
    router.record(Route(1, "least_loaded"), tokens(0, 8), session="alice")
    assert router.choose([0, 1], tokens(0, 8), session="alice") == Route(0, "least_loaded")


def test_the_session_key_comes_from_the_header_then_the_fields():
    assert session_key({"x-session-id": "s1"}, "cache-key", "user-1") == "s1"
    assert session_key({}, None, "user-1") == "user-1"
    assert session_key({}, "", None) is None


def test_no_prompt_goes_to_a_full_replica_while_another_has_room():
    """A client's fan-out fills replica 1's sequences (its conversation's replica, and the one holding the
    prefix): a prompt of the same conversation or prefix goes to replica 0, which has room, and back to
    replica 1 only when every replica is full."""
    router = PrefixRouter(2, BLOCK, 100)
    prompt = tokens(0, 8)
    router.record(Route(1, "least_loaded"), prompt, session="probe")
    assert router.choose([0, 4], prompt, session="probe").index == 1  # within the load bound: affinity holds
    assert router.choose([0, 4], prompt, session="probe", full=[False, True]) == Route(0, "least_loaded")
    assert router.choose([0, 4], prompt, full=[False, True]).index == 0
    assert router.choose([3, 4], prompt, session="probe", full=[True, True]).index == 1
