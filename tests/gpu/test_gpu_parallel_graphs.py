"""Decode CUDA graphs on parallel layouts, end to end through mp ranks: tp=2 (the all-reduces captured
inside each graph) and pp=2 (each stage's graphs, IntermediateTensors into static buffers) decode the
eager run's greedy tokens. Needs two GPUs: a lent single GPU skips it (the one-GPU check of a stage's
graph is test_gpu_graph_stages.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_checkpoints import VOCAB_SIZE
from shardserve.runtime import LLM, SamplingParams

PROMPTS = [np.random.default_rng(n).integers(3, VOCAB_SIZE, n).tolist() for n in (5, 40, 130, 7, 300)]
MAX_TOKENS = 16

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tp/pp CUDA graphs need two GPUs")


def generate(folder: str, enforce_eager: bool, tp: int, pp: int):
    llm = LLM(folder, dtype="bfloat16", device="cuda", max_model_len=1024, max_num_seqs=8, block_size=16,
              kv_cache_memory_bytes=256 << 20, enforce_eager=enforce_eager, skip_tokenizer_init=True,
              enable_prefix_caching=False, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              distributed_executor_backend="mp")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True)
    try:
        return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_parallel_graphs_decode_the_eager_tokens(tp, pp, gpu_checkpoint):
    folder, _ = gpu_checkpoint("llama")
    eager = generate(folder, True, tp, pp)
    graphs = generate(folder, False, tp, pp)
    for a, b in zip(eager, graphs):
        first, second = a.outputs[0], b.outputs[0]
        assert len(second.token_ids) == MAX_TOKENS
        agreed = 0
        while agreed < MAX_TOKENS and first.token_ids[agreed] == second.token_ids[agreed]:
            agreed += 1
        assert agreed >= MAX_TOKENS // 2, (first.token_ids, second.token_ids)  # a near tie may part them late
