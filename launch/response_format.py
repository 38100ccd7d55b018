"""OpenAI response pieces: usage, logprobs in both endpoints' shapes, SSE framing."""

from __future__ import annotations

import json

from shardserve.runtime.outputs import RequestOutput


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def usage(results: list[RequestOutput]) -> dict:
    prompt = sum(len(r.prompt_token_ids) for r in results)
    completion = sum(len(c.token_ids) for r in results for c in r.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _token_text(token_id: int, entry, tokenizer) -> str:
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def _top(entries: dict, k: int, tokenizer) -> list[tuple[str, float]]:
    """The k most likely tokens at a position (the runtime adds the sampled one if outside)."""
    ranked = sorted(((e.rank, tid, e) for tid, e in entries.items() if e.rank <= k))
    return [(_token_text(tid, e, tokenizer), e.logprob) for _, tid, e in ranked]


def completion_logprobs(token_ids: list[int], logprobs: list[dict], k: int, tokenizer,
                        text_offset: int) -> dict:
    """The legacy completions shape: parallel lists, top_logprobs as {token: logprob}."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset
    for token_id, entries in zip(token_ids, logprobs):
        text = _token_text(token_id, entries[token_id], tokenizer)
        out["tokens"].append(text)
        out["token_logprobs"].append(entries[token_id].logprob)
        out["top_logprobs"].append(dict(_top(entries, k, tokenizer)))
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(token_ids: list[int], logprobs: list[dict], k: int, tokenizer) -> dict:
    """The chat shape: one entry per token with its bytes and its top alternatives."""
    content = []
    for token_id, entries in zip(token_ids, logprobs):
        text = _token_text(token_id, entries[token_id], tokenizer)
        content.append({"token": text, "logprob": entries[token_id].logprob,
                        "bytes": list(text.encode()),
                        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                                         for t, lp in _top(entries, k, tokenizer)]})
    return {"content": content}
