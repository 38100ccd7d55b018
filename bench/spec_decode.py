"""Speculative decoding (n-gram prompt lookup) beside plain decoding in one run, on the CPU demo model:
repetitive prompts (a text given, then asked for again), greedy, the same engine settings.

    python bench/spec_decode.py                # 16 prompts x 96 tokens, k = 4
    python bench/spec_decode.py --num-speculative-tokens 2 --json
    python bench/spec_decode.py --lookup       # the prompt-lookup search alone, beside its plain loop
    python bench/spec_decode.py --draft shardserve-demo   # a draft model instead (here the model itself)

Reported per side: wall time, output tokens, engine steps (one target forward each, for the whole batch),
output tokens per request per step, and the drafts' acceptance; both sides' tokens must be the same (greedy).
Beside the measured speedup, the plan's: `shardserve plan` for the demo model on this CPU at the same concurrency,
with --draft-acceptance-rate set to what the measured tokens per forward mean (planner/speculative.py).
"""

from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np

from shardserve.planner import PlanOptions, load_model, make_plan, parse_declared
from shardserve.planner.model_source import DEMO_MODEL_NAME, model_path
from shardserve.planner.speculative import acceptance_for
from shardserve.runtime.core.spec_decode import propose_ngram, propose_ngram_reference
from shardserve.runtime import LLM, SamplingParams

TEXTS = (
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
    "The cache keeps the most recent blocks. When the pool is full, the oldest block is freed first.",
    "for item in items:\n    if item.ready:\n        queue.append(item)\n    else:\n        waiting.add(item)\n",
    "Each replica serves its own requests. The router sends a prompt to the replica holding its prefix.",
)


def prompts(count: int) -> list[str]:
    """A text, then the start of the same text again: the continuation repeats what the prompt holds."""
    out = []
    for i in range(count):
        text = TEXTS[i % len(TEXTS)] * (1 + i % 3)
        out.append(f"Copy the text.\n\n{text}\n\nCopy:\n\n{text[: len(text) // 3]}")
    return out


def run(spec: str | None, texts: list[str], max_tokens: int) -> dict:
    folder = str(model_path(DEMO_MODEL_NAME))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(folder, device="cpu", kv_cache_memory_bytes=1 << 26, speculative_config=spec) as llm:
        llm.generate(texts[:2], SamplingParams(max_tokens=4))  # warm-up
        engine = llm.engine
        steps_before = sum(engine.iteration_tokens.snapshot().counts)
        start = time.perf_counter()
        outputs = llm.generate(texts, params)
        elapsed = time.perf_counter() - start
        steps = sum(engine.iteration_tokens.snapshot().counts) - steps_before
        spec_stats = engine.get_stats().spec_decode
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    num_out = sum(map(len, tokens))
    result = {"elapsed_s": round(elapsed, 3), "output_tokens": num_out, "engine_steps": steps,
              "mean_prompt_tokens": round(sum(len(o.prompt_token_ids) for o in outputs) / len(outputs)),
              "output_tokens_per_s": round(num_out / elapsed, 1), "tokens": tokens}
    if spec_stats is not None:
        result |= {"num_drafts": spec_stats.num_drafts, "num_draft_tokens": spec_stats.num_draft_tokens,
                   "num_accepted_tokens": spec_stats.num_accepted_tokens,
                   "acceptance": round(spec_stats.num_accepted_tokens / max(spec_stats.num_draft_tokens, 1), 3)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--lookup", action="store_true", help="time the prompt-lookup search alone")
    parser.add_argument("--draft", help="speculate with this draft model (method draft_model) instead of n-gram")
    args = parser.parse_args()
    if args.lookup:
        print(json.dumps(lookup_times(), indent=1))
        return
    texts = prompts(args.num_prompts)
    method = "ngram" if args.draft is None else "draft_model"
    spec = json.dumps({"method": method, "num_speculative_tokens": args.num_speculative_tokens,
                       **({} if args.draft is None else {"model": args.draft})})
    plain, speculating = run(None, texts, args.max_tokens), run(spec, texts, args.max_tokens)
    if plain.pop("tokens") != speculating.pop("tokens"):
        raise SystemExit("greedy tokens differ with speculation: a bug")
    for side in (plain, speculating):  # the batch runs all its requests in each step, one target forward
        side["tokens_per_request_step"] = round(side["output_tokens"] / side["engine_steps"] / args.num_prompts, 3)
    report = {"settings": vars(args), "plain": plain, method: speculating,
              "speedup": round(plain["elapsed_s"] / speculating["elapsed_s"], 3),
              "plan": planned(spec, args, speculating["tokens_per_request_step"], speculating["mean_prompt_tokens"])}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for name in ("plain", method):
        print(name, json.dumps(report[name]))
    print("speedup", report["speedup"], "plan", json.dumps(report["plan"]))


def lookup_times(repeat: int = 200) -> list[dict]:
    """The scheduler's prompt lookup for one request, per step, against its plain loop: random histories (no
    suffix recurs, so both search it all, the worst case), k = 4, lookup 2 to 5 tokens."""
    rng = random.Random(0)
    out = []
    for num in (512, 4096, 32768):
        tokens = [rng.randrange(100_000) for _ in range(num)]
        history = np.asarray(tokens, dtype=np.int64)  # (the scheduler keeps it: TokenHistory)
        times = {}
        for name, search, given in (("vectorized", propose_ngram, history),
                                    ("plain_loop", propose_ngram_reference, tokens)):
            start = time.perf_counter()
            for _ in range(repeat):
                search(given, 4, 2, 5)
            times[name] = (time.perf_counter() - start) / repeat * 1e3
        out.append({"history_tokens": num, **{f"{k}_ms": round(v, 4) for k, v in times.items()},
                    "speedup": round(times["plain_loop"] / times["vectorized"], 1)})
    return out


def planned(spec: str, args: argparse.Namespace, tokens: float, input_len: int) -> dict:
    """The plan's speedup for the same requests on this CPU, at the acceptance the measured tokens per forward
    give: TPOT without speculation over TPOT with it (the plan's `estimates.speculation`)."""
    rate = min(0.99, round(acceptance_for(tokens, args.num_speculative_tokens), 3))
    options = PlanOptions(input_len=input_len, output_len=args.max_tokens, concurrency=float(args.num_prompts),
                          speculative_config=spec, draft_acceptance_rate=max(rate, 0.01))
    plan = make_plan(load_model(DEMO_MODEL_NAME), parse_declared("cpu"), options).record()
    section = plan.estimates.speculation
    assert section is not None  # a plan with speculative_config has one
    return {"draft_acceptance_rate": rate, "tpot_ms": plan.estimates.tpot_ms, "tpot_ms_without": section.without.tpot_ms,
            "speedup": round(section.without.tpot_ms / plan.estimates.tpot_ms, 3)}


if __name__ == "__main__":
    main()
