"""`shardserve launch` serves a quantized folder under the layout it plans (two CPU ranks): the served
text equals transformers' greedy tokens on the dequantized weights, decoded."""

import pytest

from tests.launch.conftest import http, start_server, stop_server
from tests.runtime.quant_checkpoints import save_quantized

PROMPTS = [[17, 250, 31, 5], [90, 12, 140, 7, 66, 203, 41, 8, 99]]


def reference(hf_model, prompts, max_tokens):
    """transformers' greedy tokens on the dequantized weights."""
    import torch

    with torch.no_grad():
        return [hf_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                  max_new_tokens=max_tokens, do_sample=False, pad_token_id=2)[0, len(p):].tolist()
                for p in prompts]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["awq", "fp8-block"])
def test_launch_serves_a_quantized_folder_at_tp2(fmt, tmp_path):
    import json

    from transformers import AutoTokenizer

    folder = str(tmp_path / "model")
    expected = reference(save_quantized(folder, "qwen2", fmt), PROMPTS, 6)
    assert all(len(tokens) == 6 and 1 not in tokens for tokens in expected)  # no EOS: the server returns all six
    tokenizer = AutoTokenizer.from_pretrained(folder)
    proc, url = start_server("--model", folder, "--hardware", "2xcpu", "--tensor-parallel-size", "2",
                             "--kv-cache-memory-bytes", str(1 << 22), "--max-model-len", "128")
    try:
        for prompt, tokens in zip(PROMPTS, expected):
            status, body = http(f"{url}/v1/completions", {"model": folder, "prompt": prompt, "max_tokens": 6,
                                                          "temperature": 0})
            assert status == 200, body
            assert json.loads(body)["choices"][0]["text"] == tokenizer.decode(tokens)
    finally:
        code, out = stop_server(proc)
    assert code == 0, out
    assert "KV cache measured" in out and "plan predicted" in out
