"""Command-line options made from the settings table, so `plan` and `launch` never restate one."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Optional

import typer

from shardserve.planner.settings import BY_NAME, INPUT, PLAN, SETTINGS, Setting, SettingError

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
    if setting.human_readable:
        text += " Also 32k (x1000) or 32K (x1024), as vLLM reads it."
    return text


def _parameter(setting: Setting) -> inspect.Parameter:
    decls = [setting.flag] + ([setting.short] if setting.short else [])
    if setting.type is bool:
        decls = [f"{setting.flag}/--no-{setting.flag[2:]}"]
    is_text = bool(setting.words) or setting.human_readable  # read by the table's own check
    parser: dict[str, Any] = {"parser": _checked(setting),
                              "metavar": "<" + "|".join(("int",) + setting.words) + ">"} if is_text else {}
    option = typer.Option(*decls, help=_help(setting), show_default=False, **parser)
    kind = list[str] if setting.type is list else setting.type  # a list: the flag given once per item
    kind = str if is_text else kind
    annotation = Annotated[Optional[kind], option]  # type: ignore[valid-type]  # a type made at run time
    return inspect.Parameter(setting.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)


def _checked(setting: Setting) -> Callable[[str], object]:
    """A flag that takes a number, one of the setting's words or a human-readable count
    (--max-model-len 4096, 32k or auto): the settings table reads it, as it reads a profile's."""
    def parse(text: str):
        if not setting.human_readable and text not in setting.words:
            try:
                text = setting.type(text)
            except ValueError:
                pass  # the table's check names what it takes
        try:
            return setting.check(text)
        except SettingError as e:
            raise typer.BadParameter(str(e)) from None
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
