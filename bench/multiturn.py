"""Multi-turn conversations against one server per setup, side by side: the prefix-cache hit rate (GPU
pool and CPU tier), the prompt tokens computed, and TTFT.

    python bench/multiturn.py --json     # cache-aware against least-loaded routing over 2 replicas
    python bench/multiturn.py --replicas 1 --side "tier:kv_cache_memory_bytes=8M,kv_offloading_size=0.0625" \
        --side "no_tier:kv_cache_memory_bytes=8M" --conversations 4 --json     # the CPU tier of the KV cache

Each conversation opens with its own preamble (--preamble-words), then each turn appends the reply and a
new question (--turn-words) and asks for --output-len tokens (ignore_eos). --conversations run at once,
each turn after the last. A server is `shardserve launch` of the demo on CPU with --replicas replicas and
the side's settings, started and stopped here for each side and run, alternating sides.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import openai

from shardserve.launch import local_server

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def launch_args(settings: list[str], replicas: int) -> list[str]:
    return ["--profile", "demo", "--set", f"hardware={replicas}xcpu" if replicas > 1 else "hardware=cpu",
            "--set", f"data_parallel_size={replicas}", *(a for kv in settings for a in ("--set", kv))]


COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total")


def prefix_counts(url: str) -> tuple[float, ...]:
    """(prompt tokens looked up, found in the GPU pool, loaded from the CPU tier), summed over replicas."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{")[0]
        if name in total:
            total[name] += float(line.split()[-1])
    return tuple(total[name] for name in COUNTERS)


def settled_counts(url: str) -> tuple[float, ...]:
    """prefix_counts once two reads 0.7 s apart agree (the replicas send their counters twice a second)."""
    now = prefix_counts(url)
    while True:
        time.sleep(0.7)
        again = prefix_counts(url)
        if again == now:
            return now
        now = again


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


async def conversation(client, index: int, args, ttfts: list[float]) -> None:
    rng = random.Random(args.seed * 1000 + index)
    prompt = f"Conversation {index}. " + words(rng, args.preamble_words)
    for _ in range(args.turns):
        prompt += "\nQuestion: " + words(rng, args.turn_words) + "\nAnswer:"
        start, first, reply = time.perf_counter(), None, []
        stream = await client.completions.create(model="shardserve-demo", prompt=prompt, max_tokens=args.output_len,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                first = first or time.perf_counter()
                reply.append(chunk.choices[0].text)
        ttfts.append((first or time.perf_counter()) - start)
        prompt += "".join(reply)


async def workload(url: str, args) -> list[float]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    ttfts: list[float] = []
    await asyncio.gather(*(conversation(client, i, args, ttfts) for i in range(args.conversations)))
    await client.close()
    return ttfts


def one_run(name: str, settings: list[str], run: int, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = local_server.start(launch_args(settings, args.replicas), Path(tmp) / "server.log",
                                       f"the {name} server", 300)
        try:
            before = settled_counts(url)
            start = time.perf_counter()
            ttfts = asyncio.run(workload(url, args))
            elapsed = time.perf_counter() - start
            queries, hits, loaded = (a - b for a, b in zip(settled_counts(url), before))
        finally:
            local_server.stop(proc)
    return {"side": name, "settings": settings, "replicas": args.replicas, "run": run,
            "conversations": args.conversations, "turns": args.turns, "requests": len(ttfts),
            "prompt_tokens": int(queries), "cached_tokens": int(hits), "cpu_tier_tokens": int(loaded),
            "computed_prompt_tokens": int(queries - hits - loaded),
            "hit_rate": round((hits + loaded) / queries, 3) if queries else None,
            "ttft_mean_ms": round(statistics.fmean(ttfts) * 1e3, 1),
            "ttft_p50_ms": round(statistics.median(ttfts) * 1e3, 1), "duration_s": round(elapsed, 2)}


def side(text: str) -> tuple[str, list[str]]:
    """NAME:KEY=VALUE[,KEY=VALUE...] -> (name, ["KEY=VALUE", ...])."""
    name, _, settings = text.partition(":")
    return name, [kv for kv in settings.split(",") if kv]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", action="append", type=side, help="NAME:KEY=VALUE,... (settings for one "
                        "server; default: routing_policy cache_aware and least_loaded)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--preamble-words", type=int, default=200)
    parser.add_argument("--turn-words", type=int, default=20)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON record per run")
    args = parser.parse_args()
    sides = args.side or [(p, [f"routing_policy={p}"]) for p in ("cache_aware", "least_loaded")]
    for run in range(args.runs):
        for name, settings in sides:  # alternating, so drift on the machine hits both alike
            record = one_run(name, settings, run, args)
            print(json.dumps(record) if args.json else
                  f"{name:13s} run {run}: hit rate {record['hit_rate']}, prompt tokens computed "
                  f"{record['computed_prompt_tokens']} of {record['prompt_tokens']}, TTFT mean "
                  f"{record['ttft_mean_ms']} ms, p50 {record['ttft_p50_ms']} ms", flush=True)


if __name__ == "__main__":
    main()
