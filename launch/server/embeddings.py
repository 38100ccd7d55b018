"""POST /v1/embeddings (OpenAI's shape, vLLM's behaviour): each input pooled by a replica whose runner is
pooling, answered as float lists or base64 float32."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Literal, Optional, Union, cast

import numpy as np
from fastapi import Depends, FastAPI, Request
from pydantic import ConfigDict, Field

from shardserve.launch.server.api_error import APIError
from shardserve.launch.server.metrics import ServerMetrics
from shardserve.launch.openai_api.openai_serving import OpenAIServing, _engine_error
from shardserve.launch.server.replicas import ReplicaSet
from shardserve.launch.server.request_checks import Items, UnicodeBody, parsed_body, refuse_unknown
from shardserve.runtime.input_processor import InvalidPromptError, ProcessedPrompt
from shardserve.runtime.outputs import EmbeddingRequestOutput
from shardserve.runtime.pooling_params import PoolingParams
from shardserve.launch.server.responding import off_loop, until_disconnect

TokenId = Annotated[int, Field(ge=0)]  # the input processor checks it against the vocabulary


class EmbeddingRequest(UnicodeBody):
    """OpenAI's embeddings request; an unknown field is refused by name."""

    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    input: Union[str, Items[str], Items[TokenId], Items[Items[TokenId]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    normalize: Optional[bool] = None  # vLLM's extra: L2-normalize (None: the server's --normalize)

    def prompts(self) -> list[str | list[int]]:
        """Each input: a string or a list of token ids."""
        given = self.input
        if isinstance(given, str):
            return [given]
        if not given:
            raise APIError(400, "input must not be empty", "input")
        if all(isinstance(x, int) for x in given):
            return [cast(list[int], list(given))]  # one prompt of token ids
        return [x if isinstance(x, str) else cast(list[int], list(x)) for x in cast(list, given)]


@dataclass
class PreparedEmbeddings:
    request_id: str
    model: str
    encoding_format: str
    prompts: list[ProcessedPrompt]
    params: PoolingParams  # unset fields: the engine's pooling (--pooling-type, --normalize, the checkpoint's)
    created: int = field(default_factory=lambda: int(time.time()))


def prepare_embeddings(body: EmbeddingRequest, replicas: ReplicaSet, serving: OpenAIServing) -> PreparedEmbeddings:
    """Check the request and tokenize its inputs (in a worker thread: see responding.off_loop)."""
    serving.check_ready(body.model)
    refuse_unknown(body, "")
    processor = replicas.input_processor
    if processor.model_config.runner != "pooling":  # vLLM: this model does not serve the Embeddings API
        raise APIError(400, "this model is served for generation: /v1/embeddings needs the server started with "
                       "--runner pooling", "model")
    if body.dimensions is not None:
        raise APIError(400, "dimensions is not supported: this model has no matryoshka representation to "
                       "shorten its embeddings to (leave dimensions out)", "dimensions")
    prepared = PreparedEmbeddings(f"embd-{uuid.uuid4().hex}", serving.served_model_name, body.encoding_format, [],
                                  PoolingParams(normalize=body.normalize))
    try:
        prepared.prompts = [processor.process(p, prepared.params) for p in body.prompts()]
    except InvalidPromptError as e:
        raise APIError(400, str(e), "input" if e.field == "prompt" else e.field) from None
    return prepared


async def embed_all(replicas: ReplicaSet, prepared: PreparedEmbeddings) -> dict:
    """Every input pooled at once (over the replicas); the first failure ends the others."""
    tasks = [asyncio.ensure_future(replicas.embed(prompt, prepared.params, f"{prepared.request_id}-{i}"))
             for i, prompt in enumerate(prepared.prompts)]
    try:
        outputs = await asyncio.gather(*tasks)
    except Exception as error:  # the engine's refusals (400) and failures (503) as API errors
        raise _engine_error(error) from None
    finally:
        for task in tasks:
            task.cancel()
    num_prompt_tokens = sum(p.num_prompt_tokens for p in prepared.prompts)
    return {"id": prepared.request_id, "object": "list", "created": prepared.created, "model": prepared.model,
            "data": [_item(i, output, prepared.encoding_format) for i, output in enumerate(outputs)],
            "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens}}


def _item(index: int, output: EmbeddingRequestOutput, encoding_format: str) -> dict:
    """One embedding: a list of floats, or base64 of its float32 little-endian bytes (what OpenAI's clients decode)."""
    vector: list[float] | str = output.outputs.embedding
    if encoding_format == "base64":
        vector = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return {"object": "embedding", "index": index, "embedding": vector}


def add_embedding_routes(app: FastAPI, replicas: ReplicaSet, serving: OpenAIServing, metrics: ServerMetrics) -> None:

    @app.post("/v1/embeddings")
    async def embeddings(body: Annotated[EmbeddingRequest, Depends(parsed_body(EmbeddingRequest))], request: Request):
        prepared = await off_loop(lambda b: prepare_embeddings(b, replicas, serving), body)
        return await until_disconnect(embed_all(replicas, prepared), request, metrics, None)
