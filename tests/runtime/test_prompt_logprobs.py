"""Prompt logprobs (vLLM's prompt_logprobs) are transformers' log-probabilities of each prompt token,
scored in the prefill that reads them: chunk by chunk, under tensor parallelism, with max_tokens 0."""

from __future__ import annotations

import pytest
import torch

from shardserve.runtime import LLM, SamplingParams

PROMPT = [5, 40, 77, 120, 9, 33, 250, 18, 64, 7, 91, 150, 22, 3, 48, 101, 11, 66, 200, 13]


def reference(hf_model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [logprobs[i, ids[i + 1]].item() for i in range(len(ids) - 1)]


def scores(output, ids: list[int]) -> list[float]:
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(ids)
    return [entries[token].logprob for entries, token in zip(output.prompt_logprobs[1:], ids[1:])]


def test_chunked_prefill_scores_every_prompt_token_once(checkpoint_factory, kv_bytes_for):
    folder, hf_model = checkpoint_factory("llama3")
    llm = LLM(folder, device="cpu", kv_cache_memory_bytes=kv_bytes_for(folder, 64, 4), block_size=4, max_model_len=64,
              max_num_seqs=4, max_num_batched_tokens=8)  # the 20-token prompt takes three steps
    params = SamplingParams(temperature=0, max_tokens=2, n=2, prompt_logprobs=3)
    (output,) = llm.generate({"prompt_token_ids": PROMPT}, params)
    assert scores(output, PROMPT) == pytest.approx(reference(hf_model, PROMPT), abs=1e-4)
    assert all(len(entries) >= 3 for entries in output.prompt_logprobs[1:])  # the top 3, plus the token
    (plain,) = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=2))
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == output.outputs[0].token_ids


def test_max_tokens_zero_returns_the_prompt_scores_alone(checkpoint_factory):
    folder, hf_model = checkpoint_factory("qwen2")
    llm = LLM(folder, device="cpu", kv_cache_memory_bytes=2**22)
    (output,) = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert output.outputs[0].token_ids == [] and output.outputs[0].finish_reason == "length"
    assert scores(output, PROMPT) == pytest.approx(reference(hf_model, PROMPT), abs=1e-4)


@pytest.mark.slow
def test_tensor_parallel_ranks_score_the_prompt_alike(checkpoint_factory, kv_bytes_for):
    folder, hf_model = checkpoint_factory("llama3")
    with LLM(folder, device="cpu", tensor_parallel_size=2, kv_cache_memory_bytes=kv_bytes_for(folder, 32, 16)) as llm:
        (output,) = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert scores(output, PROMPT) == pytest.approx(reference(hf_model, PROMPT), abs=1e-4)
