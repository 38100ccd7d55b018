"""What the command line's modules share: the error console, output formats, printing data,
and turning bad input into one red line."""

from __future__ import annotations

import contextlib
import enum
import json

import typer
from rich.console import Console

err = Console(stderr=True, soft_wrap=True)  # an error line is never broken mid-path


class Format(str, enum.Enum):
    table = "table"
    json = "json"
    yaml = "yaml"


def print_data(data: dict, format: Format) -> None:
    if format is Format.json:
        print(json.dumps(data, indent=2))
    else:
        import yaml
        print(yaml.safe_dump(data, sort_keys=False), end="")


@contextlib.contextmanager
def user_errors():
    """Bad input becomes one red line on stderr and the planner's exit code, no traceback."""
    from shardserve.planner import PlanError
    try:
        yield
    except PlanError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False)
        raise typer.Exit(e.exit_code) from None


@contextlib.contextmanager
def refusal_as_data(format: str | None):
    """With --format json or yaml, a refused plan is data on stdout as well ({"error": {"message", "exit_code",
    "infeasible"}}), for the script that reads it; the red line and the exit code stay (user_errors, outside)."""
    from shardserve.planner import InfeasibleError, PlanError
    try:
        yield
    except PlanError as e:
        if format is not None:
            print_data({"error": {"message": str(e), "exit_code": e.exit_code,
                                  "infeasible": isinstance(e, InfeasibleError)}}, Format(format))
        raise
