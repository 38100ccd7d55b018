"""Which quantized format the layers being built now take (quantized_layers(config)), and the method of
each: a format's linear and expert methods, imported only when a layer of that format is built."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

from shardserve.runtime.layers.quantization.config import QuantConfig

_BUILDING: ContextVar[QuantConfig | None] = ContextVar("quant_config_building", default=None)


@contextmanager
def quantized_layers(config: QuantConfig | None):
    """Linear layers made inside this block take their weights in `config`'s format."""
    token = _BUILDING.set(config)
    try:
        yield
    finally:
        _BUILDING.reset(token)


def current_linear_method():
    """The quantized method for a linear layer being built now, or None (float weights)."""
    config = _BUILDING.get()
    if config is None or config.method == "mxfp4":  # MXFP4 checkpoints keep every layer but the experts float
        return None
    if config.method == "fp8":
        from shardserve.runtime.layers.quantization.fp8 import Fp8LinearMethod
        return Fp8LinearMethod(config)
    from shardserve.runtime.layers.quantization.packed_int import PackedIntLinearMethod
    return PackedIntLinearMethod(config)


def current_moe_method():
    """The quantized method for routed experts (FusedMoE) being built now, or None (float experts)."""
    config = _BUILDING.get()
    if config is None:
        return None
    if config.method == "fp8":
        from shardserve.runtime.layers.quantization.fp8_moe import Fp8MoEMethod
        return Fp8MoEMethod(config)
    if config.method == "mxfp4":
        from shardserve.runtime.layers.quantization.mxfp4_moe import Mxfp4MoEMethod
        return Mxfp4MoEMethod(config)
    from shardserve.runtime.layers.quantization.packed_int_moe import PackedIntMoEMethod
    return PackedIntMoEMethod(config)
