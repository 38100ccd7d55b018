"""Full-sequence logits of every family within 1e-4 of transformers', whole and chunked."""

from __future__ import annotations

import pytest
import torch

from runtime_checkpoints import FAMILIES
from runtime_forward import PROMPT, run_chunks
from shardserve.runtime.config import load_model_config
from shardserve.runtime.worker.loader import load_model


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family, checkpoint_factory):
    folder, hf_model = checkpoint_factory(family)
    model = load_model(load_model_config(folder), torch.device("cpu"))
    with torch.no_grad():
        expected = hf_model(torch.tensor([PROMPT])).logits[0]  # [37, vocab]
    whole = run_chunks(model, [len(PROMPT)])
    chunked = run_chunks(model, [5, 1, 12, 19])
    assert whole.shape == expected.shape
    assert (whole - expected).abs().max().item() < 1e-4
    assert (chunked - expected).abs().max().item() < 1e-4
    assert expected.std().item() > 0.5  # control: the random model's logits are far from flat
