"""Structured outputs through xgrammar (as vLLM and SGLang): the grammar of a request, checked (its
size too) when the request arrives and compiled in a worker thread of the engine's process before the engine
takes it (GrammarCompile: the core's loop holds the request meanwhile); a matcher
per request in the engine fills the step's bitmask of allowed tokens, which the sampling rank applies to
the logits before each draw, and advances by the sampled token.

    StructuredOutputs(kind, spec)   kind: json (spec: a JSON schema), json_object, regex, choice
                                    (spec: the choices), grammar (spec: EBNF)

NOTE: JSON is generated without free whitespace (xgrammar's any_whitespace=False): the shortest form,
so a small max_tokens still closes the object."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# The largest grammar a request may bring. NOTE: compile time grows faster than the size, whatever the
# vocabulary (on an idle core: 2,000 choices of 32 characters in 0.2 s, 5,000 of 40 in 1 s, 20,000 of 40
# in 10 s; a JSON schema of 128 KiB in 0.5 s; several times that on a busy machine): these keep a compile
# well under a second, far above what structured outputs are used for in practice.
MAX_CHOICES = 2048
MAX_CHOICE_CHARS = 65_536  # all the choices together
MAX_SCHEMA_CHARS = 131_072  # a JSON schema, serialized
MAX_SCHEMA_DEPTH = 64  # objects and arrays nested in a JSON schema
MAX_REGEX_CHARS = 16_384
MAX_GRAMMAR_CHARS = 65_536  # an EBNF grammar
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def schema_text(schema: dict) -> str:
    """A JSON schema as StructuredOutputs keeps it (one text per schema: the compile cache's key)."""
    return json.dumps(schema, sort_keys=True)


@dataclass(frozen=True)
class StructuredOutputs:
    kind: str
    spec: str | tuple[str, ...] | None = None  # schema JSON text, regex, choices, or EBNF
    # the grammar applies from the token after these (a reasoning model's "</think>"); before, output is free
    starts_after: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind {self.kind!r}: one of {', '.join(KINDS)}")
        if isinstance(self.spec, dict):  # a JSON schema given as a mapping
            object.__setattr__(self, "spec", schema_text(self.spec))
        if isinstance(self.spec, list):
            object.__setattr__(self, "spec", tuple(self.spec))
        if self.starts_after is not None:
            if not self.starts_after:
                raise ValueError("starts_after needs at least one token id")
            object.__setattr__(self, "starts_after", tuple(self.starts_after))

    @property
    def num_chars(self) -> int:
        """The grammar's size in characters (all its choices together)."""
        if isinstance(self.spec, tuple):
            return sum(len(choice) for choice in self.spec)
        return len(self.spec or "")

    def check_size(self) -> None:
        """A ValueError naming the limit when the grammar is larger than this engine takes."""
        spec = self.spec
        if isinstance(spec, tuple):  # choice
            _at_most(len(spec), MAX_CHOICES, "choices")
            _at_most(self.num_chars, MAX_CHOICE_CHARS, "characters in all its choices")
        elif isinstance(spec, str) and self.kind == "json":
            _at_most(len(spec), MAX_SCHEMA_CHARS, "characters in its JSON schema")
            _at_most(_json_depth(spec), MAX_SCHEMA_DEPTH, "levels of nesting in its JSON schema")
        elif isinstance(spec, str):
            _at_most(len(spec), MAX_REGEX_CHARS if self.kind == "regex" else MAX_GRAMMAR_CHARS,
                     f"characters in its {self.kind}")

    @lru_cache(maxsize=256)  # NOTE: a repeated schema is parsed once (the record is frozen, hashable)
    def grammar(self):
        """xgrammar's Grammar for this request; a ValueError says what is wrong with it."""
        import xgrammar as xgr

        self.check_size()
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
            raise ValueError(f"the {self.kind} structured output is invalid: {_reason(error)}") from None


_SOURCE_PLACE = re.compile(r"\[[\d:.]+\]\s*|\S+\.(?:cc|cpp|h|py):\d+:\s*")  # xgrammar's "[08:15:22] /x/y.cc:83: "


def _reason(error: BaseException) -> str:
    """xgrammar's message, without the time and source file it begins with."""
    return _SOURCE_PLACE.sub("", str(error)).strip()


def _escape(text: str) -> str:
    return "".join(f"\\{c}" if c in r".^$*+?()[]{}|\/-" else c for c in text)


def _at_most(size: int, limit: int, what: str) -> None:
    if size > limit:
        raise ValueError(f"the structured output has {size} {what}: at most {limit} are allowed "
                         "(the limit on a grammar's size)")


def _json_depth(text: str) -> int:
    """How deeply objects and arrays nest in JSON text (brackets inside strings do not count)."""
    depth = deepest = 0
    for bracket in re.findall(r"[\[\]{}]", _JSON_STRING.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


_COMPILERS: dict[tuple[str, int], object] = {}  # (model folder, vocab size) -> its GrammarCompiler
_COMPILERS_LOCK = threading.Lock()
_NUM_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
# Two lanes: a grammar of at most QUICK_GRAMMAR_CHARS compiles in milliseconds (a few hundred choices, a schema
# of a hundred fields) and never waits behind a large one; large ones take at most half the cores (xgrammar's
# threads), so the engine's steps go on meanwhile
QUICK_GRAMMAR_CHARS = 4096
_QUICK_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-quick")
_LARGE_POOL = ThreadPoolExecutor(max_workers=max(1, min(2, _NUM_CORES // 2)), thread_name_prefix="grammar-large")
_COMPILE_THREADS = max(1, min(8, _NUM_CORES // 4))
COMPILE_CACHE_BYTES = 512 << 20  # compiled grammars kept for reuse, per process


def shared_compiler(model_config, tokenizer):
    """This process's xgrammar compiler for a model's tokenizer (the caller's). NOTE: one per process, so a grammar
    compiled before its request reaches the engine (GrammarCompile) is a cache hit for the
    engine's matchers (xgrammar caches compiled grammars by their text)."""
    import xgrammar as xgr

    from shardserve.runtime.tokenizer import eos_token_ids

    key = (model_config.model, model_config.vocab_size)
    with _COMPILERS_LOCK:
        if key not in _COMPILERS:
            stop_ids = sorted(eos_token_ids(model_config, tokenizer)) or None
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model_config.vocab_size,
                                                      stop_token_ids=stop_ids)
            _COMPILERS[key] = xgr.GrammarCompiler(info, max_threads=_COMPILE_THREADS,
                                                  cache_limit_bytes=COMPILE_CACHE_BYTES)
        return _COMPILERS[key]


def prepare_compiler(model_config, tokenizer) -> None:
    """Make this process's compiler now, in a process that is about to serve streams: made by the first
    request with a grammar instead (xgrammar imported, the vocabulary read), it took the GIL for a few
    hundred ms while other streams ran. Nothing where no grammar can run (no tokenizer, a pooling runner)."""
    if tokenizer is not None and model_config.runner != "pooling":
        shared_compiler(model_config, tokenizer)


def prepare_checks() -> None:
    """Import xgrammar now, in a process about to serve streams that checks grammars (StructuredOutputs.grammar)
    without compiling them: imported by the first request with a grammar instead, it held the GIL for a few
    hundred ms while other streams ran."""
    import xgrammar  # noqa: F401


def compiled_grammar(model_config, tokenizer, outputs: StructuredOutputs):
    """The request's grammar compiled with this process's compiler (a cache hit after the first time)."""
    return shared_compiler(model_config, tokenizer).compile_grammar(outputs.grammar())


class GrammarCompileTimeout(ValueError):
    """A grammar took longer to compile than its request allowed (the server's --grammar-compile-timeout)."""


class GrammarCompile:
    """A grammar compiling in a worker thread of its lane (xgrammar releases the GIL while it compiles), so the
    engine's steps go on meanwhile; the engine's matcher then finds it in the cache. Its time is counted from the
    moment a thread starts on it, not while it waits behind other grammars of its lane. NOTE: a started compile
    cannot be stopped (xgrammar has no way to, and its result cannot cross processes: a compiled schema of 300
    fields is 30 MB of JSON that takes longer to write and read than to compile): one given up on (cancel, timed
    out) finishes and stays cached, holding a thread of the large lane only; one not yet started is dropped."""

    def __init__(self, model_config, tokenizer, outputs: StructuredOutputs):
        self.started: float | None = None
        self.seconds: float | None = None  # how long it took, once done
        pool = _QUICK_POOL if outputs.num_chars <= QUICK_GRAMMAR_CHARS else _LARGE_POOL
        self.future = pool.submit(self._run, model_config, tokenizer, outputs)

    def _run(self, model_config, tokenizer, outputs: StructuredOutputs) -> None:
        self.started = time.monotonic()
        try:
            compiled_grammar(model_config, tokenizer, outputs)
        finally:
            self.seconds = time.monotonic() - self.started

    def is_over(self, timeout: float | None) -> bool:
        """Compiled, failed, or compiling for longer than `timeout` (None: no limit)."""
        return self.future.done() or (timeout is not None and self.started is not None
                                      and time.monotonic() - self.started > timeout)

    def error(self, timeout: float | None) -> BaseException | None:
        """Once it is over: why the request cannot have its grammar (it failed, or took too long), or None."""
        if not self.future.done() or (timeout is not None and self.seconds is not None and self.seconds > timeout):
            return GrammarCompileTimeout(f"the grammar takes more than {timeout:g} s to compile")
        return self.future.exception()

    def cancel(self) -> None:
        self.future.cancel()


@dataclass(frozen=True, slots=True)
class GrammarBitmask:
    """What each request under a grammar may sample next, filled by the engine for one step: row i is
    request_ids[i]'s. A request with drafts has a row for each row it samples, in order: the grammar's state
    before its drafts, then after each (the scheduler kept only drafts the grammar allows).
    rows: [len(request_ids), ceil(vocab_size / 32)] int32, a set bit allows a token."""

    request_ids: tuple[str, ...]
    rows: Any  # a CPU torch.Tensor


def grammar_bitmask(requests: list, model_config, tokenizer,
                    drafts: dict[str, tuple[int, ...]] | None = None) -> GrammarBitmask | None:
    """The engine's side: rows for each of the step's requests under a grammar (its matcher is made the
    first time it is scheduled and lives with the Request, so preemption keeps its place). NOTE: the
    matchers live with the scheduler, as in vLLM v1, so a grammar compiles in the engine's process,
    ahead of its request (GrammarCompile, in the core's loop), and never in a step on a worker rank."""
    constrained = [r for r in requests if r.sampling_params.structured_outputs is not None and _has_started(r)]
    if not constrained:
        return None
    import xgrammar as xgr

    drafts = drafts or {}
    rows = xgr.allocate_token_bitmask(sum(1 + len(drafts.get(r.request_id, ())) for r in constrained),
                                      model_config.vocab_size)
    request_ids: list[str] = []
    for request in constrained:
        if request.grammar_matcher is None:
            compiled = compiled_grammar(model_config, tokenizer, request.sampling_params.structured_outputs)
            request.grammar_matcher = xgr.GrammarMatcher(compiled)
        matcher, own = request.grammar_matcher, drafts.get(request.request_id, ())
        for token in (None, *own):  # the state now, then after each draft
            if token is not None and not matcher.accept_token(token):
                raise AssertionError(f"draft {token} of {request.request_id} is one its grammar refuses")
            matcher.fill_next_token_bitmask(rows, len(request_ids))
            request_ids.append(request.request_id)
        if own:
            matcher.rollback(len(own))
    return GrammarBitmask(tuple(request_ids), rows)


def _has_started(request) -> bool:
    """Whether a request's grammar applies to its next token: from the start, or once its output has ended
    with `starts_after` (checked every step until then, so the end is never missed)."""
    after = request.sampling_params.structured_outputs.starts_after
    if after is None or request.grammar_matcher is not None:
        return True
    return tuple(request.output_token_ids[-len(after):]) == after


def accept_tokens(bitmask: GrammarBitmask, requests: dict, sampled_token_ids: dict[str, int],
                  accepted_drafts: dict[str, tuple[int, ...]]) -> None:
    """Advance the matchers of the step's requests under a grammar by the drafts they kept and the token they
    sampled."""
    for request_id in dict.fromkeys(bitmask.request_ids):
        request, token = requests.get(request_id), sampled_token_ids.get(request_id)
        if request is None or token is None:
            continue
        for kept in (*accepted_drafts.get(request_id, ()), token):
            if not request.grammar_matcher.is_terminated():
                request.grammar_matcher.accept_token(kept)


def sampling_bitmask(bitmask: GrammarBitmask | None, request_ids: list[str], vocab_size: int):
    """The worker's side: [len(request_ids), ceil(vocab_size / 32)] rows in its sampling order (a request with
    drafts takes its rows in order), all tokens allowed for requests under no grammar; None when no sampled
    request has one."""
    if bitmask is None:
        return None
    sources: dict[str, list[int]] = {}
    for source, request_id in enumerate(bitmask.request_ids):
        sources.setdefault(request_id, []).append(source)
    taken: dict[str, int] = {}
    pairs = []
    for row, request_id in enumerate(request_ids):
        if request_id in sources:
            taken[request_id] = taken.get(request_id, -1) + 1
            pairs.append((row, sources[request_id][taken[request_id]]))
    if not pairs:
        return None
    import xgrammar as xgr

    mask = xgr.allocate_token_bitmask(len(request_ids), vocab_size)  # all allowed
    mask[[row for row, _ in pairs]] = bitmask.rows[[source for _, source in pairs]]
    return mask
