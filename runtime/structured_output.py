"""Structured outputs through xgrammar (as vLLM and SGLang): the grammar of a request, checked when
the request arrives, compiled once per grammar on the sampling rank, and a matcher per request that
masks the logits before each draw and advances by the sampled token.

    StructuredOutputs(kind, spec)   kind: json (spec: a JSON schema), json_object, regex, choice
                                    (spec: the choices), grammar (spec: EBNF)

NOTE: JSON is generated without free whitespace (xgrammar's any_whitespace=False): the shortest form,
so a small max_tokens still closes the object."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    kind: str
    spec: str | tuple[str, ...] | None = None  # schema JSON text, regex, choices, or EBNF

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind {self.kind!r}: one of {', '.join(KINDS)}")
        if isinstance(self.spec, dict):  # a JSON schema given as a mapping
            object.__setattr__(self, "spec", json.dumps(self.spec, sort_keys=True))
        if isinstance(self.spec, list):
            object.__setattr__(self, "spec", tuple(self.spec))

    @lru_cache(maxsize=256)  # NOTE: a repeated schema is parsed once (the record is frozen, hashable)
    def grammar(self):
        """xgrammar's Grammar for this request; a ValueError says what is wrong with it."""
        import xgrammar as xgr

        try:
            if self.kind == "json":
                return xgr.Grammar.from_json_schema(self.spec, any_whitespace=False)
            if self.kind == "json_object":
                return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
            if self.kind == "regex":
                return xgr.Grammar.from_regex(self.spec)
            if self.kind == "choice":
                if not self.spec:
                    raise ValueError("choice needs at least one string")
                return xgr.Grammar.from_regex("|".join(_escape(choice) for choice in self.spec))
            return xgr.Grammar.from_ebnf(self.spec)
        except (RuntimeError, ValueError, TypeError) as error:  # xgrammar reports bad input so
            raise ValueError(f"the {self.kind} structured output is invalid: {error}") from None


def _escape(text: str) -> str:
    return "".join(f"\\{c}" if c in r".^$*+?()[]{}|\/-" else c for c in text)


class GrammarMatchers:
    """The sampling rank's matchers, one per constrained request (rebuilt, and replayed through the
    request's outputs, when a preempted request comes back)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: frozenset[int]):
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(info)
        self.vocab_size = vocab_size
        self.matchers: dict[str, object] = {}
        self._compiled = lru_cache(maxsize=256)(lambda outputs: self.compiler.compile_grammar(outputs.grammar()))

    def add(self, request_id: str, outputs: StructuredOutputs, output_token_ids: list[int]) -> None:
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self._compiled(outputs))
        for token in output_token_ids:
            matcher.accept_token(token)
        self.matchers[request_id] = matcher

    def remove(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def bitmask(self, request_ids: list[str]):
        """[rows, vocab / 32] int32 allowed tokens per row (all allowed for unconstrained rows), or None."""
        import xgrammar as xgr

        rows = [(row, self.matchers[r]) for row, r in enumerate(request_ids) if r in self.matchers]
        if not rows:
            return None
        mask = xgr.allocate_token_bitmask(len(request_ids), self.vocab_size)  # all allowed
        for row, matcher in rows:
            matcher.fill_next_token_bitmask(mask, row)
        return mask

    def accept(self, request_ids: list[str], tokens: list[int]) -> None:
        for request_id, token in zip(request_ids, tokens):
            matcher = self.matchers.get(request_id)
            if matcher is not None and not matcher.is_terminated():
                matcher.accept_token(token)


def sync_matchers(matchers: GrammarMatchers, output, states: dict) -> None:
    """Follow the step's diff: forget finished (and preempted) requests, start matchers for new ones
    (a request back from preemption replays its outputs)."""
    for request_id in output.finished_request_ids:
        matchers.remove(request_id)
    for data in output.new_requests:
        structured = data.sampling_params.structured_outputs
        if structured is not None:
            state = states[data.request_id]
            matchers.add(data.request_id, structured, state.token_ids[state.num_prompt_tokens:])
