"""AWQ and GPTQ routed experts (4- or 8-bit, groups in input order) as AutoAWQ and GPTQ checkpoints ship
them, one tensor per expert (`experts.<e>.w1.qweight`, `.qzeros`, `.scales`, GPTQ's `.g_idx`), stacked over
this rank's experts in packed_int.py's layouts (p = 32 / bits values per int32, g the group size):

    AWQ   w13_qweight [E, H, 2I / p]   w13_qzeros [E, H / g, 2I / p]   w13_scales [E, H / g, 2I]
          w2_qweight  [E, I, H / p]    w2_qzeros  [E, I / g, H / p]    w2_scales  [E, I / g, H]
    GPTQ  w13_qweight [E, H / p, 2I]   w2_qweight [E, I / p, H]        qzeros and scales as AWQ's
          w13_g_idx [E, H], w2_g_idx [E, I]: read, unused (without act-order the group is input // g)

w13 holds gate | up of this rank. A checkpoint without groups (group_size -1) has one group per matrix,
whole on every rank. On CUDA the Triton grouped GEMMs dequantize tile by tile (triton_quant_moe.py);
elsewhere each chosen expert is dequantized for FusedMoE's torch loop."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from shardserve.runtime.layers.quantization.config import QuantConfig
from shardserve.runtime.layers.quantization.packed_int import dequantize_packed
from shardserve.runtime.layers.weights import PackedDims

if TYPE_CHECKING:
    from shardserve.runtime.layers.triton_moe import ExpertMatrices  # triton is imported only on CUDA

MATRICES = ("w13", "w2")


class PackedIntExpertLayer(Protocol):
    """FusedMoE (layers/moe.py) with the parameters create_weights gives it (layouts above)."""

    packed_dims: dict[str, PackedDims]
    first_expert: int

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None: ...


class PackedIntMoEMethod:
    """Parameters and expert GEMMs of AWQ or GPTQ experts; one instance per FusedMoE."""

    def __init__(self, config: QuantConfig):
        self.config = config
        self.bits = config.spec.bits
        self.pack = 32 // self.bits
        self.group_sizes: dict[str, int] = {}  # "w13" | "w2" -> inputs per scale group on this rank

    @property
    def is_awq(self) -> bool:
        return self.config.format == "awq"

    def create_weights(self, layer: PackedIntExpertLayer, num_experts: int, hidden_size: int,
                       intermediate: int) -> None:
        pack, group = self.pack, self.config.spec.group_size
        for name, num_out, num_in in (("w13", 2 * intermediate, hidden_size), ("w2", hidden_size, intermediate)):
            num_groups, group_dim = (num_in // group, 0) if group else (1, None)  # None: the one group, whole
            self.group_sizes[name] = group or num_in
            shapes: dict[str, tuple[tuple[int, ...], PackedDims]]
            if self.is_awq:
                shapes = {"qweight": ((num_in, num_out // pack), PackedDims(1, 0, pack, 1))}
            else:
                shapes = {"qweight": ((num_in // pack, num_out), PackedDims(1, 0, 1, pack)),
                          "g_idx": ((num_in,), PackedDims(None, 0))}
            shapes["qzeros"] = ((num_groups, num_out // pack), PackedDims(1, group_dim, pack, group or 1))
            for leaf, (shape, dims) in shapes.items():
                packed = torch.zeros(num_experts, *shape, dtype=torch.int32)
                layer.register_parameter(f"{name}_{leaf}", nn.Parameter(packed, requires_grad=False))
                layer.packed_dims[f"{name}_{leaf}"] = dims
            scales = torch.zeros(num_experts, num_groups, num_out, dtype=torch.get_default_dtype())
            layer.register_parameter(f"{name}_scales", nn.Parameter(scales, requires_grad=False))
            layer.packed_dims[f"{name}_scales"] = PackedDims(1, group_dim, 1, group or 1)

    def process_after_loading(self, layer: PackedIntExpertLayer) -> None:
        """Nothing to prepare: the groups follow from the input index."""

    def expert_weights(self, layer: PackedIntExpertLayer, local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `local` of this rank dequantized: w13 [2I, H] and w2 [H, I] in the scales' dtype."""
        out = []
        for name in MATRICES:
            qweight = getattr(layer, f"{name}_qweight")[local]
            num_in = qweight.shape[0] * (1 if self.is_awq else self.pack)
            groups = torch.arange(num_in, device=qweight.device) // self.group_sizes[name]
            out.append(dequantize_packed(qweight, getattr(layer, f"{name}_qzeros")[local],
                                         getattr(layer, f"{name}_scales")[local], groups, self.bits, self.is_awq,
                                         self.config.zero_offset))
        return out[0], out[1]

    def expert_matrices(self, layer: PackedIntExpertLayer) -> tuple[ExpertMatrices, ExpertMatrices]:
        """w13 and w2 as the Triton kernels read them (FusedMoE.kernels)."""
        from shardserve.runtime.layers.triton_moe import AWQ, GPTQ, ExpertMatrices

        w13, w2 = (ExpertMatrices(getattr(layer, f"{name}_qweight"), getattr(layer, f"{name}_scales"),
                                  getattr(layer, f"{name}_qzeros"), AWQ if self.is_awq else GPTQ, 1,
                                  self.group_sizes[name], self.bits, self.config.zero_offset)
                   for name in MATRICES)
        return w13, w2
