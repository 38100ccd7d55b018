"""Tool calling (OpenAI's tools and tool_choice): what the chat template sees, the grammar that a
required or named call is sampled under, and the parsers that find calls in free text (vLLM's
--tool-call-parser names: hermes, llama3_json, openai).

    tool_choice none      the tools are not shown; plain text
    tool_choice auto      the model decides; the parser finds <tool_call> blocks (hermes), a JSON call, or
                          gpt-oss's messages to functions.NAME (openai: the harmony split finds them)
    tool_choice required  sampled under a grammar: a JSON list of {"name", "parameters"}, one or more
    a named function      sampled under the function's parameter schema: the output is its arguments
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from shardserve.launch.openai_api import harmony
from shardserve.planner.settings import BY_NAME
from shardserve.runtime.core.structured_output import StructuredOutputs, schema_text

PARSERS: tuple[str, ...] = BY_NAME["tool_call_parser"].choices or ()  # the setting's choices
HARMONY_PARSER = "openai"  # calls are harmony messages: reasoning parser openai_gptoss finds them
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ToolCallError(ValueError):
    """A tools request this server cannot honour; `field` names the request field."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools."""

    mode: str  # "auto" | "required" | "named"
    names: tuple[str, ...]
    parser: str | None = None  # for auto
    structured: StructuredOutputs | None = None  # for required and named


def plan_tools(tools: list[dict], choice, parser: str | None, auto_enabled: bool,
               parallel: bool = True, reasoning_parser: str | None = None) -> ToolPlan | None:
    """None when the tools play no part (tool_choice none, or neither tools nor tool_choice given).
    parallel False: one call at most."""
    if choice == "none" or (not tools and choice is None):
        return None
    if not tools:
        raise ToolCallError(f"tool_choice {_shown(choice)} needs tools: give the functions it may call", "tool_choice")
    functions = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if name not in functions:
            raise ToolCallError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return ToolPlan("named", (str(name),), structured=StructuredOutputs("json", schema_text(functions[name])))
    if choice == "required":
        return ToolPlan("required", tuple(functions),
                        structured=StructuredOutputs("json", schema_text(_required_schema(functions, parallel))))
    if choice not in (None, "auto"):
        raise ToolCallError(f"tool_choice {choice!r}: use none, auto, required or a named function", "tool_choice")
    if not (auto_enabled and parser):
        raise ToolCallError("tool_choice auto needs the server started with --enable-auto-tool-choice and "
                            f"--tool-call-parser ({' or '.join(PARSERS)}); or ask for required or a named function",
                            "tool_choice")
    if parser == HARMONY_PARSER and reasoning_parser != harmony.PARSER:
        raise ToolCallError(f"tool_choice auto: --tool-call-parser {HARMONY_PARSER} reads the calls that "
                            f"--reasoning-parser {harmony.PARSER} finds, and this server was started without it",
                            "tool_choice")
    return ToolPlan("auto", tuple(functions), parser=parser)


def _shown(choice) -> str:
    return repr(choice) if isinstance(choice, str) else "naming a function"


def _required_schema(functions: dict[str, dict], parallel: bool) -> dict:
    """A JSON list of one or more {"name", "parameters"} calls. NOTE: a "$ref": "#/$defs/X" in a function's
    parameters points at the root of the whole schema, so each function's $defs (and draft-07 definitions)
    move up to the root, as vLLM does; two functions defining one name differently cannot share it."""
    roots: dict[str, dict] = {"$defs": {}, "definitions": {}}
    calls = []
    for name, params in functions.items():
        params = dict(params)
        for key, shared in roots.items():
            for def_name, definition in (params.pop(key, None) or {}).items():
                if shared.setdefault(def_name, definition) != definition:
                    raise ToolCallError(f"tools: {key}.{def_name} is defined differently by two functions; "
                                        "tool_choice required needs one definition per name", "tools")
        calls.append({"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                      "properties": {"name": {"const": name}, "parameters": params}})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}} | ({} if parallel else {"maxItems": 1})
    return schema | {key: shared for key, shared in roots.items() if shared}


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages as chat templates expect them: tool-call arguments as mappings, not JSON text."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls:
            message = message | {"tool_calls": [call | {"function": call["function"] | {
                "arguments": _as_mapping(call["function"].get("arguments"), f"messages.{i}.tool_calls.{j}")}}
                for j, call in enumerate(calls)]}
        out.append(message)
    return out


def _as_mapping(arguments, where: str) -> dict:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise _not_an_object(where) from None
    if arguments is not None and not isinstance(arguments, dict):
        raise _not_an_object(where)
    return arguments or {}


def _not_an_object(where: str) -> ToolCallError:
    return ToolCallError(f"{where}.function.arguments: a tool call's arguments must be a JSON object",
                         f"{where}.function.arguments")


def extract_calls(plan: ToolPlan, text: str,
                  harmony_calls: tuple[tuple[str, str], ...] = ()) -> tuple[str | None, list[dict]]:
    """(content, tool_calls in OpenAI's shape) of a finished sample. A named or required call has content ""
    as on vLLM; a named call cut short by max_tokens keeps its arguments as far as they came. The openai
    parser's calls are the harmony split's (`harmony_calls`: name, arguments), `text` its content."""
    if plan.mode == "named":
        return "", [_call(plan.names[0], text)]
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text, []  # cut short by max_tokens: the text as it is
        return "", [_call(item["name"], json.dumps(item["parameters"])) for item in items]
    if plan.parser == HARMONY_PARSER:
        calls = [_call(name, arguments) for name, arguments in harmony_calls if name in plan.names]
        return (text or None) if calls else text, calls
    found = _parse_hermes(text) if plan.parser == "hermes" else _parse_llama3_json(text)
    if found is None:
        return text, []
    content, calls = found
    return content, [_call(name, json.dumps(arguments)) for name, arguments in calls if name in plan.names]


def _parse_hermes(text: str):
    calls = []
    for block in _HERMES.findall(text):
        try:
            call = json.loads(block)
            calls.append((call["name"], call.get("arguments", {})))
        except (ValueError, KeyError, TypeError):
            return None
    if not calls:
        return None
    content = _HERMES.sub("", text).strip()
    return content or None, calls


def _parse_llama3_json(text: str):
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return None
    calls = []
    for piece in body.split(";"):
        try:
            call = json.loads(piece)
            calls.append((call["name"], call.get("parameters", call.get("arguments", {}))))
        except (ValueError, KeyError, TypeError):
            return None
    return None, calls


def finish_reason(plan: ToolPlan, sample_finish: str | None, has_calls: bool) -> str | None:
    """As vLLM: tool_calls for calls found by auto or a required call that ended; a named call keeps the
    sample's own reason (stop, or length when max_tokens cut its arguments)."""
    if has_calls and (plan.mode == "auto" or (plan.mode == "required" and sample_finish == "stop")):
        return "tool_calls"
    return sample_finish


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}
