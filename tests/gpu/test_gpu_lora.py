"""LoRA on a GPU: the Triton gathered matmul against its torch reference at serving sizes, and an engine in
float32 whose mixed-adapter batches give transformers' greedy tokens with each PEFT adapter merged (decode
runs eagerly with adapters: the plan says so)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardserve.runtime import LLM, SamplingParams
from shardserve.runtime.layers.lora_batch import lora_batch
from shardserve.runtime.layers.lora_ops import gathered_matmul_reference
from shardserve.runtime.layers.triton_lora import lora_gathered_matmul
from shardserve.runtime.lora_request import LoRARequest
from test_gpu_model import PROMPTS
from tests.runtime.lora_adapters import ALL_MODULES, save_adapter

PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [7, 300])
def test_shrink_and_expand_match_the_reference(dtype, num_tokens):
    rng = np.random.default_rng(num_tokens)
    slots = rng.integers(-1, 4, num_tokens)
    batch = lora_batch(slots, 4, "cuda")
    x = torch.randn(num_tokens, 4096, dtype=dtype, device="cuda")
    a = torch.randn(4, 3, 16, 4096, dtype=dtype, device="cuda") / 64
    b = torch.randn(4, 6144, 16, dtype=dtype, device="cuda") / 4
    shrunk, expected = torch.empty(num_tokens, 48, dtype=dtype, device="cuda"), torch.empty(num_tokens, 48, dtype=dtype,
                                                                                            device="cuda")
    lora_gathered_matmul(x, a.view(4, 48, 4096), shrunk, batch, add=False)
    gathered_matmul_reference(x, a.view(4, 48, 4096), expected, batch, add=False)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(shrunk, expected, atol=tolerance, rtol=tolerance)
    out = torch.randn(num_tokens, 6144, dtype=dtype, device="cuda")
    reference = out.clone()
    lora_gathered_matmul(shrunk[:, 16:32], b[:, 4096:5120], out[:, 4096:5120], batch, add=True)
    gathered_matmul_reference(shrunk[:, 16:32], b[:, 4096:5120], reference[:, 4096:5120], batch, add=True)
    torch.testing.assert_close(out, reference, atol=tolerance, rtol=tolerance)


def test_mixed_adapters_match_transformers(gpu_checkpoint, tmp_path):
    folder, hf_model = gpu_checkpoint("llama")
    merged = [save_adapter(str(tmp_path / f"a{i}"), hf_model, i, rank, modules)
              for i, rank, modules in ((1, 8, ALL_MODULES), (2, 16, ["q_proj", "v_proj"]))]
    loras = [LoRARequest(f"a{i}", i, str(tmp_path / f"a{i}")) for i in (1, 2)]
    chosen = [(loras[i % 3], merged[i % 3]) if i % 3 < 2 else (None, hf_model) for i in range(len(PROMPTS))]
    expected = []
    for prompt, (_, model) in zip(PROMPTS, chosen):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=PARAMS.max_tokens, do_sample=False, min_new_tokens=PARAMS.max_tokens,
                                 attention_mask=torch.ones_like(ids))
        expected.append(out[0, len(prompt):].tolist())
    with LLM(folder, dtype="float32", device="cuda", skip_tokenizer_init=True, enable_lora=True, max_loras=2,
             max_lora_rank=16) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, lora_request=[c[0] for c in chosen])
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
