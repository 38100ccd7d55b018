"""How a model's attention layers share the paged KV pool: a group per kind of layer (full attention, or a
sliding window of W tokens), each with its own block table per request, so a windowed layer holds only
the blocks inside its window (planner and runtime share these rules; torch-free).

Every page of the pool holds one block of `group_size` layers: page p is the p-th block of each of
group_size KV tensors, and whichever group took page p keeps its layers' keys and values there.

    Gemma 3 12B: 48 layers, 8 global and 40 with a window of 1,024; group_size = 8
    group 0 (full):    the 8 global layers          pages for every token of the request
    groups 1-5 (1024): 8 windowed layers each       pages for the last 1,024 tokens (and the step's chunk)
    KV tensor j holds slot j of every group: the j-th global layer, and the j-th layer of each windowed group

A model whose attention layers are all of one kind has one group of all of them (group_size = its layer
count): a page is a block of every layer, as a model without windows has always had it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardserve.planner.hf_config import WINDOW_RULES, layer_types


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]  # each group's window (None: full attention)
    # per attention layer, in layer order (recurrent layers have none): (its group, its KV tensor)
    layer_slots: tuple[tuple[int, int], ...]
    group_size: int  # layers per group: the KV tensors each page spans
    layers: tuple[int, ...] = ()  # each attention layer's index among the decoder layers (all of them when ())

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def is_hybrid(self) -> bool:
        """More than one group: a request holds a block table per group."""
        return len(self.windows) > 1

    def tensors_on(self, layers: range) -> int:
        """The KV tensors a pipeline stage of decoder layers `layers` allocates: one per attention layer of a
        one-group model; else the most slots its layers use (kv_groups' slot j is tensor j)."""
        owned = [i for i, layer in enumerate(self.layers or range(len(self.layer_slots))) if layer in layers]
        if not self.is_hybrid:
            return len(owned)
        return max((self.layer_slots[i][1] + 1 for i in owned), default=0)

    def slot_of(self, decoder_layer: int) -> tuple[int, int]:
        """(group, KV tensor) of the attention in decoder layer `decoder_layer`."""
        index = self.layers.index(decoder_layer) if self.layers else decoder_layer
        return self.layer_slots[index]


def kv_groups(windows: Sequence[int | None], layers: Sequence[int] = ()) -> KVGroups:
    """Group the attention layers (each one's window, in layer order) by kind: group_size is the fewest
    layers of any kind, each kind fills ceil(count / group_size) groups (the last one's unused slots are
    memory no layer uses), and a kind's m-th layer goes to slot m % group_size of its (m // group_size)-th group."""
    kinds = sorted(dict.fromkeys(windows), key=lambda w: (w is not None, w or 0))  # full attention first
    if len(kinds) <= 1:
        return KVGroups(tuple(kinds) or (None,), tuple((0, j) for j in range(len(windows))), max(len(windows), 1),
                        tuple(layers))
    counts = {kind: sum(1 for w in windows if w == kind) for kind in kinds}
    size = min(counts.values())
    first_group: dict[int | None, int] = {}
    group_windows: list[int | None] = []
    for kind in kinds:
        first_group[kind] = len(group_windows)
        group_windows.extend([kind] * -(-counts[kind] // size))
    seen = dict.fromkeys(kinds, 0)
    slots = []
    for window in windows:
        m = seen[window]
        seen[window] += 1
        slots.append((first_group[window] + m // size, m % size))
    return KVGroups(tuple(group_windows), tuple(slots), size, tuple(layers))


def model_kv_groups(config: dict, num_layers: int | None = None, types: Sequence[str] | None = None) -> KVGroups:
    """The groups of a (text) config.json's attention layers (`num_layers`: its decoder layers, where
    config.json names them otherwise than num_hidden_layers; `types`: its layer types, as already read)."""
    windows, layers = attention_windows(config, num_layers, types)
    return kv_groups(windows, layers)


def attention_windows(config: dict, num_layers: int | None = None,
                      types: Sequence[str] | None = None) -> tuple[tuple[int | None, ...], tuple[int, ...]]:
    """Each attention layer's window from a (text) config.json, in layer order, as transformers applies
    config.sliding_window (hf_config.WINDOW_RULES), and its index among the decoder layers; layers of linear
    attention have no KV and no entry."""
    num_layers = num_layers or int(config.get("num_hidden_layers") or 0)
    types = layer_types(config) if types is None else types
    attention = [i for i in range(num_layers) if types is None or types[i] != "linear_attention"]
    window = config.get("sliding_window")
    rule = next((WINDOW_RULES[a] for a in config.get("architectures") or () if a in WINDOW_RULES), None)
    if not window or rule is None or (rule == "qwen" and not config.get("use_sliding_window", False)):
        return (None,) * len(attention), tuple(attention)
    if types is not None:
        return tuple(window if types[i] == "sliding_attention" else None for i in attention), tuple(attention)
    if rule == "qwen":
        first = config.get("max_window_layers", 28)
        return tuple(window if i >= first else None for i in attention), tuple(attention)
    return tuple(window if rule == "every" else None for i in attention), tuple(attention)


def max_blocks_per_request(num_tokens: int, block_size: int, window: int | None, max_chunk: int) -> int:
    """The most KV blocks one request computing `num_tokens` tokens in chunks of at most `max_chunk`
    holds at once, as runtime/core/block_manager.py allocates them in a group with that window.
    Without a window: every block. With one, a step computing tokens [c, c + n) holds blocks
    floor((c - window + 1) / block_size) .. ceil((c + n) / block_size) - 1:

        positions:  0 .. c-w | c-w+1 ........ c-1 | c ..... c+n-1
                    freed    | seen by query c    | this step's chunk
                    (whole blocks only: a block straddling c-w+1 stays)

    The largest count over every c: a chunk starting where freeing has not begun (c < window - 1),
    one whose oldest seen token is the last of its block, or the request's last chunk."""
    full = -(-num_tokens // block_size)
    if window is None or window >= num_tokens:
        return full
    chunk = min(max_chunk, num_tokens)
    unfreed = min(window - 2, num_tokens - chunk)  # the largest full-size chunk's c before freeing starts
    best = -(-(unfreed + chunk) // block_size) if unfreed >= 0 else 0
    last = num_tokens - chunk - window + 1  # the largest c - window + 1 among full-size chunks
    if last >= 0:
        best = max(best, -(-(min(last, block_size - 1) + window - 1 + chunk) // block_size))
    first_short = max(0, num_tokens - chunk + 1)  # chunks from here on are cut short by num_tokens
    if first_short <= num_tokens - 1:
        best = max(best, full - max(0, first_short - window + 1) // block_size)
    return best


def max_pages_per_request(windows: Sequence[int | None], num_tokens: int, block_size: int, max_chunk: int) -> int:
    """The most pages one request of `num_tokens` tokens holds at once: each group's blocks, by the rule of
    max_blocks_per_request for its window."""
    return sum(max_blocks_per_request(num_tokens, block_size, window, max_chunk) for window in windows)


def longest_fitting_len(num_pages: int, block_size: int, windows: Sequence[int | None], max_chunk: int, limit: int,
                        num_requests: int = 1) -> int | None:
    """`--max-model-len auto`: the longest max_model_len, at most `limit` (the model's), for which
    `num_requests` requests fit in `num_pages` at once; None when not even one token does."""
    def fits(length: int) -> bool:
        return num_requests * max_pages_per_request(windows, length, block_size, max_chunk) <= num_pages

    if not fits(1):
        return None
    low, high = 1, limit  # fits(low); the count grows with the length, so bisect
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def kv_tokens(num_pages: int, block_size: int, windows: Sequence[int | None], max_chunk: int, length: int) -> int:
    """Tokens a pool of num_pages holds as requests of `length` tokens: num_pages x block_size when every layer
    keeps every token, more where windowed groups hold only their window."""
    return tokens_held(num_pages, block_size, length, max_pages_per_request(windows, length, block_size, max_chunk))


def pages_without_kv(max_num_seqs: int, windows: Sequence[int | None], max_model_len: int, block_size: int,
                     max_chunk: int) -> int:
    """A model none of whose layers keeps KV (recurrent layers only) still schedules by pages, which cost
    nothing: enough for max_num_seqs requests of max_model_len."""
    return max_num_seqs * max_pages_per_request(windows, max_model_len, block_size, max_chunk)


def tokens_held(num_pages: int, block_size: int, length: int, pages_per_request: int) -> int:
    """num_pages as tokens of requests of `length` tokens that each hold pages_per_request pages."""
    return num_pages * -(-length // block_size) * block_size // max(1, pages_per_request)
