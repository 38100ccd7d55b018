"""Every command's and subcommand's --help at 80 columns says all it has to say: no description cut with
"..." (click cuts a docstring's first sentence to fit a command list; a short_help is never cut)."""

from __future__ import annotations

import pytest
import typer
from typer.main import get_command
from typer.testing import CliRunner

from shardserve.launch.cli import app

ROOT = get_command(app)


def command_paths(command, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The path of `command` and of every command under it (typer carries its own click: groups are the
    commands with subcommands)."""
    paths = [path]
    if hasattr(command, "commands"):
        for name, sub in command.commands.items():
            paths += command_paths(sub, (*path, name))
    return paths


def help_text(path: tuple[str, ...], program: typer.Typer = app) -> str:
    result = CliRunner().invoke(program, [*path, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0, result.output
    return result.output


def listed_commands(text: str) -> list[str]:
    """The lines of the help's Commands section."""
    _, found, rest = text.partition("\nCommands:\n")
    return [line for line in rest.splitlines() if line.strip()] if found else []


def test_the_walk_reaches_every_command():
    paths = command_paths(ROOT)
    assert ("cluster", "up") in paths and ("profiles", "show") in paths and ("models",) in paths
    assert len(paths) >= 14


@pytest.mark.parametrize("path", command_paths(ROOT), ids=lambda p: " ".join(p) or "shardserve")
def test_no_help_is_cut(path):
    text = help_text(path)
    assert "…" not in text, text
    for line in listed_commands(text):
        assert not line.rstrip().endswith("..."), f"cut: {line.strip()!r} in `shardserve {' '.join(path)} --help`"
    for line in text.splitlines():
        assert len(line) <= 80, f"wider than 80 columns: {line!r}"


def test_the_check_catches_a_cut_description():
    program = typer.Typer(rich_markup_mode=None)

    @program.command()
    def short() -> None:
        """Fits."""

    @program.command()
    def long() -> None:
        """A first sentence much too long to fit beside the command name in eighty columns, so click cuts it."""

    assert any(line.rstrip().endswith("...") for line in listed_commands(help_text((), program)))
