"""The Triton AWQ/GPTQ GEMM under TRITON_INTERPRET=1 on CPU, against the torch dequantize-then-matmul."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. at the import below

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch import nn  # noqa: E402

from quant_checkpoints import FORMATS, awq_tensors, gptq_tensors  # noqa: E402
from shardserve.runtime.checkpoint import iterate_checkpoint  # noqa: E402
from shardserve.runtime.layers.quantization.config import QuantConfig  # noqa: E402
from shardserve.runtime.layers.quantization.packed_int import PackedIntLinearMethod  # noqa: E402
from shardserve.runtime.layers.quantization.triton_packed_int import packed_int_matmul  # noqa: E402
from shardserve.runtime.layers.weights import load_features  # noqa: E402


class Holder(nn.Module):
    """A bare module for the method's parameters, as a linear layer would hold them."""

    def __init__(self):
        super().__init__()
        self.packed_dims = {}


def packed_layer(folder, fmt: str, num_in: int = 64, num_out: int = 48, seed: int = 0):
    """A layer's packed parameters read from a real safetensors file through the runtime's loading."""
    torch.manual_seed(seed)
    qc = FORMATS[fmt]
    method = PackedIntLinearMethod(QuantConfig.from_dict(qc))
    layer = Holder()
    method.create_weights(layer, num_in, num_out, num_in)
    weight = torch.randn(num_out, num_in) * 0.2
    tensors, dequantized = (awq_tensors if qc["quant_method"] == "awq" else gptq_tensors)(weight, qc, "x")
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    for name, loaded in iterate_checkpoint(str(folder)):
        load_features(getattr(layer, name).data, loaded, layer.packed_dims[name])
    method.process_after_loading(layer)
    return method, layer, dequantized


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
