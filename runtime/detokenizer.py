"""Incremental detokenization that holds text back until a multi-byte character is complete."""

from __future__ import annotations

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers before 0.21
    DecodeStream = None  # type: ignore[assignment,misc]  # an optional import: checked for None below

REPLACEMENT = "\ufffd"


def make_detokenizer(tokenizer, skip_special_tokens: bool = True, dropped: frozenset[int] = frozenset()):
    """The Rust stream decoder for a fast tokenizer (~1 us a token), else the window decoder. `dropped`: tokens
    left out of the text, as skip_special_tokens leaves special tokens out (decoding as if they were not there)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if DecodeStream is not None and backend is not None:
        return StreamDetokenizer(tokenizer, backend, skip_special_tokens, dropped)
    return IncrementalDetokenizer(tokenizer, skip_special_tokens, dropped)


def special_token_ids(tokenizer) -> frozenset[int]:
    """The ids that skip_special_tokens drops: the added tokens marked special."""
    return frozenset(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)


class StreamDetokenizer:
    """tokenizers' DecodeStream: one Rust call per token, holding back incomplete characters itself.
    NOTE: an id outside the tokenizer's vocabulary (a model's padded rows) would stall the stream
    for good, so it is dropped here, as decode() drops it."""

    def __init__(self, tokenizer, backend, skip_special_tokens: bool, dropped: frozenset[int] = frozenset()):
        self.tokenizer, self.backend = tokenizer, backend
        self.skip_special_tokens, self.dropped = skip_special_tokens, dropped
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.pending: list[int] = []  # ids pushed since the last text came out

    def push(self, token_id: int) -> str:
        if not 0 <= token_id < self.vocab_size or token_id in self.dropped:
            return ""
        text = self.stream.step(self.backend, token_id)
        if text is None:
            self.pending.append(token_id)
            return ""
        self.pending.clear()
        return text

    def flush(self) -> str:
        """At the end of the sample: the held-back bytes, as replacement characters."""
        text = self.tokenizer.decode(self.pending, skip_special_tokens=self.skip_special_tokens) if self.pending else ""
        self.pending.clear()
        return text


class IncrementalDetokenizer:
    """Decodes a short window of tokens each step: the tokens last shown (the prefix, context only)
    and the new ones; the new text is the window's decode minus the prefix's decode.

        window: | prefix (already emitted) | new tokens (not yet emitted) |
                0                     read_offset               len(window)

    NOTE: decoding only the window keeps the cost per token constant (tokens before the prefix are
    dropped), and decoding the prefix together with the new tokens keeps tokenizers that strip a
    leading space (SentencePiece) from dropping spaces between steps. Text ending in U+FFFD waits
    for the rest of its bytes."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True, dropped: frozenset[int] = frozenset()):
        self.tokenizer = tokenizer
        self.skip_special_tokens, self.dropped = skip_special_tokens, dropped
        self.window: list[int] = []
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _new_text(self) -> str:
        prefix_text = self._decode(self.window[:self.read_offset])
        full_text = self._decode(self.window)
        return full_text[len(prefix_text):] if len(full_text) > len(prefix_text) else ""

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        if token_id in self.dropped:
            return ""
        self.window.append(token_id)
        text = self._new_text()
        if not text or text.endswith(REPLACEMENT):
            return ""
        del self.window[:self.read_offset]  # the new tokens become the next prefix
        self.read_offset = len(self.window)
        return text

    def flush(self) -> str:
        """At the end of the sample: whatever was held back, replacement characters included."""
        text = self._new_text()
        self.window.clear()
        self.read_offset = 0
        return text
