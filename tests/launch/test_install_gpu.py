"""The GPU install paths agree: `make install-gpu`, the Dockerfile and pyproject's extras name the same torch,
the same CUDA index and the same extras, read from each file (no copy of their values lives here)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from shardserve.planner.settings import default

REPO = Path(__file__).resolve().parents[2]


def make_variables() -> dict[str, str]:
    """The Makefile's `NAME ?= value` and `NAME := value` lines."""
    found = re.findall(r"^(\w+)\s*[?:]?=\s*(.*?)\s*$", (REPO / "Makefile").read_text(), re.M)
    return dict(found)


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) in order; continuation lines joined, comments dropped."""
    lines = [line for line in (REPO / "Dockerfile").read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^(\w+)\s+(.*)$", joined, re.M)]


def docker_args() -> dict[str, str]:
    return dict(args.split("=", 1) for instruction, args in dockerfile() if instruction == "ARG" and "=" in args)


def docker_runs() -> list[str]:
    """Each shell command of the RUN instructions, `&&` split, in order."""
    return [part.strip() for instruction, args in dockerfile() if instruction == "RUN" for part in args.split("&&")]


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def make_dry_run(target: str, tmp_path: Path) -> list[str]:
    """What `make TARGET` runs in a fresh clone (a venv that does not exist yet)."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    # --no-print-directory: under `make test` this make is nested, and would add "Leaving directory" lines
    done = subprocess.run(["make", "--no-print-directory", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=REPO,
                          capture_output=True, text=True, check=True)
    return done.stdout.splitlines()


def test_same_torch_and_index_in_make_and_docker():
    make, docker = make_variables(), docker_args()
    assert docker["TORCH_SPEC"] == make["TORCH_SPEC"]
    assert docker["TORCH_INDEX"] == make["TORCH_INDEX"]
    cuda = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-(runtime|devel)-ubuntu[\d.]+", docker["CUDA_IMAGE"])
    assert cuda, docker["CUDA_IMAGE"]
    assert make["TORCH_INDEX"] == f"https://download.pytorch.org/whl/cu{cuda.group(1)}{cuda.group(2)}", \
        "the base image's CUDA and torch's CUDA build differ"


def test_same_extras_and_they_exist():
    make, docker, extras = make_variables(), docker_args(), pyproject()["project"]["optional-dependencies"]
    assert docker["EXTRAS"] == make["SERVER_EXTRAS"]
    server = make["SERVER_EXTRAS"].split(",")
    assert set(server) <= set(extras) and "gpu" in server and "ray" in server
    assert any(line.startswith("ray[default]") for line in extras["ray"])
    # the GPU extra is what serving needs anywhere, plus Triton; the demo's lean venv has no Triton
    assert "shardserve[runtime]" in extras["gpu"] and any(line.startswith("triton") for line in extras["gpu"])
    assert not any(line.startswith("triton") for line in extras["runtime"])
    # `make install` (the test extra) keeps everything a server has, so CPU tests cover the same packages
    assert any(line.startswith(f"shardserve[{make['SERVER_EXTRAS']}]") for line in extras["test"])


def test_docker_installs_torch_from_the_index_before_the_extras():
    runs = docker_runs()
    torch_at = next(i for i, run in enumerate(runs) if "${TORCH_SPEC}" in run)
    assert shlex.split(runs[torch_at])[-2:] == ["--index-url", "${TORCH_INDEX}"]
    # the image installs the wheel that `pip wheel` builds from the source, as the installed-package test does
    assert "pip wheel --no-deps --wheel-dir /wheels /src" in runs
    extras_at = next(i for i, run in enumerate(runs) if run == 'pip install "$(echo /opt/wheels/shardserve-*.whl)[${EXTRAS}]"')
    assert torch_at < extras_at
    steps = dockerfile()
    copy_at = next(i for i, (instruction, args) in enumerate(steps) if instruction == "COPY" and "--from=wheel" in args)
    assert copy_at > next(i for i, (_, args) in enumerate(steps) if "${TORCH_SPEC}" in args), \
        "the wheel is copied after torch's layer, so an edit does not download torch again"
    python = docker_args()["PYTHON_VERSION"]
    assert python == pyproject()["tool"]["mypy"]["python_version"]
    assert any(run.startswith("python${PYTHON_VERSION} -m venv") for run in runs)


@pytest.mark.slow
def test_docker_runs_shardserve_as_a_user_on_the_default_port():
    steps = dockerfile()
    user = [args for instruction, args in steps if instruction == "USER"]
    assert user and user[-1] not in ("root", "0")
    entry = next(args for instruction, args in steps if instruction == "ENTRYPOINT")
    assert entry == '["shardserve"]' and "shardserve" in pyproject()["project"]["scripts"]
    assert [args for instruction, args in steps if instruction == "EXPOSE"] == [str(default("port"))]
    assert default("host") == "127.0.0.1", "the Dockerfile and README tell users to pass --host 0.0.0.0"
    command = json.loads(next(args for instruction, args in steps if instruction == "CMD"))
    done = subprocess.run([sys.executable, "-m", "shardserve.launch", *command], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr


def test_dockerignore_leaves_out_the_venv_and_build_outputs():
    ignored = {line.strip().rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()}
    assert {".git", ".venv", "build", "*.egg-info"} <= ignored


@pytest.mark.slow
def test_make_install_gpu_is_install_with_the_cuda_torch(tmp_path):
    make = make_variables()
    gpu, cpu = make_dry_run("install-gpu", tmp_path), make_dry_run("install", tmp_path)
    torch_gpu = next(line for line in gpu if f'"{make["TORCH_SPEC"]}"' in line)
    assert torch_gpu.endswith(f"--index-url {make['TORCH_INDEX']}")
    assert gpu.index(torch_gpu) > next(i for i, line in enumerate(gpu) if "pip uninstall" in line)
    assert gpu.index(torch_gpu) < next(i for i, line in enumerate(gpu) if f".[{make['SERVER_EXTRAS']},test]" in line)
    assert gpu[-1].endswith("bin/shardserve doctor")
    # the CPU path: the pinned torch from the default index, what serving needs, then the test extra
    assert not any("--index-url" in line or "uninstall" in line for line in cpu)
    installs = [line.split(" pip install ", 1)[1] for line in cpu if " pip install " in line]
    assert installs[1:] == [f'"{make["TORCH_SPEC"]}"', "-e '.[runtime]'", "-e '.[test]'"], installs


@pytest.mark.slow
def test_make_demo_installs_what_serving_needs_and_says_so(tmp_path):
    demo = make_dry_run("demo", tmp_path)
    installs = [line.split(" pip install ", 1)[1] for line in demo if " pip install " in line]
    make = make_variables()
    assert installs == ["--upgrade pip", f'"{make["TORCH_SPEC"]}"', "-e '.[runtime]'"], "pip shows its progress"
    steps = [line for line in demo if line.startswith("printf '\\n==> %s\\n'")]
    assert len(steps) == 3 and all(f"[{i}/3]" in step for i, step in enumerate(steps, 1)), steps
