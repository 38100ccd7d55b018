"""The README and the user guide followed literally on a CPU machine: every command of every block runs as
written (in a fresh folder holding `.venv/bin/shardserve`), the demo on free ports, each with its exit code
checked. The documents are read in order, README first: a file one makes (plan.yaml), another uses.

What cannot be literal is named here, and must still be in the README: the port (8000 and 8001 become
free ports), placeholders (`./my-model` is a copy of the demo model), and the commands that need GPUs,
a Ray cluster or a second host."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from shardserve.launch.demo import DEMO_MODEL_DIR
from tests.launch.conftest import free_port, http, stop_server, wait_healthy

pytestmark = pytest.mark.slow  # every test here starts a process

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = (README, REPO / "docs" / "guide.md", REPO / "docs" / "server.md")  # deploy.md: tests/launch/test_deploy*
COMMAND_SECONDS = 300
NEEDS_CLUSTER = "needs a Ray cluster"
NEEDS_GPU = "needs a GPU machine and CUDA wheels (test_install_gpu checks the Makefile and the Dockerfile)"
SKIPPED = {  # command (whitespace collapsed) -> why it cannot run on one CPU machine
    "make test": "the suite itself (`make -n test` checks the target)",
    "make test-fast": "the suite itself (`make -n test-fast` checks the target)",
    "make install-gpu": NEEDS_GPU,
    "docker build -t shardserve .": NEEDS_GPU,
    "docker run --gpus all --ipc=host -p 8000:8000 -v ~/.cache/huggingface:/home/shardserve/.cache/huggingface "
    "shardserve launch --model Qwen/Qwen3-8B --host 0.0.0.0": NEEDS_GPU,
    "shardserve plan --model meta-llama/Llama-3.1-405B-Instruct --ray-address auto": NEEDS_CLUSTER,
    "shardserve doctor --ray-address auto": NEEDS_CLUSTER,
    "shardserve launch --model Qwen/Qwen3-8B": "downloads Qwen3-8B from the Hub (test_hub_download serves a Hub "
                                               "id from a stand-in Hub; test_launch a cached one)",
    "vllm serve meta-llama/Llama-3.1-70B-Instruct --tensor-parallel-size 8 --max-model-len 32768 "
    "--gpu-memory-utilization 0.9 --enable-prefix-caching --api-key $KEY": "vLLM's own command, for comparison",
}
REFUSED_ON_CPU = {  # command -> what it says, exit 1: plan.yaml (from the Plan section) is for 3xL4
    "shardserve launch plan.yaml": "the plan needs 3 GPU(s)",
    "shardserve launch llama70b.yaml --api-key $KEY": "the plan needs 4 GPU(s)",
}
FAILS_A_CHECK_ON_CPU = {"shardserve doctor --plan plan.yaml": "gpus"}


@dataclass
class Block:
    section: str
    language: str
    text: str


def readme_blocks() -> list[Block]:
    blocks = []
    for doc in DOCS:
        section = doc.name
        for match in re.finditer(r"^(#+ [^\n]*)$|^```(\w+)\n(.*?)^```$", doc.read_text(), re.M | re.S):
            if match.group(1):
                section = match.group(1).lstrip("# ")
            else:
                blocks.append(Block(section, match.group(2), match.group(3)))
    return blocks


def commands(text: str) -> list[str]:
    """Split a bash block into its commands: a command ends where its quotes close and no `\\` follows."""
    found, current = [], ""
    for line in text.splitlines():
        current += line + "\n"
        try:
            words = shlex.split(current, comments=True)
        except ValueError:  # a quote still open
            continue
        if line.endswith("\\"):
            continue
        if words:
            found.append(current.strip())
        current = ""
    return found


def plain(command: str) -> str:
    return " ".join(shlex.split(command.replace("\\\n", " "), comments=True))  # `\` + newline: one line


class Folder:
    """A fresh folder as a newcomer has it after `make`: .venv/bin/{shardserve,python} and the
    README's placeholders."""

    def __init__(self, root: Path):
        self.root = root
        bin_dir = root / ".venv" / "bin"
        bin_dir.mkdir(parents=True)
        for name, target in (("python", f'"{sys.executable}"'), ("shardserve", f'"{sys.executable}" -m shardserve.launch')):
            (bin_dir / name).write_text(f'#!/bin/sh\nexec {target} "$@"\n')
            (bin_dir / name).chmod(0o755)
        my_model = root / "my-model"
        shutil.copytree(DEMO_MODEL_DIR, my_model)
        config = (my_model / "config.json").read_text()
        (my_model / "config.json").write_text(re.sub(r'"max_position_embeddings": \d+', '"max_position_embeddings": 8192',
                                                     config))
        (root / "my-model-folder").symlink_to(my_model)
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "KEY": "readme-key", "NO_COLOR": "1",
                    "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
        self.env.pop("RAY_ADDRESS", None)

    def run(self, command: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", command], cwd=self.root, env=self.env, capture_output=True, text=True,
                              timeout=COMMAND_SECONDS)

    def serve(self, command: str) -> tuple[subprocess.Popen, int]:
        port = free_port()
        command = re.sub(r"\s+#[^'\"]*$", "", command)  # the README's trailing comment
        if "--port" in command:
            command = re.sub(r"--port \d+", f"--port {port}", command)
        else:
            command += f" --port {port}"
        proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=self.root, env=self.env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=COMMAND_SECONDS)
        return proc, port


def stop(proc: subprocess.Popen) -> str:
    code, out = stop_server(proc, signal.SIGINT)  # Ctrl-C, as the README says
    assert code == 0, out[-3000:]
    return out


def check_served(folder: Folder, command: str) -> None:
    """A `shardserve launch` line: it serves, /v1/models names what the README says, ^C exits 0."""
    proc, port = folder.serve(command)
    try:
        key = {"Authorization": "Bearer readme-key"} if "--api-key" in command else {}
        status, body = http(f"http://127.0.0.1:{port}/v1/models", headers=key)
        assert status == 200, body
        expected = "./my-model" if "./my-model" in command else "shardserve-demo"
        assert f'"id":"{expected}"' in body.replace(" ", ""), body
    finally:
        out = stop(proc)
    assert f"curl http://localhost:{port}/v1/completions" in out


def check_command(folder: Folder, command: str) -> None:
    key = plain(command)
    if key in REFUSED_ON_CPU or key in FAILS_A_CHECK_ON_CPU:
        done = folder.run(command)
        assert done.returncode == 1, done.stdout + done.stderr
        assert (REFUSED_ON_CPU.get(key) or FAILS_A_CHECK_ON_CPU[key]) in done.stdout + done.stderr
    elif key.startswith(("shardserve launch", "make demo")):
        check_served(folder, command if key != "make demo" else demo_recipe())
    else:
        done = folder.run(command)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        if key.startswith("curl "):  # curl exits 0 on any HTTP status
            assert '"choices"' in done.stdout, done.stdout


def demo_recipe() -> str:
    """What `make demo` runs after setting up .venv: the Makefile's last line for it."""
    recipe = re.search(r"^demo:.*?\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.M).group(1)
    return recipe.strip().splitlines()[-1].strip().replace("$(VENV)", ".venv")


def is_skipped(command: str) -> bool:
    key = plain(command)
    return key in SKIPPED or key.startswith(("shardserve cluster", "scp ")) or "--ray-address" in key


def test_every_exception_is_still_in_the_readme():
    written = {plain(c) for b in readme_blocks() if b.language == "bash" for c in commands(b.text)}
    for command in [*SKIPPED, *REFUSED_ON_CPU, *FAILS_A_CHECK_ON_CPU]:
        assert command in written, f"{command!r} is no longer in the docs: update {Path(__file__).name}"
    if shutil.which("make") is None:
        return
    for target in ("test", "test-fast", "demo", "install-gpu"):
        assert subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True).returncode == 0


@pytest.mark.slow
def test_the_readme_as_written(tmp_path):
    if shutil.which("curl") is None:
        pytest.skip("the README's examples use curl")
    folder, started = Folder(tmp_path), time.monotonic()
    demo = None
    for block in readme_blocks():
        if block.language == "yaml" and block.text.startswith("nodes:"):
            (folder.root / "hardware.yaml").write_text(block.text)
            check_command(folder, "shardserve plan --model Qwen/Qwen3-8B --hardware hardware.yaml")
        elif block.language == "python":
            run_python(folder, block, demo)
        elif block.language == "bash":
            demo = run_bash(folder, block, demo)
    assert demo is None
    assert time.monotonic() - started < 1200


def run_bash(folder: Folder, block: Block, demo: tuple | None) -> tuple | None:
    """Run a bash block; `make demo` keeps serving (its port as the README's 8000) for the next block."""
    for command in commands(block.text):
        if is_skipped(command):
            continue
        if plain(command) == "make demo":
            proc, port = folder.serve(demo_recipe())
            demo = (proc, port)
            continue
        if demo is not None:
            command = command.replace("localhost:8000", f"localhost:{demo[1]}")
        check_command(folder, command)
    if demo is not None and "make demo" not in block.text:
        stop(demo[0])
        return None
    return demo


def run_python(folder: Folder, block: Block, demo: tuple | None) -> None:
    """A Python block as a script; one that continues the one before (no imports) gets its imports."""
    source = block.text
    if not source.lstrip().startswith(("from ", "import ")):
        source = "from shardserve.runtime import LLM, SamplingParams\n" + source
    done = folder.run(f".venv/bin/python - <<'EOF'\n{source}EOF\n")
    assert done.returncode == 0, f"{block.text}\n{done.stderr[-3000:]}"
