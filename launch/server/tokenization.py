"""vLLM's token routes: /tokenize (a prompt, or chat messages through the chat template), /detokenize and
/tokenizer_info, through the same input processor and chat rendering as generation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from pydantic import ConfigDict

from shardserve.launch.server.api_error import APIError, as_api_error
from shardserve.launch.openai_api.chat_render import render, template_conversation, template_kwargs
from shardserve.launch.openai_api.protocol import ChatMessage, Tool
from shardserve.launch.server.request_checks import Items, UnicodeBody

if TYPE_CHECKING:
    from shardserve.launch.openai_api.openai_serving import OpenAIServing


class TokenizeRequest(UnicodeBody):
    """A prompt, or chat messages (with their tools) through the chat template."""

    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[Items[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None  # default: true for a prompt, false for messages (as vLLM)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False  # the tokens' strings beside their ids
    tools: Optional[Items[Tool]] = None
    chat_template: Optional[str] = None  # only with --trust-request-chat-template
    chat_template_kwargs: Optional[dict[str, Any]] = None


class DetokenizeRequest(UnicodeBody):
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    tokens: Items[int]


def tokenize(serving: OpenAIServing, body: TokenizeRequest) -> dict:
    serving.check_ready(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either prompt or messages", "prompt")
    processor = serving.replicas.input_processor
    if body.messages is None:
        text, add_special_tokens = body.prompt or "", body.add_special_tokens is not False
    else:
        if body.continue_final_message and body.add_generation_prompt:
            raise APIError(400, "continue_final_message needs add_generation_prompt: false",
                           "continue_final_message")
        kwargs = template_kwargs(body.chat_template, body.chat_template_kwargs,
                                 serving.options.trust_request_chat_template)
        conversation = template_conversation([m.template_message(i) for i, m in enumerate(body.messages)])
        flags = {"add_generation_prompt": body.add_generation_prompt,
                 "continue_final_message": body.continue_final_message}
        tools = [tool.model_dump(exclude_unset=True) for tool in body.tools or ()]
        text, add_special_tokens = render(processor, conversation, tools, flags, kwargs), bool(body.add_special_tokens)
    with as_api_error("prompt" if body.messages is None else "messages"):
        ids = processor.tokenize(text, add_special_tokens)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": processor.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = processor.tokenizer.convert_ids_to_tokens(ids)
    return out


def detokenize(serving: OpenAIServing, body: DetokenizeRequest) -> dict:
    serving.check_ready(body.model)
    processor = serving.replicas.input_processor
    with as_api_error("tokens"):
        processor.check_token_ids(body.tokens)
    return {"prompt": processor.decode(body.tokens)}


def tokenizer_info(serving: OpenAIServing) -> dict:
    """The tokenizer's configuration as vLLM's /tokenizer_info gives it: its init arguments (no file paths),
    its class and the chat template in use."""
    tokenizer = serving.replicas.input_processor.tokenizer
    if tokenizer is None:
        raise APIError(404, "this server runs without a tokenizer (skip_tokenizer_init)", error_type="not_found_error")
    config = {k: _json_safe(v) for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
              if k not in ("vocab_file", "merges_file", "tokenizer_file")}
    config["tokenizer_class"] = type(tokenizer).__name__
    if getattr(tokenizer, "chat_template", None):
        config["chat_template"] = tokenizer.chat_template
    return config


def _json_safe(value: Any) -> Any:
    if hasattr(value, "content"):  # tokenizers' AddedToken
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)
