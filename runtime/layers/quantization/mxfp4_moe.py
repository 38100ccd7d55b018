"""MXFP4 routed experts (OCP microscaling FP4), as gpt-oss ships them (`quant_method: mxfp4`; only the
experts are quantized, every other layer is float):

    w13_blocks [E, 2I, H / 2] uint8, w13_scales [E, 2I, H / 32] uint8   (gate | up of this rank)
    w2_blocks  [E, H, I / 2] uint8,  w2_scales  [E, H, I / 32] uint8

Input k of row n is the low (k even) or high nibble of byte k // 2, an e2m1 value (sign, two exponent
bits, one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6); every 32 inputs of a row share the scale 2^(s - 127)
(an e8m0 byte). The checkpoint's tensors hold every expert (moe_stacked.py loads them). On CUDA the
Triton grouped GEMMs dequantize tile by tile (triton_moe.py's FORMAT MXFP4); elsewhere each chosen
expert is dequantized for FusedMoE's torch loop."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from shardserve.runtime.layers.quantization.config import QuantConfig
from shardserve.runtime.layers.weights import PackedDims

if TYPE_CHECKING:
    from shardserve.runtime.layers.triton_moe import ExpertMatrices  # triton is imported only on CUDA

MATRICES = ("w13", "w2")
GROUP = 32  # inputs per scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # by nibble


class Mxfp4ExpertLayer(Protocol):
    """FusedMoE (layers/moe.py) with the parameters create_weights gives it (layouts above)."""

    packed_dims: dict[str, PackedDims]
    first_expert: int

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None: ...


class Mxfp4MoEMethod:
    """Parameters and expert GEMMs of MXFP4 experts; one instance per FusedMoE."""

    def __init__(self, config: QuantConfig):
        self.config = config

    def create_weights(self, layer: Mxfp4ExpertLayer, num_experts: int, hidden_size: int, intermediate: int) -> None:
        for name, num_out, num_in in (("w13", 2 * intermediate, hidden_size), ("w2", hidden_size, intermediate)):
            if num_in % GROUP:
                raise ValueError(f"MXFP4 experts need inputs in whole groups of {GROUP}; this rank's {name} has "
                                 f"{num_in}: use expert parallel, or fewer tensor-parallel ranks")
            for part, columns, per_element in (("blocks", num_in // 2, 2), ("scales", num_in // GROUP, GROUP)):
                stored = torch.zeros(num_experts, num_out, columns, dtype=torch.uint8)
                layer.register_parameter(f"{name}_{part}", nn.Parameter(stored, requires_grad=False))
                layer.packed_dims[f"{name}_{part}"] = PackedDims(0, 1, 1, per_element)

    def process_after_loading(self, layer: Mxfp4ExpertLayer) -> None:
        """Nothing to prepare: the kernels read the checkpoint's bytes."""

    def expert_weights(self, layer: Mxfp4ExpertLayer, local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `local` of this rank dequantized: w13 [2I, H] and w2 [H, I] in float32."""
        w13, w2 = (dequantize_mxfp4(getattr(layer, f"{name}_blocks")[local], getattr(layer, f"{name}_scales")[local])
                   for name in MATRICES)
        return w13, w2

    def expert_matrices(self, layer: Mxfp4ExpertLayer) -> tuple[ExpertMatrices, ExpertMatrices]:
        """w13 and w2 as the Triton kernels read them (FusedMoE.kernels)."""
        from shardserve.runtime.layers.triton_moe import MXFP4, ExpertMatrices

        w13, w2 = (ExpertMatrices(getattr(layer, f"{name}_blocks"), getattr(layer, f"{name}_scales"), None, MXFP4,
                                  1, GROUP, 4) for name in MATRICES)
        return w13, w2


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [N, K / 2] uint8, scales [N, K / 32] uint8 -> W [N, K] float32."""
    table = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    codes = torch.stack(((blocks & 15), (blocks >> 4)), dim=-1).flatten(-2).long()  # [N, K]: low nibble first
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(table[codes], exponents.repeat_interleave(GROUP, dim=-1))
