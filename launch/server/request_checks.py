"""Checks every request body passes: valid Unicode throughout, and no extra field that asks for something."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.routing import APIRoute
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field, ValidationError, model_validator

from shardserve.launch.server.api_error import APIError

# Fields OpenAI clients send that change nothing in what is generated: accepted (prompt_cache_key and user
# key a conversation's routing between replicas, launch/server/prefix_router.py).
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})


_T = TypeVar("_T")
# A list in a request body whose check stops at its first bad item: 15 MB of items of the wrong kind were millions of
# errors, seconds of work holding the GIL (every stream waited). Every list field of the API's bodies is one.
Items = Annotated[list[_T], Field(fail_fast=True)]


API_PATHS = ("/v1", "/tokenize", "/detokenize", "/invocations")  # the API's routes: keyed, and POSTs counted


def app_path(scope) -> str:
    """A request's path as the app's routes name it: a proxy's prefix (--root-path) taken off."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


MAX_BODY_DEPTH = 128  # how deeply a body's arrays and objects may nest (a JSON schema in it: at most 64)


async def json_body(request: Request) -> Any:
    """A route's own body, parsed off the event loop (a body near the size limit takes seconds to parse, and
    on the loop every stream would wait that long); not JSON, or nested past MAX_BODY_DEPTH, is a 400."""
    body = await request.body()
    try:
        return await asyncio.to_thread(_parsed, body)
    except (_TooDeep, RecursionError):
        raise APIError(400, f"the request body nests arrays and objects more than {MAX_BODY_DEPTH} deep") from None
    except ValueError:
        raise APIError(400, "the request body is not valid JSON") from None


class _TooDeep(Exception):
    pass


MAX_LISTED_ERRORS = 64  # a body with more type errors is answered with their count


def parsed_body(kind: type[BaseModel]):
    """A FastAPI dependency: the route's body as `kind`, parsed and validated off the event loop (FastAPI's own
    parse of a typed body runs on it: 15 MB of token ids held every stream and /health for 4 s), with the
    400s FastAPI gives (RequestValidationError). Use: body: Annotated[Kind, Depends(parsed_body(Kind))]."""
    async def read(request: Request) -> BaseModel:
        data = await json_body(request)
        try:
            return await asyncio.to_thread(kind.model_validate, data)
        except ValidationError as error:
            if error.error_count() > MAX_LISTED_ERRORS:  # (listing them all took seconds, holding the GIL)
                raise APIError(400, f"the request body has {error.error_count()} values that do not fit its "
                               "fields' types; see the API reference for each field") from None
            raise RequestValidationError([{**err, "loc": ("body", *err["loc"])}
                                          for err in error.errors(include_url=False)]) from None
    read.body_kind = kind  # type: ignore[attr-defined]  # for document_bodies
    return read


def document_bodies(app: FastAPI) -> None:
    """The OpenAPI document names each parsed_body route's body, as it would a typed body parameter's."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            _add_bodies(generate(), app.routes)  # (generate keeps the document as app.openapi_schema)
        return app.openapi_schema  # type: ignore[return-value]
    app.openapi = openapi  # type: ignore[method-assign]


def _add_bodies(document: dict, routes: list) -> None:
    components = document.setdefault("components", {}).setdefault("schemas", {})
    for route in routes:
        if not isinstance(route, APIRoute):
            continue
        for kind in filter(None, (getattr(d.call, "body_kind", None) for d in route.dependant.dependencies)):
            schema = kind.model_json_schema(ref_template="#/components/schemas/{model}")
            for name, definition in schema.pop("$defs", {}).items():
                components.setdefault(name, definition)
            components.setdefault(kind.__name__, schema)
            body = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{kind.__name__}"}}}}
            for method in route.methods or ():
                document["paths"][route.path_format][method.lower()]["requestBody"] = body


def _parsed(body: bytes) -> Any:
    data = json.loads(body)
    level, depth = [data], 0
    while level:  # breadth first, no recursion
        depth += 1
        if depth > MAX_BODY_DEPTH:
            raise _TooDeep
        level = [child for item in level if isinstance(item, (list, dict))
                 for child in (item.values() if isinstance(item, dict) else item)]
    return data


def is_neutral(name: str, value: Any) -> bool:
    """An extra field whose value asks for nothing (None, an empty list or mapping)."""
    return name in IGNORED_FIELDS or value is None or value == [] or value == {}


def refuse_unknown(model: BaseModel, where: str) -> None:
    """An extra field of `model` (at path `where`) is refused by name unless it asks for nothing."""
    for name, value in (model.model_extra or {}).items():
        if not is_neutral(name, value):
            raise APIError(400, f"{where}{name} is not supported: this server does not know it", f"{where}{name}")


def check_keys(item: dict, known: tuple[str, ...], where: str) -> None:
    """A key of a JSON object in the body (at path `where`) beyond `known` is refused by name unless it asks
    for nothing."""
    for key, value in item.items():
        if key not in known and not is_neutral(key, value):
            raise APIError(400, f"{where}.{key} is not supported: this server does not know it", f"{where}.{key}")


def required_string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{key}: a string is required", f"{where}.{key}")
    return value


def invalid_unicode_at(data: Any) -> str | None:
    """The path (messages.0.content) of the first string or key that is not valid Unicode, or None.
    NOTE: JSON's \\ud800 escapes decode to unpaired surrogates, which no UTF-8 encoder (the tokenizer,
    the response) takes; a bad key is reported as its mapping, so no message carries the bad text."""
    stack: list[tuple[tuple[str, ...], Any]] = [((), data)]
    while stack:  # NOTE: a loop, not recursion: the body may nest as deep as the JSON parser allowed
        path, value = stack.pop()
        if isinstance(value, str) and not _is_unicode(value):
            return ".".join(path) or "body"
        if isinstance(value, dict):
            if not all(_is_unicode(str(key)) for key in value):
                return ".".join(path) or "body"
            items = list(value.items())
        elif isinstance(value, list):
            items = list(enumerate(value))
        else:
            continue
        stack.extend(reversed([(path + (str(key),), item) for key, item in items
                               if isinstance(item, (str, dict, list))]))  # numbers: nothing to check
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class UnicodeBody(BaseModel):
    """A request body whose every string and key is valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _check_unicode(cls, data: Any) -> Any:
        # NOTE: an APIError, not a ValueError: pydantic lets it through untouched, so the 400 names the
        # field (a ValueError here would be reported at the body's root)
        where = invalid_unicode_at(data)
        if where is not None:
            raise APIError(400, f"{where}: the text is not valid Unicode (UTF-8): it holds an unpaired "
                           "surrogate", where)
        return data
