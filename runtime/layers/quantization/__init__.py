"""Quantized linear layers: the checkpoint formats the runtime serves (AWQ, GPTQ, FP8)."""
