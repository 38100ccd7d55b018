"""Multi-turn conversations against 2 replicas, one server per routing policy, side by side: the
prefix-cache hit rate, the prompt tokens computed, and TTFT.

    python bench/multiturn.py --policies cache_aware least_loaded --runs 2 --json

Each conversation opens with its own preamble (--preamble-words), then each turn appends the reply and a
new question (--turn-words) and asks for --output-len tokens (ignore_eos). --conversations run at once,
each turn after the last. The server is `shardserve launch` of the demo on CPU with
data_parallel_size=2, started and stopped here for each policy and run, alternating policies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import openai

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(policy: str, port: int) -> subprocess.Popen:
    args = [sys.executable, "-m", "shardserve.launch", "launch", "--profile", "demo", "--set", "hardware=2xcpu",
            "--set", "data_parallel_size=2", "--set", f"routing_policy={policy}", "--port", str(port)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the {policy} server did not come up in 300 s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def prefix_counts(url: str) -> tuple[float, float]:
    """(prompt tokens looked up, found cached), summed over replicas."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    for line in text.splitlines():
        name = line.split("{")[0]
        if name in total:
            total[name] += float(line.split()[-1])
    return total["vllm:prefix_cache_queries_total"], total["vllm:prefix_cache_hits_total"]


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


def one_run(policy: str, run: int, args) -> dict:
    port = free_port()
    proc = start_server(policy, port)
    url = f"http://127.0.0.1:{port}"
    try:
        queries0, hits0 = prefix_counts(url)
        start = time.perf_counter()
        ttfts = asyncio.run(workload(url, args))
        elapsed = time.perf_counter() - start
        queries, hits = (a - b for a, b in zip(prefix_counts(url), (queries0, hits0)))
    finally:
        stop_server(proc)
    return {"policy": policy, "run": run, "conversations": args.conversations, "turns": args.turns,
            "requests": len(ttfts), "prompt_tokens": int(queries), "cached_tokens": int(hits),
            "computed_prompt_tokens": int(queries - hits), "hit_rate": round(hits / queries, 3) if queries else None,
            "ttft_mean_ms": round(statistics.fmean(ttfts) * 1e3, 1),
            "ttft_p50_ms": round(statistics.median(ttfts) * 1e3, 1), "duration_s": round(elapsed, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", nargs="+", default=["cache_aware", "least_loaded"])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--preamble-words", type=int, default=200)
    parser.add_argument("--turn-words", type=int, default=20)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON record per run")
    args = parser.parse_args()
    for run in range(args.runs):
        for policy in args.policies:  # alternating, so drift on the machine hits both alike
            record = one_run(policy, run, args)
            print(json.dumps(record) if args.json else
                  f"{policy:13s} run {run}: hit rate {record['hit_rate']}, prompt tokens computed "
                  f"{record['computed_prompt_tokens']} of {record['prompt_tokens']}, TTFT mean "
                  f"{record['ttft_mean_ms']} ms, p50 {record['ttft_p50_ms']} ms", flush=True)


if __name__ == "__main__":
    main()
