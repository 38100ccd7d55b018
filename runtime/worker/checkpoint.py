"""Lazy views of safetensors tensors: shape known up front, bytes read only for the slice asked for."""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from typing import Iterator

import torch
from safetensors import safe_open


# safetensors dtype names -> bytes per element (for progress; an unknown one counts 1)
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class CheckpointTensor:
    """A 1-D or 2-D checkpoint tensor, possibly transposed (GPT-2's Conv1D) and narrowed.
    Parallel layers narrow it to their shard and call load(); nothing else is read."""

    __slots__ = ("_slice", "_transposed", "_bounds")

    def __init__(self, file_slice, transposed: bool = False, bounds: tuple[tuple[int, int], ...] | None = None):
        self._slice = file_slice  # safetensors PySafeSlice
        self._transposed = transposed
        if bounds is None:
            shape = list(file_slice.get_shape())
            shape = shape[::-1] if transposed else shape
            bounds = tuple((0, n) for n in shape)
        self._bounds = bounds  # [start, stop) per dimension of the logical (post-transpose) view

    @property
    def file_nbytes(self) -> int:
        """Bytes of the whole tensor in its file (whatever slice of it is read)."""
        num = 1
        for n in self._slice.get_shape():
            num *= n
        return num * _DTYPE_BYTES.get(self._slice.get_dtype(), 1)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self._bounds)

    def transposed(self) -> CheckpointTensor:
        if len(self._bounds) != 2 or self._bounds != tuple((0, n) for n in self.shape):
            raise ValueError("only a whole 2-D tensor can be transposed")
        return CheckpointTensor(self._slice, not self._transposed)

    def narrow(self, dim: int, start: int, length: int) -> CheckpointTensor:
        dim = dim % len(self._bounds)
        lo, hi = self._bounds[dim]
        if start < 0 or lo + start + length > hi:
            raise ValueError(f"slice [{start}, {start + length}) out of range for dim {dim} of size {hi - lo}")
        bounds = list(self._bounds)
        bounds[dim] = (lo + start, lo + start + length)
        return CheckpointTensor(self._slice, self._transposed, tuple(bounds))

    def load(self) -> torch.Tensor:
        raw_bounds = self._bounds[::-1] if self._transposed else self._bounds
        if not raw_bounds:  # scalar
            return self._slice[()]
        tensor = self._slice[tuple(slice(a, b) for a, b in raw_bounds)]
        return tensor.t() if self._transposed else tensor


def checkpoint_files(folder: str) -> list[str]:
    """The safetensors files of a model folder: the sharded index if present, else one file."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, n) for n in names]
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {folder!r}; "
                     "only safetensors checkpoints are supported (load_format dummy: random weights, none read)")


def iterate_checkpoint(folder: str) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every (name, lazy tensor) pair of the checkpoint, one file open at a time."""
    for path in checkpoint_files(folder):
        yield from iterate_file(path)


def iterate_file(path: str) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every (name, lazy tensor) pair of one safetensors file."""
    with ExitStack() as stack:
        handle = stack.enter_context(safe_open(path, framework="pt"))
        for name in handle.keys():
            yield name, CheckpointTensor(handle.get_slice(name))
