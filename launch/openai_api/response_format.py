"""OpenAI response pieces: usage, logprobs in both endpoints' shapes, SSE framing."""

from __future__ import annotations

import json

from shardserve.launch.openai_api.protocol import APIError
from shardserve.runtime.outputs import Logprob


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class ErrorEvent(str):
    """An SSE event that ends a stream with an error; the server counts the request by its outcome."""

    outcome: str


def error_event(error: APIError) -> ErrorEvent:
    event = ErrorEvent(sse(error.body()))
    event.outcome = error.outcome
    return event


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int | None = None) -> dict:
    """OpenAI's usage; with num_cached_tokens (--enable-prompt-tokens-details), the prompt tokens the prefix
    cache served as prompt_tokens_details.cached_tokens."""
    out: dict = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
                 "total_tokens": num_prompt_tokens + num_completion_tokens}
    if num_cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens}
    return out


def _token_text(token_id: int, entry: Logprob | None, as_id: bool = False) -> str:
    """The runtime's text for a token, or "token_id:N" (as_id, vLLM's return_tokens_as_token_ids), or its id
    where the engine runs without a tokenizer."""
    if as_id:
        return f"token_id:{token_id}"
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return str(token_id)


def _top(entries: dict[int, Logprob], k: int, as_id: bool) -> list[tuple[str, float]]:
    """The k most likely tokens at a position (the runtime adds the sampled one if outside)."""
    ranked = sorted(((e.rank, tid, e) for tid, e in entries.items() if e.rank <= k))
    return [(_token_text(tid, e, as_id), e.logprob) for _, tid, e in ranked]


def completion_logprobs(token_ids, logprobs, k: int, text_offset: int, first_text: str | None = None,
                        as_ids: bool = False) -> tuple[dict, int]:
    """The legacy completions shape: parallel lists, top_logprobs as {token: logprob}; and the text offset
    after the last token. An entry of None (an echoed prompt's first token, which nothing scores) has null
    logprobs and first_text. Each top_logprobs starts with the position's own token (the sampled one, or the
    echoed prompt's), then its k most likely, as vLLM (k 0: the token alone). NOTE: offsets count
    the tokens' text even where as_ids writes them "token_id:N", so they stay offsets into the text."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset
    for token_id, entries in zip(token_ids, logprobs):
        text = first_text if entries is None else _token_text(token_id, entries[token_id])
        assert text is not None  # a None entry comes with its first_text
        shown = f"token_id:{token_id}" if as_ids else text
        out["tokens"].append(shown)
        out["token_logprobs"].append(None if entries is None else entries[token_id].logprob)
        if entries is None:
            out["top_logprobs"].append(None)
        else:  # vLLM's order: the token itself first, then the k most likely (up to k + 1 entries)
            out["top_logprobs"].append({shown: entries[token_id].logprob, **dict(_top(entries, k, as_ids))})
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset


def chat_logprobs(token_ids, logprobs, k: int, as_ids: bool = False) -> dict:
    """The chat shape: one entry per token with its bytes and its top alternatives."""
    content = []
    for token_id, entries in zip(token_ids, logprobs):
        text = _token_text(token_id, entries[token_id], as_ids)
        content.append({"token": text, "logprob": entries[token_id].logprob,
                        "bytes": list(text.encode()),
                        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                                         for t, lp in _top(entries, k, as_ids)]})
    return {"content": content}


def prompt_logprobs_json(entries) -> list:
    """vLLM's prompt_logprobs: per prompt token, null for the first, then {token id: {logprob, rank,
    decoded_token}}."""
    return [None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in e.items()} for e in entries]
