"""The paged KV block pool: reference counts, an LRU free list, prefix caching of full blocks, and a block table
per group of layers (planner/kv_groups.py: full attention, or a window of W tokens)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from itertools import accumulate

from shardserve.runtime.core.kv_offload import KVTransfer, OffloadTier
from shardserve.runtime.core.request import Request


def hash_block(parent: bytes | None, token_ids: list[int]) -> bytes:
    """Content hash of a full block chained to its parent, so equal hashes mean equal prefixes.
    NOTE: a cryptographic digest rather than Python's hash(): a collision would silently serve
    another prompt's KV, and blake2b costs microseconds per block."""
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(b"".join(t.to_bytes(4, "little", signed=True) for t in token_ids))
    return digest.digest()


class PrefixHit(list):
    """What find_cached_prefix found: as a list, group 0's pages, one per cached leading block; `others`, each
    other group's pages for the same blocks (page 0, never read, where a windowed group needs none)."""

    others: tuple[list[int], ...] = ()


class BlockManager:
    """Owns every KV page. A page is either in use (ref_count > 0, held by the requests whose tables list
    it) or free (ref_count == 0, in `_free` in eviction order). A free page may still carry a (group, hash),
    in which case a later request with the same prefix takes it back instead of recomputing.

        request tokens:        |<- block 0 ->|<- block 1 ->|<- block 2 (partial) ->|
        group 0's table:       [    b7       ,     b2      ,        b9             ]
        group 1's table:       [    b4       ,     b8      ,        b1             ]
        hashes:                [ h0=H(-,t0..) , h1=H(h0,..) ]  (full blocks only, one chain for every group)

    A group with a window W (`windows`): a request computing from token c on never reads a key before
    c - W + 1 in its layers, so that group's leading blocks wholly behind it are released (planner/memory.py
    counts the pages a request then holds, with the same rule):

        group 1's table:       [ b4 (freed) , b8 (freed) , b1 , b3 ]     num_freed[1] = 2
                                              c - W + 1 ^    ^ c
    A freed entry stays in the table, stale, so positions keep their index; the attention kernels read
    only keys inside the window, so a stale id, even one another request now writes, is never read.
    Every group's table has one entry per block of the request's tokens.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: Sequence[int | None] = (None,), num_offload_blocks: int = 0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        if num_offload_blocks and len(windows) > 1:
            raise ValueError("the CPU tier keeps one block table's blocks; this pool has a table per group")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        self._has_window = any(w is not None for w in self.windows)
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[tuple[int, bytes] | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[tuple[int, bytes], int] = {}  # (group, hash) -> page holding that content
        self._tables: dict[str, list[list[int]]] = {}  # per group, the block table (freed entries included)
        self._num_freed: dict[str, list[int]] = {}  # per group, leading entries released behind its window
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
        """Group 0's block table, as the ranks hold it (entries freed behind a window included)."""
        tables = self._tables.get(request_id)
        return tables[0] if tables else []

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """The other groups' block tables (none for a pool of one group)."""
        tables = self._tables.get(request_id)
        return tables[1:] if tables else [[] for _ in self.windows[1:]]

    def held_block_ids(self, request_id: str) -> list[int]:
        """The pages the request holds a reference to, every group's."""
        tables, freed = self._tables.get(request_id, []), self._num_freed.get(request_id)
        return [b for g, table in enumerate(tables) for b in table[freed[g] if freed else 0:]]

    def num_behind_window(self, num_computed_tokens: int, group: int = 0) -> int:
        """Leading blocks of `group` that no query from token `num_computed_tokens` on reads again."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, num_computed_tokens - window + 1) // self.block_size

    def find_cached_prefix(self, request: Request) -> PrefixHit:
        """Pages already holding this request's leading full blocks, in every group: a full-attention group
        needs each leading block, a windowed one those its layers read next. At least one token is left
        uncached so the model still runs on the last token and produces logits."""
        hit = PrefixHit()
        if not self.enable_prefix_caching:
            return hit
        self._update_hashes(request)
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        found = [[self._cached.get((g, h)) for h in hashes] for g in range(len(self.windows))]
        num_blocks = self._longest_usable(found)
        hit.extend(p if p is not None else 0 for p in found[0][:num_blocks])
        hit.others = tuple([p if p is not None else 0 for p in pages[:num_blocks]] for pages in found[1:])
        return hit

    def _longest_usable(self, found: list[list[int | None]]) -> int:
        """The most leading blocks every group can resume from: a full group's all cached, a windowed group's
        cached from the first block its next query reads (a run of cached blocks ending at the last)."""
        num = len(found[0])
        for pages in (p for g, p in enumerate(found) if self.windows[g] is None):
            num = min(num, next((i for i, p in enumerate(pages) if p is None), len(pages)))
        windowed = [g for g, w in enumerate(self.windows) if w is not None]
        runs = [list(accumulate(found[g], lambda run, p: run + 1 if p is not None else 0, initial=0)) for g in windowed]
        while num > 0 and any(run[num] < num - self.num_behind_window(num * self.block_size, g)
                              for g, run in zip(windowed, runs)):
            num -= 1
        return num

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

    def allocate_slots(self, request: Request, num_tokens: int, cached: Sequence[int] = (),
                       offloaded_slots: Sequence[int] = ()) -> bool:
        """Make the request's blocks cover `num_tokens` tokens in every group, first taking the `cached` prefix
        (a PrefixHit, or group 0's pages of a one-group pool), then new pages loaded from `offloaded_slots`
        (only for a request with no blocks yet; its computed tokens are then those blocks'). Blocks behind a
        window are released first, as they are never read again; beyond that, returns False, changing
        nothing, if the pool is short."""
        rid = request.request_id
        tables = self._tables.get(rid)
        if (tables and not cached and not self._has_window
                and num_tokens <= len(tables[0]) * self.block_size):
            return True  # the common decode step: its token fits in the last block (nothing to release)
        assert not (tables and (cached or offloaded_slots)), "cached blocks are taken only on first allocation"
        if tables:
            self._release_behind_window(rid, request.num_computed_tokens)
        hits = [list(cached), *getattr(cached, "others", ())] if cached else [[] for _ in self.windows]
        # NOTE: cached blocks already behind a window go into the table unreferenced, as stale entries
        # (never read), rather than being revived only to be released at once.
        skipped = [self.num_behind_window(len(cached) * self.block_size, g) for g in range(len(self.windows))]
        revived = [pages[skip:] for pages, skip in zip(hits, skipped)]
        num_new = self.blocks_needed(num_tokens) - (len(tables[0]) if tables else 0) - len(cached)
        num_revived = sum(1 for pages in revived for b in pages if self._ref_counts[b] == 0)
        if max(num_new, 0) * len(self.windows) + num_revived > len(self._free):
            return False
        if tables is None:
            tables = self._tables[rid] = [[] for _ in self.windows]
            self._num_freed[rid] = skipped
            self._num_published[rid] = min(skipped)
        for table, pages, skip, alive in zip(tables, hits, skipped, revived):
            table.extend(pages[:skip])
            for block_id in alive:
                if self._ref_counts[block_id] == 0:
                    del self._free[block_id]
                self._ref_counts[block_id] += 1
                table.append(block_id)
        if offloaded_slots:
            self._load(tables[0], offloaded_slots)
        for g, table in enumerate(tables):
            for _ in range(num_new - (len(offloaded_slots) if g == 0 else 0)):
                table.append(self._take_free_block())
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
        """NOTE: a released page keeps its published hash and goes to the back of the free list like
        any freed page: its content is still exactly that prefix's KV, so a later request may take it
        back through find_cached_prefix, until _take_free_block evicts it (which drops the hash first,
        so a reused page is never matched)."""
        tables, freed = self._tables[request_id], self._num_freed[request_id]
        for g, table in enumerate(tables):
            start, end = freed[g], min(self.num_behind_window(num_computed_tokens, g), len(table))
            for block_id in table[start:end]:
                self._ref_counts[block_id] -= 1
                if self._ref_counts[block_id] == 0:
                    self._free[block_id] = None
            freed[g] = max(start, end)

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        old = self._block_hash[block_id]
        if old is not None:  # evict its cached content (to the CPU tier, when there is one)
            if self._cached.get(old) == block_id:
                del self._cached[old]
                slot = None if self.offload is None else self.offload.store(old[1])
                if slot is not None:
                    self.transfers.append(KVTransfer(True, block_id, slot))
            self._block_hash[block_id] = None
        self._ref_counts[block_id] = 1
        return block_id

    def free(self, request: Request) -> None:
        """Release the request's pages. Tail blocks go to the free list first so they are evicted
        before the shared prefix blocks that other requests are likelier to reuse."""
        rid = request.request_id
        self._num_published.pop(rid, None)
        freed = self._num_freed.pop(rid, None)
        for g, table in enumerate(self._tables.pop(rid, [])):
            for block_id in reversed(table[freed[g] if freed else 0:]):
                self._ref_counts[block_id] -= 1
                if self._ref_counts[block_id] == 0:
                    self._free[block_id] = None

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the hashes of blocks whose tokens are all computed, for later prefix hits."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        num_computed = min(request.num_computed_tokens, request.num_tokens)
        published = self._num_published.get(rid, 0)
        if num_computed // self.block_size <= published or rid not in self._tables:
            return  # no block filled since the last call (most decode steps): hashes wait, as they may
        self._update_hashes(request)
        tables, freed = self._tables[rid], self._num_freed[rid]
        # a pending token's id is not known yet: its block waits for the next call
        num_full = min(num_computed // self.block_size, len(tables[0]))
        self._num_published[rid] = max(published, num_full)
        for g, table in enumerate(tables):
            # (a freed entry is never published: another request may own that page by now)
            for index in range(max(published, freed[g]), num_full):
                block_id, key = table[index], (g, request.block_hashes[index])
                if self._block_hash[block_id] is not None or key in self._cached:
                    continue  # already published, or the same content lives in another page
                self._block_hash[block_id] = key
                self._cached[key] = block_id

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
        for request_id, tables in self._tables.items():
            blocks = self.held_block_ids(request_id)
            assert len(set(blocks)) == len(blocks), "a request holds one page twice"
            assert len({len(t) for t in tables}) == 1 and len(tables) == len(self.windows), "tables out of step"
            for block_id in blocks:
                counts[block_id] += 1
        assert counts == self._ref_counts, "reference counts disagree with the block tables"
        free = {b for b in range(self.num_blocks) if counts[b] == 0}
        assert set(self._free) == free, "free list is not exactly the unreferenced pages"
        for key, block_id in self._cached.items():
            assert self._block_hash[block_id] == key, "hash table points at a page with other content"
        assert self.num_free_blocks + sum(1 for c in counts if c > 0) == self.num_blocks
        assert set(self._num_published) <= set(self._tables), "bookkeeping kept for a freed request"
        assert set(self._num_freed) == set(self._tables), "bookkeeping kept for a freed request"
        assert all(n <= len(t) for r, freed in self._num_freed.items() for n, t in zip(freed, self._tables[r]))
        if self.offload is not None:
            self.offload.check_integrity()
