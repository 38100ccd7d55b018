"""Read a user's YAML file (hardware, profile, plan) with errors that name the file."""

from __future__ import annotations

from pathlib import Path

import yaml

from shardserve.planner.errors import PlanError


def read_yaml(path: str | Path, what: str) -> tuple[object, str]:
    """(parsed data, raw text); `what` names the file in errors ("hardware file", "plan")."""
    try:
        text = Path(path).read_text()
        return yaml.safe_load(text), text
    except OSError as e:
        raise PlanError(f"cannot read {what} {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise PlanError(f"{what} {path} is not valid YAML: {e}") from None
