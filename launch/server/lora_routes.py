"""vLLM's runtime adapter routes, served with --enable-runtime-lora-updating: POST /v1/load_lora_adapter
{"lora_name", "lora_path"} and POST /v1/unload_lora_adapter {"lora_name"}. An adapter that does not fit
the model is a 400 naming why; the next request naming it runs with it (each replica reads it then)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

from fastapi import Depends, FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import ConfigDict

from shardserve.launch.server.api_error import APIError
from shardserve.launch.server.request_checks import UnicodeBody, parsed_body
from shardserve.planner.lora import AdapterError

if TYPE_CHECKING:
    from shardserve.launch.openai_api.openai_serving import OpenAIServing


class LoadLoRAAdapterRequest(UnicodeBody):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(UnicodeBody):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: Optional[int] = None  # vLLM's; when given it must be the loaded adapter's


def add_lora_routes(app: FastAPI, serving: OpenAIServing) -> None:
    registry = serving.loras

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: Annotated[LoadLoRAAdapterRequest, Depends(parsed_body(LoadLoRAAdapterRequest))]):
        try:
            registry.add(body.lora_name, body.lora_path)
        except AdapterError as error:
            raise APIError(400, _without_path(str(error), body.lora_path), "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: Annotated[UnloadLoRAAdapterRequest, Depends(parsed_body(UnloadLoRAAdapterRequest))]):
        adapter = registry.adapters.get(body.lora_name)
        if adapter is not None and body.lora_int_id not in (None, adapter.lora_int_id):
            raise APIError(400, f"LoRA adapter {body.lora_name!r} is loaded with another lora_int_id", "lora_int_id")
        registry.remove(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _without_path(message: str, path: str) -> str:
    """No file path in a response: the client's own path reads as 'lora_path'."""
    return message.replace(path, "lora_path")
