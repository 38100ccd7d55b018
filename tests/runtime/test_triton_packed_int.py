"""The Triton AWQ/GPTQ GEMM under TRITON_INTERPRET=1 on CPU, against the torch dequantize-then-matmul."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. at the import below

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch import nn  # noqa: E402

from quant_checkpoints import FORMATS, pack_for  # noqa: E402
from shardserve.runtime.worker.checkpoint import iterate_checkpoint  # noqa: E402
from shardserve.runtime.layers.quantization.config import QuantConfig  # noqa: E402
from shardserve.runtime.layers.quantization.packed_int import PackedIntLinearMethod  # noqa: E402
from shardserve.runtime.layers.quantization.triton_packed_int import packed_int_matmul  # noqa: E402
from shardserve.runtime.layers.weights import load_features  # noqa: E402


class Holder(nn.Module):
    """A bare module for the method's parameters, as a linear layer would hold them: `parts` output
    features merged (q, k, v), each part's checkpoint tensors loaded at its offset."""

    def __init__(self, parts: list[int]):
        super().__init__()
        self.packed_dims = {}
        self.parts = parts

    def output_parts(self) -> list[tuple[int, int]]:
        return [(sum(self.parts[:i]), size) for i, size in enumerate(self.parts)]


def packed_layer(folder, fmt: str, num_in: int = 64, parts: tuple[int, ...] = (48,), seed: int = 0):
    """A layer's packed parameters read from real safetensors files through the runtime's loading; each
    part quantized with its own act-order permutation."""
    torch.manual_seed(seed)
    qc = FORMATS[fmt]
    method = PackedIntLinearMethod(QuantConfig.from_dict(qc))
    layer = Holder(list(parts))
    method.create_weights(layer, num_in, sum(parts), num_in)
    dequantized = []
    for index, (offset, size) in enumerate(layer.output_parts()):
        weight = torch.randn(size, num_in) * 0.2
        tensors, part = pack_for(qc)(weight, qc, f"x{index}")
        dequantized.append(part)
        (folder / str(index)).mkdir()
        save_file({k: v.contiguous() for k, v in tensors.items()}, folder / str(index) / "model.safetensors")
        for name, loaded in iterate_checkpoint(str(folder / str(index))):
            param, dims = getattr(layer, name).data, layer.packed_dims[name]
            load_features(param[index] if dims.is_per_part else param, loaded, dims, (offset, 0, size))
    method.process_after_loading(layer)
    return method, layer, torch.cat(dequantized)


@pytest.mark.parametrize("fmt", ["awq", "gptq4-act-order", "gptq8-sym"])
@pytest.mark.parametrize("num_tokens", [1, 19])
def test_kernel_matches_the_torch_reference(fmt, num_tokens, tmp_path):
    method, layer, dequantized = packed_layer(tmp_path, fmt)
    torch.testing.assert_close(method.dequantize(layer), dequantized)  # the packers and the layer agree
    x = torch.randn(num_tokens, 64)
    expected = torch.nn.functional.linear(x, method.dequantize(layer))
    actual = packed_int_matmul(x, layer.qweight, layer.qzeros, layer.scales, layer.group_index, method.bits,
                               method.is_awq, method.config.zero_offset)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_tokens", [1, 19])
def test_merged_parts_with_their_own_act_order(num_tokens, tmp_path):
    """q, k and v quantized with different permutations: a group index per part, a launch per part."""
    method, layer, dequantized = packed_layer(tmp_path, "gptq4-act-order", parts=(32, 16, 16))
    assert layer.group_index.shape == (3, 64)
    torch.testing.assert_close(method.dequantize(layer), dequantized)
    x = torch.randn(num_tokens, 64)
    expected = torch.nn.functional.linear(x, dequantized)
    torch.testing.assert_close(method.kernel_matmul(layer, x), expected, atol=1e-4, rtol=1e-4)
