"""The product as users install it: the wheel built from the checkout holds every file of the packages and the
profiles, and once installed (not editable) into a fresh venv it imports every module and serves the demo
profile from a folder outside the checkout. The venv reuses this environment's dependencies (torch...) through
a .pth line, which adds their folder and none of its .pth files (so not this checkout's editable install)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.launch.conftest import post, start_server, stop_server

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# the folders the wheel installs, and where (setup.py's mapping)
SHIPPED = {"planner": "shardserve/planner", "runtime": "shardserve/runtime", "launch": "shardserve/launch",
           "profiles": "shardserve/profiles"}
# Imports every module of the installed package by its file, and prints where shardserve.launch came from.
IMPORT_ALL = """
import importlib, pathlib, shardserve.launch
root = pathlib.Path(shardserve.launch.__file__).parent.parent
names = sorted(".".join(("shardserve", *p.relative_to(root).with_suffix("").parts)) for p in root.rglob("*.py")
               if p.name != "__main__.py")
for name in names:
    importlib.import_module(name.removesuffix(".__init__"))
print(len(names), root)
"""


def checkout_files() -> set[str]:
    """What the wheel must hold: every file of the shipped folders, as its installed path."""
    found = set()
    for folder, installed in SHIPPED.items():
        for path in (REPO / folder).rglob("*"):
            relative = path.relative_to(REPO / folder)
            if path.is_file() and "__pycache__" not in relative.parts and path.suffix != ".pyc":
                found.add(f"{installed}/{relative.as_posix()}")
    return found


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> tuple[Path, str]:
    """(the wheel, pip's output) built as `pip wheel` builds it from a copy of the checkout."""
    setuptools = pytest.importorskip("setuptools")
    assert int(setuptools.__version__.split(".")[0]) >= 77, "the test extra installs setuptools>=77"
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                                 ".*_cache", ".hypothesis"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-v",
                           "-w", str(tmp / "dist")], cwd=source, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return next((tmp / "dist").glob("shardserve-*.whl")), done.stdout + done.stderr


@pytest.fixture(scope="module")
def venv(build, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed, not editable; this environment's packages after its own."""
    wheel, _ = build
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "--quiet", str(wheel)], check=True, timeout=300)
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(site) / "dependencies.pth").write_text("\n".join(sorted(ours)) + "\n")
    return root


def outside_env(tmp: Path) -> dict[str, str | None]:
    """No PYTHONPATH into the checkout, and a HOME of its own (no user profiles)."""
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    return {"PYTHONPATH": None, "HOME": str(home), "SHARDSERVE_PROFILES": None}


def test_building_the_wheel_warns_of_nothing(build):
    _, output = build
    warnings = [line for line in output.splitlines()
                if "warning" in line.lower() and "byte-compiling is disabled" not in line]
    assert not warnings, "\n".join(warnings)


def test_the_wheel_holds_every_file_of_the_packages(build):
    wheel, _ = build
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = checkout_files()
    assert {"shardserve/planner/catalog/models.yaml", "shardserve/launch/demo/model/model.safetensors",
            "shardserve/runtime/layers/quantization/fp8.py", "shardserve/profiles/demo.yaml"} <= expected
    assert not expected - names, sorted(expected - names)
    assert not {n for n in names if n.startswith("shardserve/")} - expected, "the wheel holds files not in the checkout"


def test_every_module_imports_from_the_installed_package(venv, tmp_path):
    env = {k: v for k, v in {**os.environ, **outside_env(tmp_path)}.items() if v is not None}
    done = subprocess.run([venv / "bin" / "python", "-c", IMPORT_ALL], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    count, root = done.stdout.split()
    assert Path(root).is_relative_to(venv), f"imported from {root}, not the installed package"
    assert int(count) == len([f for f in checkout_files() if f.endswith(".py") and not f.endswith("__main__.py")])


def test_the_installed_command_serves_the_demo_profile(venv, tmp_path):
    proc, url = start_server("--profile", "demo", program=[str(venv / "bin" / "shardserve")], cwd=str(tmp_path),
                             env=outside_env(tmp_path))
    try:
        status, body = post(url, "/v1/chat/completions", {
            "model": "shardserve-demo", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What is a list?"}]}, headers=None)
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] and body["usage"]["completion_tokens"] > 0
    finally:
        code, out = stop_server(proc)
    assert code == 0, out
    assert str(REPO) not in out, "the installed server read files from the checkout"
