"""The wheel's contents, found from the folders: every subfolder of planner/, runtime/ and launch/ is a
subpackage and every file in them ships, so a new folder or data file cannot be left out of the wheel.

`shardserve` is a namespace package with no folder of its own; each top-level folder maps onto one part
of it (pyproject.toml holds the rest of the metadata). profiles/ ships as `shardserve/profiles/`, beside
`shardserve/launch/` as it sits beside launch/ in the checkout, so one relative path finds it in both.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
FOLDERS = {"shardserve.planner": "planner", "shardserve.runtime": "runtime", "shardserve.launch": "launch",
           "shardserve.profiles": "profiles"}
SKIPPED = {"__pycache__"}


def subpackages(name: str, folder: str) -> dict[str, str]:
    """{package name: its folder} for `folder` and every folder under it (data-only ones included)."""
    found = {name: folder}
    for path in sorted((HERE / folder).rglob("*")):
        relative = path.relative_to(HERE / folder)
        if path.is_dir() and not SKIPPED & set(relative.parts):
            found[".".join((name, *relative.parts))] = "/".join((folder, *relative.parts))
    return found


PACKAGES = {package: path for name, folder in FOLDERS.items() for package, path in subpackages(name, folder).items()}

setup(
    packages=list(PACKAGES),
    package_dir=dict(FOLDERS),
    package_data={package: ["*"] for package in PACKAGES},
    exclude_package_data={package: ["*.pyc"] for package in PACKAGES},
)
