"""Greedy tokens and logits of every model family against transformers on the same weights."""

from __future__ import annotations

import random

import pytest
import torch

from runtime_checkpoints import FAMILIES, FULL_FORWARD_REFERENCE
from shardserve.runtime import LLM, SamplingParams

EOS = 1
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def random_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]


MIXED = random_prompts(1, [1, 3, 7, 16, 17, 25, 33, 40, 5, 12])
_rng = random.Random(2)
_prefixes = random_prompts(3, [24, 31])
SHARED = [_prefixes[i % 2] + [_rng.randrange(3, 300) for _ in range(i + 1)] for i in range(8)]


def reference(hf_model, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """transformers greedy continuations, cut after the first EOS like the runtime stops there."""
    results = []
    use_cache = hf_model.config.model_type not in FULL_FORWARD_REFERENCE
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                    do_sample=False, pad_token_id=2, use_cache=use_cache)[0, len(prompt):].tolist()
        results.append(out[: out.index(EOS) + 1] if EOS in out else out)
    return results


def token_outputs(llm: LLM, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, checkpoint_factory):
    folder, hf_model = checkpoint_factory(request.param)
    expected = reference(hf_model, MIXED + SHARED)
    assert len({t for seq in expected for t in seq}) > 10, "degenerate test model: outputs barely vary"
    return request.param, folder, hf_model, expected[: len(MIXED)], expected[len(MIXED):]


def test_greedy_matches_transformers(family):
    name, folder, _, expected, _ = family
    llm = LLM(folder, device="cpu", kv_cache_memory_bytes=2**24, enable_prefix_caching=False)
    assert token_outputs(llm, MIXED) == expected, name
    llm.engine.block_manager.check_integrity()
    assert llm.engine.block_manager.num_free_blocks == llm.kv_cache_info.num_blocks


def test_greedy_with_prefix_cache_hits(family):
    name, folder, _, _, expected = family
    llm = LLM(folder, device="cpu", kv_cache_memory_bytes=2**24, block_size=4)
    assert token_outputs(llm, SHARED) == expected, name
    first_hits = llm.engine.scheduler.num_prefix_hit_tokens
    assert token_outputs(llm, SHARED) == expected, name  # now every prompt's full blocks are cached
    assert llm.engine.scheduler.num_prefix_hit_tokens > first_hits + 8 * 20
    llm.engine.block_manager.check_integrity()


def test_greedy_with_preemption(family, kv_bytes_for):
    name, folder, _, expected, _ = family
    # every layer's window (8 tokens) frees blocks behind it: with chunks of 8 tokens a request holds
    # at most 5 blocks, so 6 blocks still preempt; windows on some layers (a table per kind): 14 + 5 pages
    windowed = {"mistral-window": 6, "phi3": 6, "qwen2-window": 20, "gpt_oss": 20, "gemma2": 20, "gemma3": 20}
    tight = {"max_num_batched_tokens": 8, "max_num_seqs": 8} if name in windowed else {}
    llm = LLM(folder, device="cpu", block_size=4, max_model_len=56,
              kv_cache_memory_bytes=kv_bytes_for(folder, windowed.get(name, 16), 4), **tight)
    assert token_outputs(llm, MIXED) == expected, name
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.kv_cache_usage == 0.0 and stats.num_running == 0
    llm.engine.block_manager.check_integrity()


def test_greedy_with_tiny_chunked_prefill(family):
    name, folder, _, expected, _ = family
    llm = LLM(folder, device="cpu", kv_cache_memory_bytes=2**24, block_size=4, max_num_batched_tokens=5,
              max_num_seqs=3)
    assert token_outputs(llm, MIXED) == expected, name


def test_logprobs_match_transformers_logits(family):
    """Every step's top-5 log-probabilities (raw model distribution) within 1e-4 of transformers'."""
    name, folder, hf_model, _, _ = family
    llm = LLM(folder, device="cpu", kv_cache_memory_bytes=2**24)
    for entries in logprobs_within(llm, hf_model, MIXED[3:7], 1e-4, name):
        assert len(entries) >= 5


def logprobs_within(llm, hf_model, prompts, tolerance: float, name: str) -> list[dict]:
    """Greedy top-5 log-probabilities of 4 steps per prompt, each within `tolerance` of transformers' full
    forward over prompt and output; returns every step's entries."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=4, logprobs=5, ignore_eos=True))
    steps = []
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            logits = hf_model(ids).logits[0, len(prompt) - 1: -1]  # the positions that predicted each output
        expected = torch.log_softmax(logits.float(), dim=-1)
        for step, entries in enumerate(completion.logprobs):
            for token, logprob in entries.items():
                assert abs(logprob.logprob - expected[step, token].item()) < tolerance, (name, step, token)
            steps.append(entries)
    return steps
