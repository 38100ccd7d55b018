"""FP8 (e4m3) linear weights with per-tensor, per-channel or block-wise scales: compressed-tensors
float-quantized checkpoints and `quant_method: fp8` ones (weight_block_size, weight_scale_inv).

    weight             [out, in] float8_e4m3fn
    weight_scale       [out, 1]  per channel; a per-tensor scalar fills the rows of its q/k/v or gate/up part
    weight_scale(_inv) [ceil(out / bo), ceil(in / bi)] per block of bo x bi

With --quantization fp8 and a float checkpoint, the weight is read in the model dtype and quantized
per output row after loading (vLLM's online fp8). W = weight * scale. On Hopper with bf16 activations and per-tensor or per-channel scales, the GEMM is
torch._scaled_mm in fp8 with dynamic per-token activation scales; elsewhere (CPU, block scales, other
GPUs) the weight is dequantized then multiplied in the model dtype."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.runtime.layers.quantization.config import QuantConfig
from shardserve.runtime.layers.weights import FLOAT_WEIGHT, PackedDims


class Fp8Layer(Protocol):
    """A linear layer (layers/linear.py) with the parameters create_weights gives it (layouts above); its
    scale is named scale_name."""

    weight: torch.Tensor
    input_scale: torch.Tensor  # compressed-tensors static activation scales
    packed_dims: dict[str, PackedDims]

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None: ...
    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None: ...


class Fp8LinearMethod:
    def __init__(self, config: QuantConfig):
        self.config = config
        self.block_shape = config.spec.block_shape

    @property
    def scale_name(self) -> str:
        return "weight_scale_inv" if self.config.format == "fp8" and self.block_shape else "weight_scale"

    def create_weights(self, layer: Fp8Layer, input_size: int, output_size: int, full_input_size: int) -> None:
        stored = torch.get_default_dtype() if self.config.is_online else torch.float8_e4m3fn
        layer.weight = nn.Parameter(torch.zeros(output_size, input_size, dtype=stored), requires_grad=False)
        layer.packed_dims["weight"] = FLOAT_WEIGHT
        if self.block_shape:
            bo, bi = self.block_shape
            shape, dims = (-(-output_size // bo), -(-input_size // bi)), PackedDims(0, 1, bo, bi)
        else:
            shape, dims = (output_size, 1), PackedDims(0, None, is_broadcast=self.config.fp8_strategy == "tensor")
        scale = nn.Parameter(torch.zeros(shape), requires_grad=False)
        if self.config.is_online:  # made from the weight after loading, not read
            layer.register_buffer(self.scale_name, scale.data)
            return
        layer.register_parameter(self.scale_name, scale)
        layer.packed_dims[self.scale_name] = dims
        if self.config.has_input_scale:  # static activation scales: read, unused by dequantize-then-multiply
            layer.input_scale = nn.Parameter(torch.zeros(output_size, 1), requires_grad=False)
            layer.packed_dims["input_scale"] = PackedDims(0, None, is_broadcast=True)

    def process_after_loading(self, layer: Fp8Layer) -> None:
        """Online quantization: the float weight becomes fp8 with one scale per output row."""
        if not self.config.is_online:
            return
        weight = layer.weight.data.float()
        scale = (weight.abs().amax(1, keepdim=True) / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
        layer.weight = nn.Parameter((weight / scale).to(torch.float8_e4m3fn), requires_grad=False)
        getattr(layer, self.scale_name).copy_(scale)

    def dequantize(self, layer: Fp8Layer) -> torch.Tensor:
        scale = getattr(layer, self.scale_name).float()
        weight = layer.weight.float()  # [out, in]
        if self.block_shape:
            bo, bi = self.block_shape
            scale = scale.repeat_interleave(bo, 0)[: weight.shape[0]].repeat_interleave(bi, 1)[:, : weight.shape[1]]
        return weight * scale

    def apply(self, layer: Fp8Layer, x: torch.Tensor) -> torch.Tensor:
        if self._has_fp8_gemm(layer, x):
            return self._scaled_mm(layer, x)
        return F.linear(x, self.dequantize(layer).to(x.dtype))

    def _has_fp8_gemm(self, layer: Fp8Layer, x: torch.Tensor) -> bool:
        """NOTE: row-wise scaled _scaled_mm wants bf16 output, sm_90, and both GEMM sizes of 16s."""
        num_out, num_in = layer.weight.shape
        return (x.is_cuda and x.dtype == torch.bfloat16 and not self.block_shape and num_in % 16 == 0
                and num_out % 16 == 0 and torch.cuda.get_device_capability(x.device) >= (9, 0))

    def _scaled_mm(self, layer: Fp8Layer, x: torch.Tensor) -> torch.Tensor:
        largest = torch.finfo(torch.float8_e4m3fn).max
        x2 = x.reshape(-1, x.shape[-1])  # [tokens, in]
        x_scale = (x2.abs().amax(-1, keepdim=True).float() / largest).clamp(min=1e-12)  # [tokens, 1]
        xq = (x2.float() / x_scale).clamp(-largest, largest).to(torch.float8_e4m3fn)
        w_scale = getattr(layer, self.scale_name).float().reshape(1, -1)  # [1, out]
        y = torch._scaled_mm(xq, layer.weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16)
        return y.reshape(*x.shape[:-1], -1)
