"""The server-wide settings the OpenAI routes read (one record, defaults from the settings table), and
the limit on the log-probabilities a request may ask for."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from shardserve.launch.server.api_error import APIError
from shardserve.planner.settings import default


@dataclass(frozen=True)
class ServingOptions:
    tool_call_parser: str | None = default("tool_call_parser")
    enable_auto_tool_choice: bool = default("enable_auto_tool_choice")
    reasoning_parser: str | None = default("reasoning_parser")
    grammar_compile_timeout: float = default("grammar_compile_timeout")
    trust_request_chat_template: bool = default("trust_request_chat_template")
    max_logprobs: int = default("max_logprobs")
    return_tokens_as_token_ids: bool = default("return_tokens_as_token_ids")
    enable_force_include_usage: bool = default("enable_force_include_usage")
    enable_prompt_tokens_details: bool = default("enable_prompt_tokens_details")
    enable_tokenizer_info_endpoint: bool = default("enable_tokenizer_info_endpoint")
    enable_server_load_tracking: bool = default("enable_server_load_tracking")
    root_path: str | None = default("root_path")
    enable_runtime_lora_updating: bool = default("enable_runtime_lora_updating")

    @classmethod
    def from_config(cls, config: Any) -> ServingOptions:
        """The settled deployment's values (a DeployConfig); the table's defaults where nothing set one."""
        values = {f.name: getattr(config, f.name) for f in fields(cls)}
        return cls(**{name: value for name, value in values.items() if value is not None})

    def num_logprobs(self, asked: int | None, field: str, vocab_size: int) -> int | None:
        """A request's count of logprobs per token (-1: the whole vocabulary) within max_logprobs (-1: no
        limit but the vocabulary), as vLLM checks it; over it is a 400 naming `field` and the limit."""
        if asked is None:
            return None
        num = vocab_size if asked == -1 else asked
        limit = vocab_size if self.max_logprobs == -1 else min(self.max_logprobs, vocab_size)
        if num > limit:
            whole = f" (-1: the whole vocabulary of {vocab_size})" if asked == -1 else ""
            raise APIError(400, f"{field}: {num} log-probabilities per token asked{whole}, more than the "
                           f"{limit} this server allows (--max-logprobs {self.max_logprobs}; the vocabulary has "
                           f"{vocab_size} tokens)", field)
        return num
