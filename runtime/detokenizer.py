"""Incremental detokenization that holds text back until a multi-byte character is complete."""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a short window of tokens each step: the tokens already shown (`prefix`) and the new
    ones; the new text is the window's decode minus the prefix's decode.

        token ids: ... | prefix_offset ... read_offset | new tokens ... |
                         (already emitted, context)      (not yet emitted)

    NOTE: decoding only the window keeps the cost per token constant, and decoding the prefix
    together with the new tokens keeps tokenizers that strip a leading space (SentencePiece) from
    dropping spaces between steps. Text ending in U+FFFD waits for the rest of its bytes."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return full_text[len(prefix_text):]

    def flush(self) -> str:
        """At the end of the request: whatever was held back, replacement characters included."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return full_text[len(prefix_text):] if len(full_text) > len(prefix_text) else ""
