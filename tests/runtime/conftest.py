"""Session fixtures for the runtime tests: checkpoints written once, KV pool sizes in blocks."""

from __future__ import annotations

import os

import pytest
import torch

from runtime_checkpoints import bytes_per_block, save_checkpoint, save_cycle_checkpoint

torch.set_num_threads(1)  # the CI machine has two shared cores; more threads only contend


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """family -> (folder, transformers model); each checkpoint written once per session."""
    cache = {}

    def make(family: str, **kwargs):
        key = (family, tuple(sorted(kwargs.items())))
        if key not in cache:
            folder = str(tmp_path_factory.mktemp(family.replace("-", "_")))
            cache[key] = (folder, save_checkpoint(folder, family, **kwargs))
        return cache[key]

    return make


@pytest.fixture(scope="session")
def target(checkpoint_factory) -> str:
    """The Llama-3 checkpoint that speculative decoding's drafts (draft models, EAGLE-3 heads) draft for."""
    return checkpoint_factory("llama3")[0]


@pytest.fixture(scope="session")
def kv_bytes_for():
    """(folder, num_blocks, block_size) -> kv_cache_memory_bytes giving exactly num_blocks."""
    return lambda folder, num_blocks, block_size: num_blocks * bytes_per_block(folder, block_size)


@pytest.fixture(scope="session")
def cycle_checkpoint(tmp_path_factory) -> str:
    """A Llama whose greedy tokens go round cycles of CYCLE_PERIOD ids (runtime_checkpoints.save_cycle_checkpoint)."""
    folder = str(tmp_path_factory.mktemp("cycle"))
    save_cycle_checkpoint(folder)
    return folder


def pytest_configure(config):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
