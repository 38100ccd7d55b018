"""The one grammar a request asks for: vLLM's structured_outputs object, its older guided_* fields, or
OpenAI's response_format. Any one of them; two at once are refused by name."""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from shardserve.launch.server.api_error import APIError
from shardserve.launch.server.request_checks import refuse_unknown
from shardserve.runtime.core.structured_output import StructuredOutputs

GUIDED_FIELDS = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                 ("guided_grammar", "grammar"))


class StructuredOutputsParams(BaseModel):
    """vLLM's structured_outputs: one constraint (json, regex, choice, grammar or json_object) and options."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)  # an unknown key is refused by name
    json_schema: Optional[Union[str, dict[str, Any]]] = Field(None, alias="json")  # (json shadows BaseModel's)
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[Union[str, dict[str, Any]]] = None
    whitespace_pattern: Optional[str] = None
    disable_additional_properties: bool = False
    # NOTE: JSON is always generated without free whitespace and with no fallback to another backend, so
    # both options hold whatever their value: true is what happens, false (the default) allows it
    disable_any_whitespace: bool = False
    disable_fallback: bool = False

    @property
    def field(self) -> str:
        """The key that asks for the grammar (structured_outputs.regex), to name in an error."""
        given = (("json", self.json_schema), ("regex", self.regex), ("choice", self.choice),
                 ("grammar", self.grammar), ("json_object", self.json_object or None))
        return next((f"structured_outputs.{kind}" for kind, spec in given if spec is not None), "structured_outputs")

    def asked(self) -> list[tuple[str, str, Any]]:
        """(field, kind, spec) of each constraint given; options this server cannot honour are refused."""
        refuse_unknown(self, "structured_outputs.")
        for name in ("structural_tag", "whitespace_pattern"):
            if getattr(self, name) is not None:
                raise APIError(400, f"structured_outputs.{name} is not supported: use json, regex, choice, "
                               "grammar or json_object", f"structured_outputs.{name}")
        if self.disable_additional_properties:
            raise APIError(400, "structured_outputs.disable_additional_properties is not supported: write "
                           '"additionalProperties": false into the schema', "structured_outputs.disable_additional_properties")
        given = [("json", self.json_schema), ("regex", self.regex), ("choice", self.choice), ("grammar", self.grammar)]
        asked: list[tuple[str, str, Any]] = [(f"structured_outputs.{kind}", kind, spec)
                                             for kind, spec in given if spec is not None]
        if self.json_object:
            asked.append(("structured_outputs.json_object", "json_object", None))
        return asked


def _from_response_format(form: dict) -> list[tuple[str, str, Any]]:
    kind = form.get("type")
    if kind == "json_object":
        return [("response_format", "json_object", None)]
    if kind == "json_schema":
        named = form.get("json_schema")
        schema = named.get("schema") if isinstance(named, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "response_format json_schema needs json_schema.schema", "response_format")
        return [("response_format", "json", schema)]
    if kind not in (None, "text"):
        raise APIError(400, f"response_format type {kind!r}: use text, json_object or json_schema", "response_format")
    return []


def asked_grammars(guided: dict[str, Any], response_format: dict | None,
                   params: StructuredOutputsParams | None) -> list[tuple[str, str, Any]]:
    """(field, kind, spec) of every constraint the request gives; `guided` maps each guided_* field to its value."""
    asked = [(name, kind, guided[name]) for name, kind in GUIDED_FIELDS if guided.get(name) is not None]
    asked += _from_response_format(response_format or {})
    return asked + (params.asked() if params is not None else [])


def structured_outputs(asked: list[tuple[str, str, Any]]) -> StructuredOutputs | None:
    """The one grammar of `asked` (asked_grammars), or None; two or more are a 400."""
    if len(asked) > 1:
        raise APIError(400, f"ask for one structured output, not {' and '.join(a[0] for a in asked)}", asked[1][0])
    if not asked:
        return None
    name, kind, spec = asked[0]
    try:
        if kind == "json" and isinstance(spec, str):  # a schema as JSON text: its size first, then parsed
            StructuredOutputs(kind, spec).check_size()
            spec = json.loads(spec)
            if not isinstance(spec, dict):
                raise ValueError("a JSON schema is a JSON object")
        return StructuredOutputs(kind, spec)
    except ValueError as error:
        raise APIError(400, f"{name}: {error}", name) from None
