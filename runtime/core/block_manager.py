"""The paged KV block pool: reference counts, an LRU free list and prefix caching of full blocks."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from shardserve.runtime.core.kv_offload import KVTransfer, OffloadTier
from shardserve.runtime.core.request import Request


def hash_block(parent: bytes | None, token_ids: list[int]) -> bytes:
    """Content hash of a full block chained to its parent, so equal hashes mean equal prefixes.
    NOTE: a cryptographic digest rather than Python's hash(): a collision would silently serve
    another prompt's KV, and blake2b costs microseconds per block."""
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(b"".join(t.to_bytes(4, "little", signed=True) for t in token_ids))
    return digest.digest()


class BlockManager:
    """Owns every KV block. A block is either in use (ref_count > 0, held by the requests listed in
    `_request_blocks`) or free (ref_count == 0, in `_free` in eviction order). A free block may still
    carry a hash, in which case a later request with the same prefix takes it back instead of
    recomputing.

        request tokens: |<- block 0 ->|<- block 1 ->|<- block 2 (partial) ->|
        block table:    [    b7       ,     b2      ,        b9             ]
        hashes:         [ h0=H(-,t0..) , h1=H(h0,..) ]  (full blocks only)

    With a `sliding_window` that every layer applies, a request computing from token c on never reads
    a key before c - window + 1, so the leading blocks wholly behind it are released (planner/memory.py
    counts the blocks a request then holds, with the same rule):

        block table:    [ b7 (freed) , b2 (freed) , b9 , b4 ]     num_freed = 2
                                       c - window + 1 ^    ^ c
    A freed entry stays in the table, stale, so positions keep their index; the attention kernels read
    only keys inside the window, so a stale id, even one another request now writes, is never read.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, num_offload_blocks: int = 0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}  # hash -> block id holding that content
        self._request_blocks: dict[str, list[int]] = {}  # the block table, freed entries included
        self._num_freed: dict[str, int] = {}  # leading table entries released behind the window
        self._num_published: dict[str, int] = {}  # leading blocks of a request already offered for reuse
        # the CPU tier (kv_offload.py): evicted prefix blocks kept in host memory, and the copies this
        # step's ranks must run, in order
        self.offload = OffloadTier(num_offload_blocks) if num_offload_blocks and enable_prefix_caching else None
        self.transfers: list[KVTransfer] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table, as the ranks hold it (entries freed behind the window included)."""
        return self._request_blocks.get(request_id, [])

    def held_block_ids(self, request_id: str) -> list[int]:
        """The blocks the request holds a reference to."""
        return self.block_ids(request_id)[self._num_freed.get(request_id, 0):]

    def num_behind_window(self, num_computed_tokens: int) -> int:
        """Leading blocks no query from token `num_computed_tokens` on reads again."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks already holding this request's leading full blocks. At least one token is left
        uncached so the model still runs on the last token and produces logits."""
        if not self.enable_prefix_caching:
            return []
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def find_offloaded(self, request: Request, num_hits: int) -> list[int]:
        """Host slots holding this request's next full blocks after its `num_hits` GPU hits, as far as
        the tier holds them in a row (leaving one token uncached, as find_cached_prefix does)."""
        if self.offload is None:
            return []
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        slots = []
        for block_hash in request.block_hashes[num_hits:max_blocks]:
            slot = self.offload.lookup(block_hash)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def allocate_slots(self, request: Request, num_tokens: int, cached_block_ids: Sequence[int] = (),
                       offloaded_slots: Sequence[int] = ()) -> bool:
        """Make the request's blocks cover `num_tokens` tokens, first taking `cached_block_ids`, then
        new blocks loaded from `offloaded_slots` (only for a request with no blocks yet; its computed
        tokens are then those blocks'). Blocks behind the window are released first, as they are never
        read again; beyond that, returns False, changing nothing, if the pool is short."""
        table = self._request_blocks.get(request.request_id, [])
        if (table and not cached_block_ids and self.sliding_window is None
                and num_tokens <= len(table) * self.block_size):
            return True  # the common decode step: its token fits in the last block (nothing to release)
        assert not (table and (cached_block_ids or offloaded_slots)), "cached blocks are taken only on first allocation"
        if table:
            self._release_behind_window(request.request_id, request.num_computed_tokens)
        # NOTE: cached blocks already behind the window go into the table unreferenced, as stale
        # entries (never read), rather than being revived only to be released at once.
        num_skipped = self.num_behind_window(len(cached_block_ids) * self.block_size)
        revived = cached_block_ids[num_skipped:]
        num_new = self.blocks_needed(num_tokens) - len(table) - len(cached_block_ids)
        num_revived = sum(1 for b in revived if self._ref_counts[b] == 0)
        if max(num_new, 0) + num_revived > len(self._free):
            return False
        blocks = self._request_blocks.setdefault(request.request_id, table)
        if cached_block_ids:
            blocks.extend(cached_block_ids[:num_skipped])
            self._num_freed[request.request_id] = num_skipped
            self._num_published[request.request_id] = num_skipped
        for block_id in revived:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1
            blocks.append(block_id)
        if offloaded_slots:
            self._load(blocks, offloaded_slots)
            num_new -= len(offloaded_slots)
        for _ in range(num_new):
            blocks.append(self._take_free_block())
        return True

    def _load(self, blocks: list[int], slots: Sequence[int]) -> None:
        """New blocks for the table, each loaded from its host slot. NOTE: the slots are pinned while
        the blocks are taken, so an eviction those takes cause cannot give a slot still to be read to
        other content before its load is issued."""
        assert self.offload is not None  # find_offloaded found the slots
        self.offload.pinned.update(slots)
        taken = [self._take_free_block() for _ in slots]
        self.offload.pinned.clear()
        for block_id, slot in zip(taken, slots):
            self.transfers.append(KVTransfer(False, block_id, slot))
            blocks.append(block_id)

    def _release_behind_window(self, request_id: str, num_computed_tokens: int) -> None:
        """NOTE: a released block keeps its published hash and goes to the back of the free list like
        any freed block: its content is still exactly that prefix's KV, so a later request may take it
        back through find_cached_prefix, until _take_free_block evicts it (which drops the hash first,
        so a reused block is never matched). A hit still needs every leading block cached."""
        blocks, start = self._request_blocks[request_id], self._num_freed.get(request_id, 0)
        end = min(self.num_behind_window(num_computed_tokens), len(blocks))
        for block_id in blocks[start:end]:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None
        if end > start:
            self._num_freed[request_id] = end

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        old_hash = self._block_hash[block_id]
        if old_hash is not None:  # evict its cached content (to the CPU tier, when there is one)
            if self._cached.get(old_hash) == block_id:
                del self._cached[old_hash]
                slot = None if self.offload is None else self.offload.store(old_hash)
                if slot is not None:
                    self.transfers.append(KVTransfer(True, block_id, slot))
            self._block_hash[block_id] = None
        self._ref_counts[block_id] = 1
        return block_id

    def free(self, request: Request) -> None:
        """Release the request's blocks. Tail blocks go to the free list first so they are evicted
        before the shared prefix blocks that other requests are likelier to reuse."""
        self._num_published.pop(request.request_id, None)
        num_freed = self._num_freed.pop(request.request_id, 0)
        for block_id in reversed(self._request_blocks.pop(request.request_id, [])[num_freed:]):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the hashes of blocks whose tokens are all computed, for later prefix hits."""
        if not self.enable_prefix_caching:
            return
        num_computed = min(request.num_computed_tokens, request.num_tokens)
        if num_computed // self.block_size <= self._num_published.get(request.request_id, 0):
            return  # no block filled since the last call (most decode steps): hashes wait, as they may
        self._update_hashes(request)
        blocks = self._request_blocks.get(request.request_id, [])
        # a pending token's id is not known yet: its block waits for the next call
        num_full = min(num_computed // self.block_size, len(blocks))
        # (a freed entry is never published: another request may own that block by now)
        start = max(self._num_published.get(request.request_id, 0), self._num_freed.get(request.request_id, 0))
        self._num_published[request.request_id] = max(start, num_full)
        for index in range(start, num_full):
            block_id, block_hash = blocks[index], request.block_hashes[index]
            if self._block_hash[block_id] is not None or block_hash in self._cached:
                continue  # already published, or the same content lives in another block
            self._block_hash[block_id] = block_hash
            self._cached[block_hash] = block_id

    def _update_hashes(self, request: Request) -> None:
        hashes, size = request.block_hashes, self.block_size
        num_full = request.num_tokens // size
        while len(hashes) < num_full:
            start = len(hashes) * size
            # an adapter's KV differs from the base model's for the same tokens: its chain starts apart
            parent = hashes[-1] if hashes else (request.lora.hash_seed if request.lora is not None else None)
            hashes.append(hash_block(parent, request.token_ids_slice(start, start + size)))

    def check_integrity(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent."""
        counts = [0] * self.num_blocks
        for request_id in self._request_blocks:
            blocks = self.held_block_ids(request_id)
            assert len(set(blocks)) == len(blocks), "a request holds one block twice"
            for block_id in blocks:
                counts[block_id] += 1
        assert counts == self._ref_counts, "reference counts disagree with the block tables"
        free = {b for b in range(self.num_blocks) if counts[b] == 0}
        assert set(self._free) == free, "free list is not exactly the unreferenced blocks"
        for block_hash, block_id in self._cached.items():
            assert self._block_hash[block_id] == block_hash, "hash table points at a block with other content"
        assert self.num_free_blocks + sum(1 for c in counts if c > 0) == self.num_blocks
        assert set(self._num_published) <= set(self._request_blocks), "bookkeeping kept for a freed request"
        assert set(self._num_freed) <= set(self._request_blocks), "bookkeeping kept for a freed request"
        assert all(n <= len(self._request_blocks[r]) for r, n in self._num_freed.items())
        if self.offload is not None:
            self.offload.check_integrity()
