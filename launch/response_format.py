"""OpenAI response pieces: usage, logprobs in both endpoints' shapes, SSE framing."""

from __future__ import annotations

import json

from shardserve.launch.protocol import APIError
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


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


def _token_text(token_id: int, entry: Logprob | None) -> str:
    """The runtime's text for a token, or its id where the engine runs without a tokenizer."""
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return str(token_id)


def _top(entries: dict[int, Logprob], k: int) -> list[tuple[str, float]]:
    """The k most likely tokens at a position (the runtime adds the sampled one if outside)."""
    ranked = sorted(((e.rank, tid, e) for tid, e in entries.items() if e.rank <= k))
    return [(_token_text(tid, e), e.logprob) for _, tid, e in ranked]


def completion_logprobs(token_ids, logprobs, k: int, text_offset: int, first_text: str | None = None) -> dict:
    """The legacy completions shape: parallel lists, top_logprobs as {token: logprob}. An entry of
    None (an echoed prompt's first token, which nothing scores) has null logprobs and first_text."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset
    for token_id, entries in zip(token_ids, logprobs):
        text = first_text if entries is None else _token_text(token_id, entries[token_id])
        out["tokens"].append(text)
        out["token_logprobs"].append(None if entries is None else entries[token_id].logprob)
        out["top_logprobs"].append(None if entries is None else dict(_top(entries, k)))
        out["text_offset"].append(offset)
        assert text is not None  # a None entry comes with its first_text
        offset += len(text)
    return out


def chat_logprobs(token_ids, logprobs, k: int) -> dict:
    """The chat shape: one entry per token with its bytes and its top alternatives."""
    content = []
    for token_id, entries in zip(token_ids, logprobs):
        text = _token_text(token_id, entries[token_id])
        content.append({"token": text, "logprob": entries[token_id].logprob,
                        "bytes": list(text.encode()),
                        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                                         for t, lp in _top(entries, k)]})
    return {"content": content}


def prompt_logprobs_json(entries) -> list:
    """vLLM's prompt_logprobs: per prompt token, null for the first, then {token id: {logprob, rank,
    decoded_token}}."""
    return [None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in e.items()} for e in entries]
