"""Serving benchmark: a closed-loop client at fixed concurrency against an OpenAI-compatible
server, reporting throughput and TTFT / TPOT / ITL percentiles (like `vllm bench serve`).

    python bench/serve.py --base-url http://127.0.0.1:8000 --model shardserve-demo \
        --concurrency 1 16 64 --num-prompts 64 --input-len 128 --output-len 128

Prompts are random token ids (ignore_eos, so every request produces exactly --output-len
tokens). Prints a table and, with --json, one JSON record per concurrency level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import openai


@dataclass
class RequestTiming:
    start: float
    token_times: list[float] = field(default_factory=list)
    num_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.num_tokens < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.num_tokens - 1)


async def one_request(client, model: str, prompt: list[int], output_len: int) -> RequestTiming:
    timing = RequestTiming(time.perf_counter())
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=output_len, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            timing.token_times.append(time.perf_counter())
        if chunk.usage:
            timing.num_tokens = chunk.usage.completion_tokens
    return timing


async def run_level(client, model: str, prompts: list[list[int]], output_len: int,
                    concurrency: int) -> dict:
    queue = list(prompts)
    timings: list[RequestTiming] = []

    async def worker():
        while queue:
            timings.append(await one_request(client, model, queue.pop(), output_len))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    return summarize(timings, elapsed, concurrency)


def random_prompts(vocab_size: int, num: int, length: int, seed: int) -> list[list[int]]:
    """Token ids drawn from [10, vocab_size): clear of the special ids at the bottom."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab_size) for _ in range(length)] for _ in range(num)]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))] * 1e3


def summarize(timings: list[RequestTiming], elapsed: float, concurrency: int) -> dict:
    ttfts = [t.ttft for t in timings if t.token_times]
    tpots = [t.tpot for t in timings if t.tpot is not None]
    itls = [x for t in timings for x in t.itls]
    tokens = sum(t.num_tokens for t in timings)
    return {"concurrency": concurrency, "num_requests": len(timings),
            "duration_s": round(elapsed, 2), "output_tok_s": round(tokens / elapsed, 1),
            "request_per_s": round(len(timings) / elapsed, 2),
            **{f"ttft_p{q}_ms": round(_pct(ttfts, q), 1) for q in (50, 90, 99)},
            **{f"tpot_p{q}_ms": round(_pct(tpots, q), 2) for q in (50, 90, 99)},
            **{f"itl_p{q}_ms": round(_pct(itls, q), 2) for q in (50, 90, 99)},
            "ttft_mean_ms": round(statistics.fmean(ttfts) * 1e3, 1) if ttfts else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="shardserve-demo")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=1000,
                        help="random prompt ids are drawn below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print JSON records")
    args = parser.parse_args()
    prompts = random_prompts(args.vocab_size, args.num_prompts, args.input_len, args.seed)

    async def all_levels():
        client = openai.AsyncOpenAI(base_url=f"{args.base_url}/v1", api_key=args.api_key,
                                    max_retries=0, timeout=600)
        try:
            return [await run_level(client, args.model, prompts, args.output_len, c)
                    for c in args.concurrency]
        finally:
            await client.close()

    results = asyncio.run(all_levels())
    if args.json:
        for r in results:
            print(json.dumps(r))
        return
    cols = ["concurrency", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
            "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms"]
    print(" ".join(f"{c:>13}" for c in cols))
    for r in results:
        print(" ".join(f"{r[c]:>13}" for c in cols))


if __name__ == "__main__":
    main()
