"""tests/gpu run only on a CUDA machine, in a process of their own with compiled Triton kernels
(bench/run_gpu.sh runs them so); anywhere else every test here is skipped with the reason."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from gpu_checkpoints import save_gpu_checkpoint

HERE = Path(__file__).parent


def gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "tests/gpu need a CUDA GPU (torch.cuda.is_available() is False)"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return ("tests/gpu need compiled Triton kernels: run them alone with TRITON_INTERPRET=0 "
                "(bash bench/run_gpu.sh does)")
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every test here is slow (Triton compiles its kernels with ptxas, a process of its own), and skipped
    where no GPU runs it."""
    reason = gpu_skip_reason()
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.slow)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def gpu_checkpoint(tmp_path_factory):
    """family -> (folder, transformers model in float32 on the GPU); each written once."""
    cache = {}

    def make(family: str):
        if family not in cache:
            folder = str(tmp_path_factory.mktemp(f"gpu_{family}"))
            cache[family] = (folder, save_gpu_checkpoint(folder, family).to("cuda"))
        return cache[family]

    return make
