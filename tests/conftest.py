"""Test-wide settings, applied before any test module imports torch or triton, and the rule that a test
which starts a process is marked slow (`make test-fast` runs none of them)."""

import contextlib
import multiprocessing.process
import os
import subprocess

import pytest

# No GPU on the machines that run this suite: Triton kernels run in Triton's interpreter.
# It must be set before anything imports triton (transformers may, while building MoE
# models); tests/runtime/test_triton_compile.py compiles them for real in a clean process.
# A GPU run sets TRITON_INTERPRET=0 to keep compiled kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")
# No network either: a Hub id that is not cached fails at once, naming HF_HUB_OFFLINE (huggingface_hub reads
# it at import); tests/launch/test_hub_download.py turns it off for its own Hub on a loopback port.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Every way a test could start a process: subprocess (and asyncio's), multiprocessing, fork and spawn.
STARTS = ((subprocess.Popen, "_execute_child"), (multiprocessing.process.BaseProcess, "start"), (os, "fork"),
          (os, "forkpty"), (os, "posix_spawn"), (os, "posix_spawnp"), (os, "system"))


@contextlib.contextmanager
def starting_no_process(nodeid: str):
    """Within: starting a process fails the test, naming the marker it needs."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"{nodeid} starts a process: mark it @pytest.mark.slow (make test-fast starts none)")

    saved = [(owner, name, getattr(owner, name)) for owner, name in STARTS if hasattr(owner, name)]
    for owner, name, _ in saved:
        setattr(owner, name, refuse)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def pytest_collection_modifyitems(items):
    """The tests that start no process first: a module fixture that starts a server for a test not marked
    slow then starts inside that test, where the rule sees it, in `make test` as in `make test-fast`."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is not None)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if item.get_closest_marker("slow"):
        return (yield)
    with starting_no_process(item.nodeid):
        return (yield)


def pytest_sessionstart(session):
    """matplotlib (`plan --plot`) builds its font cache on first use by running fc-list: on a machine that never
    ran it, that first use is now, before any test, rather than inside one that the rule above would fail."""
    with contextlib.suppress(ImportError):
        import matplotlib.font_manager  # noqa: F401
