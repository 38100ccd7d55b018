"""AWQ (GEMM layout) and GPTQ linear weights: int32-packed 4- or 8-bit values with per-group scales and
zero points; the torch reference dequantizes then multiplies (CPU, and the check for GPU kernels).

Layouts (in, out: this rank's features; G: scale groups; p = 32 / bits values per int32):

    GPTQ  qweight [in / p, out]   packed along the input, value i of an int32 at bits [i*b, i*b + b)
          qzeros  [G, out / p]    packed along the output; the classic format stores zero - 1
          scales  [G, out]        g_idx [in]: the group of each input row (act-order permutes them;
                                  q, k and v, or gate and up, may each have their own: one row per part)
    AWQ   qweight [in, out / 8]   packed along the output in AWQ's order: nibble j holds column
          qzeros  [G, out / 8]    AWQ_ORDER[j] of its 8, so nibble 0,1,2,... = column 0,2,4,6,1,3,5,7
          scales  [G, out]

W[out, in] = (q[in, out] - zero[group(in), out]) * scale[group(in), out], transposed."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.runtime.layers.quantization.config import QuantConfig
from shardserve.runtime.layers.weights import PackedDims

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned `bits`-wide values out of int32s, expanded along `dim` (p values per int32)."""
    per_int = 32 // bits
    shifts = torch.arange(per_int, device=packed.device, dtype=torch.int32) * bits
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., p]: value j at shift j*bits
    if order is not None:
        values = values[..., list(_inverse(order))]  # column c of the 8 sits at nibble inverse[c]
    values = values.movedim(-1, dim + 1) if dim != packed.dim() - 1 else values
    shape = list(packed.shape)
    shape[dim] *= per_int
    return values.reshape(shape)


def dequantize_packed(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_index: torch.Tensor,
                      bits: int, is_awq: bool, zero_offset: int) -> torch.Tensor:
    """W [out, in] in the dtype of `scales` from one matrix in the layouts above; group_index [in]: the
    scale group of each input row."""
    order = AWQ_ORDER if is_awq else None
    q = unpack_int32(qweight, bits, 1 if is_awq else 0, order)  # [in, out]
    zeros = unpack_int32(qzeros, bits, 1, order) + zero_offset  # [G, out]
    groups = group_index.long()
    return ((q - zeros[groups]).to(scales.dtype) * scales[groups]).t()


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    inverse = [0] * len(order)
    for nibble, column in enumerate(order):
        inverse[column] = nibble
    return tuple(inverse)


class PackedIntLayer(Protocol):
    """A linear layer (layers/linear.py) with the parameters create_weights gives it (layouts above) and
    the buffer process_after_loading adds."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor  # GPTQ: [parts, in]
    group_index: torch.Tensor  # [in] int32, or [parts, in] when the merged parts' act-order groups differ
    packed_dims: dict[str, PackedDims]

    def output_parts(self) -> list[tuple[int, int]]: ...

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None: ...
    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None: ...


class PackedIntLinearMethod:
    """Parameters and matmul of an AWQ or GPTQ linear layer."""

    def __init__(self, config: QuantConfig):
        self.config = config
        self.bits = config.spec.bits
        self.pack = 32 // self.bits

    def create_weights(self, layer: PackedIntLayer, input_size: int, output_size: int, full_input_size: int) -> None:
        group = self.config.spec.group_size or full_input_size
        is_split = input_size != full_input_size
        # act-order groups are scattered over the input rows: every rank keeps all of them
        has_all_groups = (self.config.desc_act and is_split) or self.config.spec.group_size is None
        num_groups = (full_input_size if has_all_groups else input_size) // group
        group_dims = (None, 1) if has_all_groups else (0, group)  # (input_dim, input_per_element)
        pack, int32 = self.pack, torch.int32
        if self.config.format == "gptq":
            parts = len(layer.output_parts())
            shapes = {"qweight": ((input_size // pack, output_size), PackedDims(1, 0, 1, pack)),
                      "g_idx": ((parts, input_size), PackedDims(None, 0, is_per_part=True))}
        else:
            shapes = {"qweight": ((input_size, output_size // pack), PackedDims(1, 0, pack, 1))}
        shapes["qzeros"] = ((num_groups, output_size // pack), PackedDims(1, group_dims[0], pack, group_dims[1]))
        for name, (shape, dims) in shapes.items():
            layer.register_parameter(name, nn.Parameter(torch.zeros(shape, dtype=int32), requires_grad=False))
            layer.packed_dims[name] = dims
        layer.scales = nn.Parameter(torch.zeros(num_groups, output_size, dtype=torch.get_default_dtype()),
                                    requires_grad=False)
        layer.packed_dims["scales"] = PackedDims(1, group_dims[0], 1, group_dims[1])

    def process_after_loading(self, layer: PackedIntLayer) -> None:
        """group_index [in]: the scale group of each input row of this rank (act-order: g_idx, one row per
        merged part when the parts' permutations differ)."""
        num_in = layer.qweight.shape[0] * (1 if self.is_awq else self.pack)
        if self.config.format == "gptq" and self.config.desc_act:
            rows = layer.g_idx.data
            groups = rows[0].clone() if bool((rows == rows[0]).all()) else rows.clone()
        else:
            per_group = max(1, num_in // layer.scales.shape[0])
            groups = torch.arange(num_in, dtype=torch.int32, device=layer.qweight.device) // per_group
        layer.register_buffer("group_index", groups.to(torch.int32))

    @property
    def is_awq(self) -> bool:
        return self.config.format == "awq"

    def part_slices(self, layer: PackedIntLayer) -> list[tuple[slice, torch.Tensor]]:
        """(output columns, group index) of each run of columns sharing one group index: the whole layer,
        or each merged part whose act-order permutation differs from the others'."""
        if layer.group_index.dim() == 1:
            return [(slice(None), layer.group_index)]
        parts = layer.output_parts()
        return [(slice(offset, offset + size), groups) for (offset, size), groups in zip(parts, layer.group_index)]

    def dequantize(self, layer: PackedIntLayer) -> torch.Tensor:
        """The float weight [out, in] of this rank."""
        return torch.cat([dequantize_packed(*self._columns(layer, columns), groups, self.bits, self.is_awq,
                                            self.config.zero_offset)
                          for columns, groups in self.part_slices(layer)])

    def apply(self, layer: PackedIntLayer, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return self.kernel_matmul(layer, x)
        return F.linear(x, self.dequantize(layer).to(x.dtype))

    def kernel_matmul(self, layer: PackedIntLayer, x: torch.Tensor) -> torch.Tensor:
        """x W^T by the Triton GEMM, a launch per run of columns sharing a group index."""
        from shardserve.runtime.layers.quantization.triton_packed_int import packed_int_matmul
        outputs = [packed_int_matmul(x, *self._columns(layer, columns), groups, self.bits, self.is_awq,
                                     self.config.zero_offset) for columns, groups in self.part_slices(layer)]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)

    def _columns(self, layer: PackedIntLayer, columns: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qweight, qzeros and scales of output columns `columns` (GPTQ: whole int32 words of zeros)."""
        if columns == slice(None):
            return layer.qweight, layer.qzeros, layer.scales
        words = slice(columns.start // self.pack, columns.stop // self.pack)
        return layer.qweight[:, columns], layer.qzeros[:, words], layer.scales[:, columns]
