"""Speculative decoding on hybrid models (Qwen3.5, Qwen3-Next: Gated DeltaNet layers with a state per request): a
verify step keeps each layer's state after every token it ran, and the next step takes the one the kept drafts
reach, so the tokens are those without speculation however many drafts were rejected."""

from __future__ import annotations


import pytest

from shardserve.planner.speculative import SpeculativeConfig
from shardserve.runtime import LLM, SamplingParams
from test_spec_decode import PROMPTS, generate, same_logprobs

NUM_LAYERS = 4  # three linear-attention layers, then full attention
NGRAM = SpeculativeConfig("ngram", 3, prompt_lookup_max=3, prompt_lookup_min=1).to_json()
ALLOWED = [7, 8, 9]  # sampled among three ids, a random model's output repeats: lookup drafts, some kept, some not


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, allowed_token_ids=ALLOWED, logprobs=2),
    SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True, allowed_token_ids=ALLOWED, seed=3),
], ids=["greedy", "seeded"])
def test_rejected_drafts_leave_no_trace_in_the_recurrent_state(checkpoint_factory, family, params):
    folder, _ = checkpoint_factory(family, num_layers=NUM_LAYERS)
    plain, plain_logprobs, _ = generate(folder, params, max_num_seqs=8)
    tokens, logprobs, stats = generate(folder, params, NGRAM, max_num_seqs=8)
    spec = stats.spec_decode
    assert tokens == plain
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens  # both kinds of step ran
    if params.logprobs:
        assert same_logprobs(logprobs, plain_logprobs, tokens)


def test_preempted_requests_start_their_states_again(checkpoint_factory, kv_bytes_for):
    folder, _ = checkpoint_factory("qwen3_5", num_layers=NUM_LAYERS)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, allowed_token_ids=ALLOWED)
    prompts = PROMPTS + [p[::-1] for p in PROMPTS]
    plain, _, _ = generate(folder, params, prompts=prompts)
    settings = dict(device="cpu", max_model_len=96, max_num_seqs=8, block_size=4, skip_tokenizer_init=True,
                    speculative_config=NGRAM)
    with LLM(folder, kv_cache_memory_bytes=1 << 22, **settings) as llm:  # what the states (five a slot) take
        states = (1 << 22) - llm.kv_cache_info.num_blocks * llm.kv_cache_info.bytes_per_block
    tokens, _, stats = generate(folder, params, NGRAM, prompts=prompts, max_model_len=96, max_num_seqs=8,
                                kv_cache_memory_bytes=states + kv_bytes_for(folder, 30, 4))
    assert tokens == plain and stats.num_preemptions > 0 and stats.spec_decode.num_accepted_tokens > 0


@pytest.mark.slow
def test_tensor_parallel_ranks_keep_their_shares_of_the_states(checkpoint_factory):
    folder, _ = checkpoint_factory("qwen3_5", num_layers=NUM_LAYERS)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, allowed_token_ids=ALLOWED)
    plain, _, _ = generate(folder, params, max_num_seqs=8)
    tokens, _, stats = generate(folder, params, NGRAM, max_num_seqs=8, tensor_parallel_size=2,
                                distributed_executor_backend="mp")
    assert tokens == plain and stats.spec_decode.num_accepted_tokens > 0


def test_the_plan_sizes_the_pool_the_engine_makes(checkpoint_factory):
    """plan = launch: the states' copies for verify steps come out of the same memory in both."""
    from shardserve.planner import PlanOptions, load_model, make_plan, parse_declared

    folder, _ = checkpoint_factory("qwen3_5", num_layers=NUM_LAYERS)
    settings = dict(kv_cache_memory_bytes=1 << 22, block_size=4, max_model_len=96, max_num_seqs=8)
    plan = make_plan(load_model(folder), parse_declared("cpu"), PlanOptions(speculative_config=NGRAM, **settings))
    plain = make_plan(load_model(folder), parse_declared("cpu"), PlanOptions(**settings))
    with LLM(folder, device="cpu", speculative_config=NGRAM, **settings) as llm:
        assert llm.kv_cache_info.num_blocks == plan.record().memory.num_blocks < plain.record().memory.num_blocks
