"""Find the YAML profiles people edit: their own folders, then the bundled ones."""

from __future__ import annotations

import os
from pathlib import Path

from shardserve.launch.deploy_config import DeployConfig, load_yaml_config
from shardserve.planner import PlanError

# profiles/ sits beside launch/ in the checkout, and the wheel installs it as shardserve/profiles/ beside
# shardserve/launch/ (setup.py), so one relative path finds the bundled profiles in both.
BUNDLED_DIR = Path(__file__).resolve().parent.parent / "profiles"


def profile_dirs() -> list[Path]:
    """SHARDSERVE_PROFILES (colon-separated) first, then ~/.config/shardserve/profiles, then
    the bundled ones."""
    dirs = [Path(p) for p in os.environ.get("SHARDSERVE_PROFILES", "").split(":") if p]
    dirs.append(Path.home() / ".config" / "shardserve" / "profiles")
    dirs.append(BUNDLED_DIR)
    return [d for d in dirs if d.is_dir()]


def list_profiles() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder in reversed(profile_dirs()):  # earlier folders override later ones
        for path in sorted(folder.glob("*.yaml")):
            found[path.stem] = path
    return dict(sorted(found.items()))


def find_profile(name: str) -> Path:
    path = Path(name).expanduser()
    if name.endswith((".yaml", ".yml")) or path.is_file():
        if not path.is_file():
            raise PlanError(f"profile file {path} does not exist")
        return path
    profiles = list_profiles()
    if name not in profiles:
        raise PlanError(f"no profile named {name!r}; available: {', '.join(profiles) or 'none'}"
                        " (or give a path to a YAML file)")
    return profiles[name]


def load_profile(name: str) -> DeployConfig:
    return load_yaml_config(find_profile(name))
