"""Command-line options made from the settings table, so `plan` and `launch` never restate one."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Optional

import typer

from shardserve.planner.settings import BY_NAME, INPUT, PLAN, SETTINGS, Setting

# Settings that need a shape of their own on the command line (a list, a mapping); --set takes any.
_NOT_FLAGS = {"layer_split", "env", "description"}


def plan_command_settings() -> list[str]:
    return [s.name for s in SETTINGS if s.layers & {INPUT, PLAN} and s.name not in _NOT_FLAGS]


def launch_command_settings() -> list[str]:
    return [s.name for s in SETTINGS if s.in_profile and s.name not in _NOT_FLAGS]


def _help(setting: Setting) -> str:
    text = setting.help
    if setting.choices is not None and "one of" not in text:
        text += f" One of: {', '.join(map(str, setting.choices))}."
    if setting.default is not None and "Default" not in text and "default" not in text:
        text += f" Default: {setting.default}."
    return text


def _parameter(setting: Setting) -> inspect.Parameter:
    decls = [setting.flag] + ([setting.short] if setting.short else [])
    if setting.type is bool:
        decls = [f"{setting.flag}/--no-{setting.flag[2:]}"]
    parser: dict[str, Any] = {"parser": _word_or_number(setting)} if setting.words else {}
    option = typer.Option(*decls, help=_help(setting), show_default=False, **parser)
    kind = list[str] if setting.type is list else setting.type  # a list: the flag given once per item
    kind = str if setting.words else kind
    annotation = Annotated[Optional[kind], option]  # type: ignore[valid-type]  # a type made at run time
    return inspect.Parameter(setting.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)


def _word_or_number(setting: Setting) -> Callable[[str], object]:
    """A flag that takes a number or one of the setting's words (--max-model-len 4096 or auto)."""
    def parse(text: str):
        if text in setting.words:
            return text
        try:
            return setting.type(text)
        except ValueError:
            raise typer.BadParameter(f"{text!r} is not {setting.type.__name__}"
                                     + "".join(f" or {w!r}" for w in setting.words)) from None
    return parse


def setting_options(names: Iterable[str]) -> Callable:
    """Give a command `def command(..., **settings)` one option per setting in `names` (None when
    not given); typer reads the signature made here."""
    def decorate(func: Callable) -> Callable:
        signature = inspect.signature(func, eval_str=True)  # NOTE: typer reads __signature__ as is
        kept = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        added = [_parameter(BY_NAME[name]) for name in names]
        func.__signature__ = signature.replace(parameters=kept + added)  # type: ignore[attr-defined]
        func.__annotations__ = {**func.__annotations__, **{p.name: p.annotation for p in added}}
        return func
    return decorate
