"""vLLM's load_format dummy: random weights of the model's own shapes, no checkpoint read (for benchmarking
speed and memory; the text it generates is noise)."""

from __future__ import annotations

import torch
from torch import nn

DUMMY_RANGE = 1e-3  # weights uniform in [-1e-3, 1e-3]: small enough that activations stay finite


def fill_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Every parameter of this rank's shard: floats uniform in [-DUMMY_RANGE, DUMMY_RANGE], integers (packed
    int4/int8 weights, zero points, group indices) zero; then each quantized layer prepares its weights as
    after a checkpoint load. Buffers (rotary tables, KV scales) keep what the model built."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for param in model.parameters():
            if not param.dtype.is_floating_point:
                param.zero_()
                continue
            generator = generators.setdefault(param.device, torch.Generator(param.device).manual_seed(seed))
            if param.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
                param.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=generator)
            else:  # fp8: drawn in bfloat16, then cast
                values = torch.empty(param.shape, dtype=torch.bfloat16, device=param.device)
                param.copy_(values.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=generator))
    for module in model.modules():
        quant_method = getattr(module, "quant_method", None)  # a linear layer's; None: float weights
        if quant_method is not None:
            quant_method.process_after_loading(module)
