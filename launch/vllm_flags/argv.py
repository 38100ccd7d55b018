"""A pasted `vllm serve` command line on `plan` or `launch`: each vLLM flag the command lacks is renamed to ours,
noticed (and dropped with its values) or refused, before click reads the arguments.

    launch MODEL --trust-remote-code --lora-modules a=/x b=/y -q awq --swap-space 4
    launch MODEL --lora-modules a=/x --lora-modules b=/y --quantization awq        + two notes on stderr

Our own flags pass as they are (vLLM's underscore spelling, --max_model_len, becomes ours); a flag neither has is
left for click to refuse. As argparse reads vLLM's nargs='+' flags, values run up to the next option, but the last
of them stays the positional MODEL when none was given before (`launch --allowed-media-domains a b MODEL`)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from shardserve.launch.vllm_flags.entry import Answer, Takes, VllmFlag
from shardserve.launch.vllm_flags.table import FLAGS

_NUMBER = re.compile(r"-\d+(\.\d+)?")  # a negative number is a value, not an option
_OPTIMIZATION = re.compile(r"-O(=?)(.*)")  # vLLM's -O3, -O=3, -O 3: --optimization-level
# vLLM's nargs='+' flags that launch takes once: what to do with several values
_ONE_HERE = {"--api-key": "several API keys; here one (--api-key, or SHARDSERVE_API_KEY)",
             "--served-model-name": "several names for the model; here one (vLLM's responses carry the first)"}
_BARE_HF_TOKEN = ("vLLM's bare --hf-token means the token `hf auth login` saved; here that token is used whenever "
                  "neither --hf-token TOKEN nor $HF_TOKEN gives one")


class VllmFlagRefused(ValueError):
    """A vLLM flag this command cannot honour; the message says what it is here and what to use. `notices`:
    what the flags before it were told, printed before the refusal."""

    notices: list[str] = []


@dataclass
class Rewritten:
    args: list[str]  # what click reads
    notices: list[str] = field(default_factory=list)  # one line per vLLM flag that changes nothing here


def is_option(token: str) -> bool:
    return token.startswith("-") and len(token) > 1 and not _NUMBER.fullmatch(token)


def dashed(name: str) -> str:
    """vLLM's --max_model_len as --max-model-len (underscores before a JSON key's '.' only, as vLLM reads them)."""
    if not name.startswith("--"):
        return name
    head, dot, key = name[2:].partition(".")
    return "--" + head.replace("_", "-") + dot + key


def answer_vllm_flags(app, argv: list[str]) -> list[str]:
    """`argv` (after the program's name) with vLLM's flags answered on `plan` and `launch`: notes on stderr; a
    refusal is one red line and exit 1."""
    command = next((a for a in argv if not a.startswith("-")), None)  # the root takes no option values
    if command not in ("plan", "launch"):
        return argv
    import typer.main
    from rich.markup import escape

    from shardserve.launch.cli_support import err
    at = argv.index(command)
    commands = getattr(typer.main.get_command(app), "commands")
    try:
        rewritten = rewrite(argv[at + 1:], command_options(commands[command]))
    except VllmFlagRefused as e:
        for line in e.notices:
            err.print(f"[yellow]note:[/] {escape(line)}", highlight=False)
        err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False)
        raise SystemExit(1) from None
    for line in rewritten.notices:
        err.print(f"[yellow]note:[/] {escape(line)}", highlight=False)
    return argv[:at + 1] + rewritten.args


def command_options(command) -> dict[str, bool]:
    """A click command's option strings, each to whether it takes a value (--help: no)."""
    options = {"--help": False}
    for param in command.params:
        if param.param_type_name == "option":
            options.update(dict.fromkeys([*param.opts, *param.secondary_opts], not param.is_flag))
    return options


def rewrite(args: list[str], options: Mapping[str, bool]) -> Rewritten:
    """`args`: what follows the command's name; `options`: the command's option strings, each to whether it
    takes a value. Raises VllmFlagRefused for a flag refused here."""
    scan = _Scan(args, options)
    try:
        return scan.run()
    except VllmFlagRefused as e:
        e.notices = scan.out.notices
        raise


class _Scan:
    def __init__(self, args: list[str], options: Mapping[str, bool]) -> None:
        self.args, self.options = args, options
        self.out = Rewritten([])
        self.noticed: set[str] = set()  # one line per flag, however often it is given
        self.i = 0
        self.has_target = any(a in ("--model", "-m") or a.startswith("--model=") for a in args)
        self.tokenizer: list[str] | None = None  # vLLM's --tokenizer, answered once the model is known

    def run(self) -> Rewritten:
        while self.i < len(self.args):
            token = self.args[self.i]
            if token == "--":
                self.out.args += self.args[self.i:]
                break
            self.i += 1
            if not is_option(token):
                self.out.args.append(token)
                self.has_target = True
            else:
                self._option(token)
        if self.tokenizer is not None:
            self._answer_tokenizer(self.tokenizer)
        return self.out

    def _answer_tokenizer(self, values: list[str]) -> None:
        """vLLM's --tokenizer naming the model itself changes nothing (its folder's tokenizer is read)."""
        model = next((self.out.args[i + 1] for i, a in enumerate(self.out.args[:-1]) if a in ("--model", "-m")),
                     next((a for a in self.out.args if not is_option(a)), None))
        if values and values == [model]:
            self._notice("--tokenizer", f"vLLM's --tokenizer {model} is the model's own: here the model folder's "
                                        "tokenizer is read, as it names")
        else:
            self._answer(FLAGS["--tokenizer"], "--tokenizer", "--tokenizer", values, final=True)

    def _option(self, token: str) -> None:
        name, eq, inline = token.partition("=") if token.startswith("--") else (token, "", "")
        value = inline if eq else None
        name = dashed(name)
        if name in self.options:
            self._ours(name, value)
        elif (flag := FLAGS.get(name.split(".")[0])) is not None and not (eq and flag.takes is Takes.NOTHING):
            self._answer(flag, name, token, self._take(flag.takes, value))
        elif (level := _OPTIMIZATION.fullmatch(token)) is not None:
            level_value = level.group(2) if level.group(1) or level.group(2) else self._next(("0", "1", "2", "3"))
            self._answer(FLAGS["--optimization-level"], "-O", token, [level_value] if level_value else [])
        else:
            self.out.args.append(token)  # no flag of ours nor of vLLM's: click says so

    def _ours(self, name: str, value: str | None) -> None:
        if not self.options[name]:
            self.out.args.append(name if value is None else f"{name}={value}")  # click refuses a switch's value
            return
        if name == "--hf-token" and value is None and (self.i == len(self.args) or is_option(self.args[self.i])):
            self._notice("--hf-token", _BARE_HF_TOKEN)
            return
        first = value if value is not None else self._next(anything=True)
        if first is None:
            self.out.args.append(name)  # click says it needs a value
        elif name == "--lora-modules":
            self._repeat(name, [first] + self._run(_is_adapter), _adapters)
        elif name == "--allowed-origins":
            self._repeat(name, [first], _origins)
        elif name in _ONE_HERE and value is None and (extra := self._run(lambda _: True, taken=1)):
            raise VllmFlagRefused(f"vLLM's {name} with {1 + len(extra)} values: {_ONE_HERE[name]}")
        elif name == "--max-model-len" and first == "-1":  # vLLM's other spelling of auto (the longest that fits)
            self.out.args += [name, "auto"]
        else:
            self.out.args += [name, first] if value is None else [f"{name}={value}"]

    def _repeat(self, name: str, values: list[str], expand) -> None:
        for value in values:
            for item in expand(value):
                self.out.args += [name, item]

    def _take(self, takes: Takes, value: str | None) -> list[str]:
        if value is not None or takes is Takes.NOTHING:
            return [] if value is None else [value]
        if takes is Takes.ONE:
            one = self._next()
            return [] if one is None else [one]
        return self._run(lambda _: True, taken=0)

    def _next(self, wanted: tuple[str, ...] = (), anything: bool = False) -> str | None:
        """The next token as a value (any token, when `anything`, as click takes one), or None."""
        if self.i >= len(self.args):
            return None
        token = self.args[self.i]
        if not anything and (is_option(token) or (wanted and token not in wanted)):
            return None
        self.i += 1
        return token

    def _run(self, fits, taken: int | None = None) -> list[str]:
        """The values that follow, up to the next option or the first that does not fit. Given the number of
        values the flag has `taken` already, the last is left as MODEL when no MODEL came before (and the flag
        keeps one value)."""
        end = self.i
        while end < len(self.args) and not is_option(self.args[end]) and fits(self.args[end]):
            end += 1
        if taken is not None and not self.has_target and taken + end - self.i > 1:
            end -= 1
        values, self.i = self.args[self.i:end], end
        return values

    def _answer(self, flag: VllmFlag, name: str, token: str, values: list[str], final: bool = False) -> None:
        if flag.name == "--tokenizer" and not final:
            self.tokenizer = values  # answered at the end: it may name the model given after it
            return
        shown = name if name == flag.name else f"{name} ({flag.name})"
        if flag.accepted:
            shown = " ".join([shown, *values])
        if flag.answer is Answer.RENAME:
            self._rename(flag.text, token, values)
        elif flag.answer is Answer.NOTICE or flag.is_accepted(values):
            self._notice(flag.name, f"vLLM's {shown} changes nothing here: {flag.text}")
        else:
            raise VllmFlagRefused(f"vLLM's {shown} is not taken here: {flag.text}")

    def _rename(self, ours: str, token: str, values: list[str]) -> None:
        if ours not in self.options:  # a flag of the other command (plan has no --no-enable-chunked-prefill)
            self.out.args += [token] if "=" in token else [token, *values]
        elif "=" in token:
            self.out.args.append(f"{ours}={values[0]}")
        else:
            self.out.args += [ours, *values]

    def _notice(self, name: str, line: str) -> None:
        if name not in self.noticed:
            self.noticed.add(name)
            self.out.notices.append(line)


def _is_adapter(token: str) -> bool:
    """A --lora-modules value (name=path, or vLLM's JSON); anything else after it is MODEL."""
    return "=" in token or token.startswith(("{", "["))


def _adapters(value: str) -> list[str]:
    """vLLM's JSON forms of --lora-modules as name=path; other JSON is left for the server to refuse by its text."""
    if not value.startswith(("{", "[")):
        return [value]
    try:
        parsed = json.loads(value)
    except ValueError:
        return [value]
    items = parsed if isinstance(parsed, list) else [parsed]
    if all(isinstance(item, dict) and set(item) == {"name", "path"} for item in items):
        return [f"{item['name']}={item['path']}" for item in items]
    return [value]


def _origins(value: str) -> list[str]:
    """vLLM's --allowed-origins '["https://a", "https://b"]' (a JSON list) as one value each."""
    try:
        parsed = json.loads(value)
    except ValueError:
        return [value]
    is_list = isinstance(parsed, list) and all(isinstance(item, str) for item in parsed)
    return parsed if is_list and parsed else [value]
