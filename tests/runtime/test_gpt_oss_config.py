"""gpt-oss configs as older transformers make them (found on the GPU image's transformers 5.17)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shardserve.runtime.models.gpt_oss import SWIGLU_ALPHA, GptOssMoE


@pytest.mark.parametrize("fields", [{}, {"swiglu_alpha": 1.5}])
def test_experts_take_the_configs_alpha_or_gpt_oss_fixed_one(fields):
    config = SimpleNamespace(hidden_size=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=8,
                             swiglu_limit=7.0, **fields)
    activation = GptOssMoE(config).experts.activation
    assert (activation.kind, activation.alpha, activation.limit) == ("swigluoai", fields.get("swiglu_alpha", SWIGLU_ALPHA), 7.0)
