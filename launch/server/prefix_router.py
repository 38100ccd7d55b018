"""Which replica serves a prompt: the one that holds the longest cached prefix of it, or the one its
conversation went to, unless that replica is much busier than the least-loaded one.

The server cannot see a replica's prefix cache, so it keeps its own estimate: the full KV blocks of every
prompt (and of its output, once finished) it sent each replica, hashed as a chain the way the engine's
prefix cache keys them, least recently used first out once the replica's pool would be full. A replica's
engine evicts in the same order, so what the estimate holds is what the replica most likely still has.

The load bound: affinity (cache or conversation) holds while the replica has at most
max(LOAD_SLACK, least) prompts more in flight than the least-loaded replica (`least` prompts), so
a shared prefix spreads over replicas once one of them has about twice the others' work."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

CACHE_AWARE, LEAST_LOADED = "cache_aware", "least_loaded"
ROUTING_POLICIES = (CACHE_AWARE, LEAST_LOADED)
SESSION_HEADER = "x-session-id"  # a conversation's key; without it, prompt_cache_key or user
LOAD_SLACK = 4
MAX_SESSIONS = 100_000  # conversations remembered, least recently seen forgotten first


def session_key(headers: Mapping[str, str], *fields: object) -> str | None:
    """A request's conversation: its x-session-id header, else the first of `fields` given (OpenAI's
    prompt_cache_key, then user)."""
    keys = [headers.get(SESSION_HEADER), *(f for f in fields if isinstance(f, str))]
    return next((key for key in keys if key), None)


def block_hashes(token_ids: Sequence[int], block_size: int, previous: int | None = None) -> list[int]:
    """One hash per full block, each covering every token before it (a chain, as prefix caches key);
    `previous`: the hash of the block before token_ids[0], when they go on from there."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        previous = hash((previous, tuple(token_ids[start:start + block_size])))
        hashes.append(previous)
    return hashes


class CachedBlocks:
    """The blocks sent to one replica, most recently used last, at most `capacity` of them."""

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def matched(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt this replica most likely has cached."""
        count = 0
        for block in hashes:
            if block not in self.blocks:
                break
            count += 1
        return count

    def add(self, hashes: Sequence[int]) -> None:
        for block in hashes:
            self.blocks[block] = None
            self.blocks.move_to_end(block)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


@dataclass(frozen=True)
class Route:
    index: int  # the replica
    reason: str  # "session", "prefix" or "least_loaded"
    matched_blocks: int = 0
    hashes: tuple[int, ...] = field(default=(), compare=False)  # the prompt's blocks, as choose hashed them
    seed: int | None = field(default=None, compare=False)  # where the hash chain starts (an adapter's)


class PrefixRouter:
    """Routing decisions for `num_replicas` replicas whose pools hold `capacity_blocks` blocks each."""

    def __init__(self, num_replicas: int, block_size: int, capacity_blocks: int, policy: str = CACHE_AWARE):
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing_policy {policy!r}: choose one of {', '.join(ROUTING_POLICIES)}")
        self.block_size = block_size
        # one replica, or least-loaded routing: nothing is hashed or kept
        self.is_active = policy == CACHE_AWARE and num_replicas > 1
        self.caches = [CachedBlocks(capacity_blocks) for _ in range(num_replicas)]
        self.sessions: OrderedDict[str, int] = OrderedDict()

    def forget(self, index: int) -> None:
        """Replica `index` starts anew (restarted): its pool holds nothing."""
        self.caches[index] = CachedBlocks(self.caches[index].capacity)

    def choose(self, loads: Sequence[int], token_ids: Sequence[int], session: str | None = None,
               seed: int | None = None, full: Sequence[bool] = ()) -> Route:
        """The replica for a prompt, given each replica's prompts in flight; `seed` keeps an adapter's
        blocks (its lora_int_id) apart from the base model's. `full`: the replicas whose sequences are all
        taken (max_num_seqs): while another has room, no prompt goes to one (it would wait there for a whole
        generation of another's fan-out, however idle the other replicas)."""
        has_room = [i for i in range(len(loads)) if not (full and full[i])] or list(range(len(loads)))
        least = min(has_room, key=lambda i: (loads[i], i))
        if not self.is_active:
            return Route(least, "least_loaded")
        hashes = tuple(block_hashes(token_ids, self.block_size, seed))
        bound = loads[least] + max(LOAD_SLACK, loads[least])
        eligible = [i in has_room and loads[i] <= bound for i in range(len(loads))]
        if session is not None and session in self.sessions and eligible[self.sessions[session]]:
            return Route(self.sessions[session], "session", hashes=hashes, seed=seed)
        matched = [cache.matched(hashes) if eligible[i] else 0 for i, cache in enumerate(self.caches)]
        best = max(range(len(loads)), key=lambda i: (matched[i], -loads[i], -i))
        if matched[best] == 0:
            return Route(least, "least_loaded", hashes=hashes, seed=seed)
        return Route(best, "prefix", matched[best], hashes, seed)

    def record(self, route: Route, token_ids: Sequence[int], session: str | None = None) -> None:
        """The replica chosen holds (or will) these tokens' blocks; the conversation goes on there.
        token_ids: the prompt the route was chosen for, maybe with tokens after it (only blocks past the
        route's own hashes are hashed)."""
        if not self.is_active:
            return
        known = route.hashes
        after = block_hashes(token_ids[len(known) * self.block_size:], self.block_size, known[-1] if known else route.seed)
        self.caches[route.index].add((*known, *after))
        if session is not None:
            self.sessions[session] = route.index
            self.sessions.move_to_end(session)
            while len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)
