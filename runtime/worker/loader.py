"""Build a model on a device and fill it from its safetensors checkpoint, tensor by tensor."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from shardserve.runtime.worker.checkpoint import CheckpointTensor, checkpoint_files, iterate_file
from shardserve.runtime.config import ModelConfig
from shardserve.runtime.worker.dummy_weights import fill_dummy_weights
from shardserve.runtime.layers.quantization.methods import quantized_layers
from shardserve.runtime.layers.weights import default_weight_loader
from shardserve.runtime.worker.load_progress import LoadProgress, is_terminal
from shardserve.runtime.models.registry import build_model
from shardserve.runtime.distributed.parallel_state import get_parallel_state
from shardserve.runtime.worker.pooler import base_model_names, drop_lm_head

_LAYER_INDEX = re.compile(r"\.(?:layers|h)\.(\d+)\.")


@contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(model_config: ModelConfig, device: torch.device,
               build: Callable[[ModelConfig], nn.Module] = build_model) -> nn.Module:
    """`build`: the module for the config (the registry's architecture by default; an EAGLE-3 head's builder)."""
    with _default_dtype(model_config.dtype), torch.device(device), quantized_layers(model_config.quantization):
        model = build(model_config)
    if model_config.runner == "pooling":  # an embedding model: no head; its checkpoint may be the base model's
        drop_lm_head(model)
    if model_config.load_format == "dummy":  # no checkpoint read: config.json and the tokenizer suffice
        fill_dummy_weights(model)
        return model.eval()
    tensors = _read_with_progress(model_config.model)
    if model_config.runner == "pooling":
        tensors = base_model_names(model, tensors)
    load_weights(model, model_config.model, tensors)
    return model.eval()


def _read_with_progress(folder: str) -> Iterator[tuple[str, CheckpointTensor]]:
    """The checkpoint's tensors, file by file, with rank 0 showing how far it got (load_progress.py)."""
    files = checkpoint_files(folder)
    progress = LoadProgress([os.path.getsize(f) for f in files], get_parallel_state().global_rank == 0,
                            is_terminal())
    try:
        for index, path in enumerate(files):
            progress.start_file(index)
            for name, tensor in iterate_file(path):
                yield name, tensor
                progress.advance(tensor.file_nbytes)
    except BaseException:
        progress.abort()
        raise
    progress.finish()


def load_weights(model: nn.Module, folder: str,
                 tensors: Iterable[tuple[str, CheckpointTensor]] | None = None) -> None:
    """Each checkpoint tensor (the folder's, or `tensors` read from it) goes to the parameter the model
    names for it, through the weight_loader of the module that owns the parameter (which reads only this
    rank's shard)."""
    params = dict(model.named_parameters())
    optional = dict(model.named_buffers())  # read when the checkpoint has them (fp8 KV cache scales)
    loaded: set[str] = set()
    start, end = model.layer_range  # type: ignore[misc]  # every family's attribute, not nn.Module's
    for name, tensor in _read_with_progress(folder) if tensors is None else tensors:
        target = model.checkpoint_target(name)  # type: ignore[operator]  # every family's method
        if target is None or target.skip:
            continue
        layer = _LAYER_INDEX.search(name)
        if layer and not start <= int(layer.group(1)) < end:
            continue  # owned by another pipeline stage
        param = params.get(target.param_name)
        if param is None and target.param_name in optional:
            with torch.no_grad():
                optional[target.param_name].copy_(tensor.load().reshape(()))
            continue
        if param is None and get_parallel_state().pp_size > 1:
            continue  # embedding or head of another stage; anything truly missing fails below
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__} "
                             f"(looked for {target.param_name!r})")
        if target.transpose:
            tensor = tensor.transposed()
        owner = model.get_submodule(target.param_name.rpartition(".")[0])
        weight_loader: Callable[..., None] = getattr(owner, "weight_loader", default_weight_loader)
        if target.shard_id is None:
            weight_loader(param, tensor)
        else:
            weight_loader(param, tensor, target.shard_id)
        loaded.add(target.param_name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint in {folder!r} lacks weights for: {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else ""))
    for module in model.modules():
        quant_method = getattr(module, "quant_method", None)  # a linear layer's; None: float weights
        if quant_method is not None:
            quant_method.process_after_loading(module)
