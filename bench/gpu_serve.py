"""The serving part of the GPU benchmarks: a real `shardserve launch` on a free loopback port and
bench/serve.py's closed-loop client at each concurrency level, stopped by its pid at the end."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import serve  # bench/serve.py (gpu_bench.py puts bench/ on the path)

from shardserve.launch import local_server

SERVED_NAME = "bench"
STARTUP_TIMEOUT_S = 420.0


def start_server(folder: Path, device: str, max_model_len: int, log_path: Path) -> tuple[subprocess.Popen, str]:
    args = ["--model", str(folder), "--served-model-name", SERVED_NAME, "--max-model-len", str(max_model_len),
            "--set", "enable_prefix_caching=false"]
    env = dict(os.environ)
    if device == "cpu":
        args += ["--set", f"kv_cache_memory_bytes={256 << 20}"]
        env["CUDA_VISIBLE_DEVICES"] = ""
    return local_server.start(args, log_path, "the benchmark server", STARTUP_TIMEOUT_S, env)


def serve_levels(folder: Path, device: str, levels: list[int], max_prompts: int, input_len: int,
                 output_len: int) -> list[dict]:
    """One record per concurrency level; each level runs 4 x its concurrency requests (16 at least,
    max_prompts at most) so that a level takes a bounded time."""
    import openai

    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    log_path = Path(os.environ.get("OUT") or folder.parent) / "serve_server.log"
    proc, url = start_server(folder, device, input_len + output_len + 16, log_path)

    async def run_all() -> list[dict]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        try:
            results = []
            for concurrency in levels:
                num = min(max_prompts, max(16, 4 * concurrency))
                prompts = serve.random_prompts(vocab, num, input_len, seed=concurrency)
                await serve.run_level(client, SERVED_NAME, prompts[:1], 4, 1)  # warm-up
                results.append(await serve.run_level(client, SERVED_NAME, prompts, output_len, concurrency))
            return results
        finally:
            await client.close()

    try:
        levels_out = asyncio.run(run_all())
    finally:
        local_server.stop(proc)
    return [{"benchmark": "serving", **level,
             "settings": {"input_len": input_len, "output_len": output_len, "prefix_caching": False}}
            for level in levels_out]
