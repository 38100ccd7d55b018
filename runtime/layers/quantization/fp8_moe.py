"""FP8 (e4m3) routed experts with per-tensor, per-channel or block scales, as `quant_method: fp8` (DeepSeek-
style 128x128 blocks in weight_scale_inv, or AutoFP8's per-tensor weight_scale) and compressed-tensors
checkpoints ship them, one tensor per expert (`experts.<e>.w1.weight`, `.weight_scale(_inv)`, `.input_scale`):

    w13 [E, 2I, H] float8_e4m3fn (gate | up of this rank),  w2 [E, H, I]
    scales [E, ceil(N / group_n), ceil(K / group_k)] float32 for a matrix of N outputs and K inputs:
        per tensor   w13 [E, 2, 1] (w1's scale, w3's),  w2 [E, 1, 1]     group_n: a checkpoint tensor's rows
        per channel  [E, N, 1]                                           group_n = 1
        blocks       [E, ceil(N / bo), ceil(K / bi)]                     (group_n, group_k) = (bo, bi)

With --quantization fp8 on float experts, each expert's rows are quantized after loading (per channel).
W = weight * scale. On CUDA the Triton grouped GEMMs dequantize tile by tile (triton_quant_moe.py);
elsewhere each chosen expert is dequantized for FusedMoE's torch loop."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from shardserve.runtime.layers.quantization.config import QuantConfig
from shardserve.runtime.layers.weights import FLOAT_WEIGHT, PackedDims

if TYPE_CHECKING:
    from shardserve.runtime.layers.triton_moe import ExpertMatrices  # triton is imported only on CUDA

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
MATRICES = ("w13", "w2")


class Fp8ExpertLayer(Protocol):
    """FusedMoE (layers/moe.py) with the parameters create_weights gives it (layouts above)."""

    packed_dims: dict[str, PackedDims]
    first_expert: int

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None: ...
    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None: ...


class Fp8MoEMethod:
    """Parameters and expert GEMMs of fp8 experts; one instance per FusedMoE."""

    def __init__(self, config: QuantConfig):
        self.config = config
        self.groups: dict[str, tuple[int, int]] = {}  # "w13" | "w2" -> (group_n, group_k) of its scales

    @property
    def scale_name(self) -> str:
        return "weight_scale_inv" if self.config.format == "fp8" and self.config.spec.block_shape else "weight_scale"

    def create_weights(self, layer: Fp8ExpertLayer, num_experts: int, hidden_size: int, intermediate: int) -> None:
        stored = torch.get_default_dtype() if self.config.is_online else torch.float8_e4m3fn
        for name, num_out, num_in, part in (("w13", 2 * intermediate, hidden_size, intermediate),
                                            ("w2", hidden_size, intermediate, hidden_size)):
            weight = torch.zeros(num_experts, num_out, num_in, dtype=stored)
            layer.register_parameter(name, nn.Parameter(weight, requires_grad=False))
            layer.packed_dims[name] = FLOAT_WEIGHT
            shape, dims, self.groups[name] = self._scale_layout(num_out, num_in, part)
            scale = torch.zeros(num_experts, *shape, dtype=torch.float32)
            if self.config.is_online:  # made from the weight after loading, not read
                layer.register_buffer(f"{name}_{self.scale_name}", scale)
                continue
            layer.register_parameter(f"{name}_{self.scale_name}", nn.Parameter(scale, requires_grad=False))
            layer.packed_dims[f"{name}_{self.scale_name}"] = dims
            if self.config.has_input_scale:  # static activation scales: read, unused
                inputs = torch.zeros(num_experts, num_out // part, 1, dtype=torch.float32)
                layer.register_parameter(f"{name}_input_scale", nn.Parameter(inputs, requires_grad=False))
                layer.packed_dims[f"{name}_input_scale"] = PackedDims(0, None, part, is_broadcast=True)

    def _scale_layout(self, num_out: int, num_in: int, part: int):
        """(scale shape per expert, its PackedDims, (group_n, group_k)); `part`: the rows of one checkpoint
        tensor in the matrix (w13: this rank's share of w1, then of w3)."""
        block = self.config.spec.block_shape
        if block:
            bo, bi = block
            return (-(-num_out // bo), -(-num_in // bi)), PackedDims(0, 1, bo, bi), (bo, bi)
        if self.config.fp8_strategy == "tensor":  # a scalar per checkpoint tensor fills its rows' one scale
            return (num_out // part, 1), PackedDims(0, None, part, is_broadcast=True), (part, num_in)
        return (num_out, 1), PackedDims(0, None), (1, num_in)

    def process_after_loading(self, layer: Fp8ExpertLayer) -> None:
        """Online quantization: each expert's float rows become fp8 with one scale per row."""
        if not self.config.is_online:
            return
        for name in MATRICES:
            weight, scale = getattr(layer, name).data, getattr(layer, f"{name}_{self.scale_name}")
            quantized = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device)
            for expert in range(weight.shape[0]):  # NOTE: one expert at a time keeps the float copy small
                rows = weight[expert].float()
                scale[expert] = (rows.abs().amax(1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
                quantized[expert] = (rows / scale[expert]).to(torch.float8_e4m3fn)
            layer.register_parameter(name, nn.Parameter(quantized, requires_grad=False))

    def expert_weights(self, layer: Fp8ExpertLayer, local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `local` of this rank dequantized: w13 [2I, H] and w2 [H, I] in float32."""
        w13, w2 = (dequantize_fp8(getattr(layer, name)[local], getattr(layer, f"{name}_{self.scale_name}")[local],
                                  self.groups[name]) for name in MATRICES)
        return w13, w2

    def expert_matrices(self, layer: Fp8ExpertLayer) -> tuple[ExpertMatrices, ExpertMatrices]:
        """w13 and w2 as the Triton kernels read them (FusedMoE.kernels)."""
        from shardserve.runtime.layers.triton_moe import FP8, ExpertMatrices

        w13, w2 = (ExpertMatrices(getattr(layer, name), getattr(layer, f"{name}_{self.scale_name}"), None, FP8,
                                  *self.groups[name]) for name in MATRICES)
        return w13, w2


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, groups: tuple[int, int]) -> torch.Tensor:
    """weight [N, K] fp8, scale [ceil(N / group_n), ceil(K / group_k)] -> W [N, K] float32."""
    group_n, group_k = groups
    num_out, num_in = weight.shape
    full = scale.float().repeat_interleave(group_n, 0)[:num_out].repeat_interleave(group_k, 1)[:, :num_in]
    return weight.float() * full
