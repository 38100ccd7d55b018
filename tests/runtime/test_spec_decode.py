"""Speculative decoding (n-gram prompt lookup): the same tokens as without it, greedy and seeded, with logprobs,
penalties, preemption, prefix caching and tensor parallel; its refusals and its counters."""

from __future__ import annotations

import random
import re

import pytest
from prometheus_client.core import CounterMetricFamily

from shardserve.launch.server.metrics import spec_decode_families
from shardserve.planner.settings import SettingError
from shardserve.runtime import LLM, SamplingParams
from shardserve.planner.speculative import SpeculativeConfig
from shardserve.runtime.core.request import Request
from shardserve.runtime.core.spec_decode import (TokenHistory, allowed_drafts, propose_ngram, propose_ngram_reference,
                                                 verify)

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7], [11, 12, 13, 11, 12, 13, 11, 12], [20, 21, 22, 23],
           [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]]


def generate(folder: str, params: SamplingParams, spec: str | None = None, prompts=PROMPTS, **kwargs):
    """(token ids, logprobs, the engine's spec-decode counters, preemptions) of each prompt's first sample."""
    settings = dict(device="cpu", max_model_len=256, kv_cache_memory_bytes=1 << 22, block_size=4,
                    skip_tokenizer_init=True) | kwargs
    with LLM(folder, speculative_config=spec, **settings) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        stats = llm.engine.get_stats()
    completions = [o.outputs[0] for o in outputs]
    return [c.token_ids for c in completions], [c.logprobs for c in completions], stats


def same_logprobs(a, b, tokens) -> bool:
    return all(abs(x[t].logprob - y[t].logprob) < 1e-4 and x.keys() == y.keys()
               for rows_a, rows_b, row_tokens in zip(a, b, tokens) for x, y, t in zip(rows_a, rows_b, row_tokens))


@pytest.mark.parametrize("tokens, k, expected", [
    ([1, 2, 3, 4, 1, 2, 3], 3, (4, 1, 2)),  # the longest recurring suffix, 3 tokens
    ([1, 2, 3, 9, 2, 3, 5, 2, 3], 2, (5, 2)),  # the latest earlier occurrence of "2 3"
    ([1, 2, 3, 4], 3, ()),  # nothing recurs
    ([7, 7, 7], 4, (7,)),  # what follows the match, as far as it goes
])
def test_ngram_proposals(tokens, k, expected):
    assert propose_ngram(tokens, k, 2, 3) == expected


def test_the_vectorized_lookup_is_the_plain_loops():
    """Random histories over small vocabularies (many recurrences, overlapping ones too) and every lookup range."""
    rng = random.Random(0)
    for _ in range(3000):
        vocab = rng.choice([2, 3, 7, 50])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        k, high = rng.randrange(1, 6), rng.randrange(1, 7)
        low = rng.randrange(1, high + 1)
        assert propose_ngram(tokens, k, low, high) == propose_ngram_reference(tokens, k, low, high), (tokens, k, low, high)


def test_a_requests_token_history_follows_its_tokens():
    request = Request("r", [3, 4, 5], SamplingParams(max_tokens=10), seed=0)
    history = TokenHistory()
    assert history.of(request).tolist() == [3, 4, 5]
    for token in range(6, 30):  # grown past its first array, a token or several at a time
        request.output_token_ids.append(token)
        if token % 3 == 0:
            assert history.of(request).tolist() == request.all_token_ids


def test_verify_keeps_drafts_up_to_the_first_the_target_did_not_sample():
    # rows: r0 (no drafts), then r1's 4 rows for 3 drafts: the target agrees on two, then samples 8
    sampled, accepted, _, _ = verify(["r0", "r1", "r1", "r1", "r1"], [4, 5, 6, 8, 9], {"r1": (1, (5, 6, 7))}, {})
    assert sampled == {"r0": 4, "r1": 8} and accepted == {"r1": (5, 6)}


@pytest.mark.parametrize("value, message", [
    ("{", "not JSON"),
    ('{"method": "ngram", "quantization": "fp8", "num_speculative_tokens": 3}', "quantization not served"),
    ('{"method": "eagle3", "num_speculative_tokens": 3}', "method eagle3 needs model"),
    ('{"method": "eagle", "num_speculative_tokens": 3}', "'eagle' (EAGLE (EAGLE-3 is served)) is not served yet"),
    ('{"method": "medusa", "num_speculative_tokens": 1}', "(Medusa) is not served yet"),
    ('{"method": "mtp", "model": "m", "num_speculative_tokens": 1}', "model applies to method draft_model or eagle3"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "from 1 to 64"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3}', "above"),
])
def test_bad_configs_are_refused_by_key(value, message):
    with pytest.raises(ValueError, match="speculative_config: .*" + message.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig.parse(value)


def test_speculation_is_refused_where_it_cannot_run(checkpoint_factory):
    folder, _ = checkpoint_factory("llama3")
    with pytest.raises(SettingError, match="speculative_config cannot run with async_scheduling"):
        LLM(folder, device="cpu", kv_cache_memory_bytes=1 << 22, speculative_config=NGRAM, async_scheduling=True)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.9, max_tokens=60, ignore_eos=True, seed=7, logprobs=1),
    SamplingParams(temperature=0.8, top_k=20, max_tokens=60, ignore_eos=True, repetition_penalty=1.2,
                   frequency_penalty=0.3),  # the engine's seeds; penalties see the drafts as history
], ids=["greedy", "seeded", "penalties"])
@pytest.mark.parametrize("model", ["random", "cycle"])
def test_tokens_and_logprobs_are_the_same_as_without_speculation(model, params, checkpoint_factory,
                                                                 cycle_checkpoint):
    """Rejection sampling with one-token drafts keeps the target's distribution, and more: each row's draw is
    the one its output index gets without speculation, so every sample is the same, token for token."""
    folder = checkpoint_factory("llama3")[0] if model == "random" else cycle_checkpoint
    plain, plain_logprobs, _ = generate(folder, params)
    tokens, logprobs, stats = generate(folder, params, NGRAM)
    assert tokens == plain
    if params.logprobs:
        assert same_logprobs(logprobs, plain_logprobs, tokens)
    spec = stats.spec_decode
    assert spec.num_drafts > 0 and spec.num_draft_tokens >= spec.num_accepted_tokens
    if model == "cycle" and params.temperature == 0.0:  # it repeats itself: nearly every draft lands
        assert spec.num_accepted_tokens >= 0.9 * spec.num_draft_tokens
        assert spec.accepted_per_position[0] >= spec.accepted_per_position[-1] > 0


def test_preemption_and_prefix_caching_keep_the_tokens(cycle_checkpoint, kv_bytes_for):
    """A pool too small for every request at once: the newest are preempted (their drafts with them) and
    recomputed, partly from the prefix cache; the tokens stay those of a pool big enough for all."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = PROMPTS + [p[::-1] for p in PROMPTS]
    plain, _, _ = generate(cycle_checkpoint, params, prompts=prompts)
    tight = kv_bytes_for(cycle_checkpoint, 40, 4)
    tokens, _, stats = generate(cycle_checkpoint, params, NGRAM, prompts=prompts, kv_cache_memory_bytes=tight,
                                enable_prefix_caching=True, max_model_len=80)
    assert tokens == plain
    assert stats.num_preemptions > 0 and stats.spec_decode.num_accepted_tokens > 0


def test_counters_are_vllms_spec_decode_metrics(cycle_checkpoint):
    _, _, stats = generate(cycle_checkpoint, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), NGRAM)
    families = {f.name: f for f in spec_decode_families("m", [stats])}
    assert all(isinstance(f, CounterMetricFamily) for f in families.values())
    value = {name: f.samples[0].value for name, f in families.items() if name != "vllm:spec_decode_num_accepted_tokens_per_pos"}
    spec = stats.spec_decode
    assert value == {"vllm:spec_decode_num_drafts": spec.num_drafts,
                     "vllm:spec_decode_num_draft_tokens": spec.num_draft_tokens,
                     "vllm:spec_decode_num_accepted_tokens": spec.num_accepted_tokens}
    per_position = families["vllm:spec_decode_num_accepted_tokens_per_pos"].samples
    assert [s.labels["position"] for s in per_position] == ["0", "1", "2", "3"]
    assert sum(s.value for s in per_position) == spec.num_accepted_tokens
    _, _, plain = generate(cycle_checkpoint, SamplingParams(max_tokens=2))
    assert plain.spec_decode is None and list(spec_decode_families("m", [plain])) == []  # off: no series


@pytest.mark.slow
def test_tensor_parallel_ranks_verify_the_same_drafts(cycle_checkpoint, checkpoint_factory):
    """tp 2 over mp ranks: every rank builds the drafts' rows, the output rank verifies; same tokens as tp 1."""
    for folder in (cycle_checkpoint, checkpoint_factory("llama3")[0]):
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        plain, _, _ = generate(folder, params)
        tokens, _, stats = generate(folder, params, NGRAM, tensor_parallel_size=2, distributed_executor_backend="mp")
        assert tokens == plain and stats.spec_decode.num_drafts > 0


@pytest.mark.slow
def test_pipeline_stages_carry_the_drafts_to_the_stage_that_verifies_them(cycle_checkpoint, checkpoint_factory,
                                                                         kv_bytes_for):
    """pp 2 over mp ranks (batches in flight at once): the first stage embeds the drafts' rows, the last verifies
    them; the same tokens as one rank without speculation, across preemption too."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1)
    pp = dict(pipeline_parallel_size=2, distributed_executor_backend="mp")
    for folder in (cycle_checkpoint, checkpoint_factory("llama3")[0]):
        plain, plain_logprobs, _ = generate(folder, params)
        tokens, logprobs, stats = generate(folder, params, NGRAM, **pp)
        assert tokens == plain and stats.spec_decode.num_accepted_tokens > 0
        assert same_logprobs(logprobs, plain_logprobs, tokens)
    prompts = PROMPTS + [p[::-1] for p in PROMPTS]
    plain, _, _ = generate(cycle_checkpoint, params, prompts=prompts)
    tokens, _, stats = generate(cycle_checkpoint, params, NGRAM, prompts=prompts, max_model_len=80,
                                kv_cache_memory_bytes=kv_bytes_for(cycle_checkpoint, 40, 4), **pp)
    assert tokens == plain and stats.num_preemptions > 0


def test_a_grammar_keeps_the_drafts_it_allows_and_its_matcher_where_it_was():
    import xgrammar as xgr

    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(["a", "b", "c", "</s>"], stop_token_ids=[3])).compile_regex("ab{0,5}c")
    matcher = xgr.GrammarMatcher(compiled)
    assert allowed_drafts(matcher, (0, 1, 1, 2, 3)) == (0, 1, 1, 2)  # the stop token would end it: not kept
    assert allowed_drafts(matcher, (0, 2, 2)) == (0, 2)  # "c" ends the regex: a second is refused
    assert allowed_drafts(matcher, (1, 0)) == ()  # it must start with "a"
    mask = xgr.allocate_token_bitmask(1, 4)
    matcher.fill_next_token_bitmask(mask, 0)
    assert mask.tolist() == [[1]]  # still at the start: only "a" (bit 0)


@pytest.mark.parametrize("seed", [None, 3], ids=["greedy", "seeded"])
def test_requests_under_a_grammar_draft_what_it_allows_and_sample_as_without(seed):
    """Each row of a request under a grammar samples under the grammar's state after the drafts before it, so
    its tokens are those it samples without speculation; a repetitive grammar's drafts land."""
    from shardserve.launch.demo import DEMO_MODEL_DIR
    from shardserve.runtime.core.structured_output import StructuredOutputs

    phrase = "The cache keeps recent blocks. "
    prompt = f"Copy the text. {phrase * 2}Copy: {phrase}"
    grammar = StructuredOutputs("regex", f"({re.escape(phrase)}){{4}}")
    params = [SamplingParams(temperature=0.0 if seed is None else 1.0, seed=seed, max_tokens=160,
                             structured_outputs=grammar),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    def run(spec, which):
        with LLM(str(DEMO_MODEL_DIR), device="cpu", kv_cache_memory_bytes=1 << 25, speculative_config=spec) as llm:
            outputs = llm.generate([prompt] * len(which), [params[i] for i in which])
            return [o.outputs[0] for o in outputs], llm.engine.get_stats().spec_decode

    plain, _ = run(None, (0, 1))
    both, _ = run(NGRAM, (0, 1))
    assert [o.token_ids for o in both] == [o.token_ids for o in plain]
    assert re.fullmatch(f"({re.escape(phrase)}){{4}}", both[0].text)
    _, alone = run(NGRAM, (0,))  # the phrase again and again: many of the grammar's tokens were drafts
    assert alone.num_accepted_tokens >= 10
