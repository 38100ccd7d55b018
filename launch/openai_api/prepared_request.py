"""One API request ready to run: its prompts as the runtime processed them, and what its response needs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shardserve.launch.openai_api.reasoning import ReasoningMode
from shardserve.launch.openai_api.tool_calls import ToolPlan
from shardserve.runtime.input_processor import ProcessedPrompt
from shardserve.runtime.lora_request import LoRARequest
from shardserve.runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class ResponseOptions:
    """What a response carries beyond text, as the request (and the server's defaults) asked."""

    return_token_ids: bool = False  # choices carry token_ids, the response (or choice) prompt_token_ids
    tokens_as_ids: bool = False  # logprob tokens written "token_id:N"
    include_usage: bool = False  # a stream ends with a usage chunk
    continuous_usage: bool = False  # ...and every chunk carries the usage so far
    prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens


@dataclass
class PreparedRequest:
    """One API request, ready to run: its prompts as the runtime processed them, and what the
    response needs."""

    kind: str                     # "completion" | "chat"
    request_id: str
    model: str
    prompts: list[ProcessedPrompt]
    params: SamplingParams
    echo_texts: list[str] | None = None  # per prompt, when the completion echoes its prompt
    # per prompt, the text of its first token, when echo comes with logprobs (that token has no score)
    first_token_texts: list[str] | None = None
    prompt_logprobs: int | None = None  # vLLM's extra: the response carries the prompt's logprobs
    tool_plan: ToolPlan | None = None  # a chat request whose tools are in play
    reasoning: ReasoningMode | None = None  # a chat request on a server with a reasoning parser
    grammar_param: str | None = None  # the field that asked for params.structured_outputs, for errors
    role: str = "assistant"  # a chat reply's role
    echo_message: str = ""  # chat's echo: the reply starts with the last message's content
    options: ResponseOptions = field(default_factory=ResponseOptions)
    session: str | None = None  # the conversation's key for routing (x-session-id header, or the user field)
    client: str | None = None  # whom its sequences are counted for (fair_share.client_key); None: nobody
    lora: LoRARequest | None = None  # the adapter its model field names; None: the base model
    created: int = field(default_factory=lambda: int(time.time()))

    def prompt_id(self, prompt_index: int) -> str:
        return f"{self.request_id}-{prompt_index}"

    def choice_index(self, prompt_index: int, sample_index: int) -> int:
        return prompt_index * self.params.n + sample_index

    @property
    def num_prompt_tokens(self) -> int:
        return sum(p.num_prompt_tokens for p in self.prompts)
