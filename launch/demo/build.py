"""Builds the bundled demo checkpoint (tokenizer, weights, model card) from CPython's own text.

Run: .venv/bin/python -m shardserve.launch.demo.build [--out DIR] [--minutes N]
(writes ./demo-model by default; `--out launch/demo/model` replaces the shipped checkpoint)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, cast

import torch
from transformers import GenerationConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from shardserve.launch.demo import DEMO_MODEL_DIR
from shardserve.launch.demo.corpus import load_corpus
from shardserve.launch.demo.model_card import model_card
from shardserve.launch.demo.tokenizer import train_tokenizer
from shardserve.launch.demo.training import (TrainingConfig, chat_token_ids, model_config, new_model,
                                             token_stream, train)

VOCAB_SIZE = 4096
MAX_MODEL_LEN = 2048
SAMPLE_PROMPT = "The function returns"
SAMPLE_QUESTION = "What is a list comprehension?"
NUM_SAMPLE_TOKENS = 40
DEFAULT_MINUTES = 8.0
DEFAULT_OUT = Path("demo-model")  # never the shipped checkpoint unless --out names it


def greedy(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast,
           input_ids: list[int]) -> str:
    with torch.no_grad():
        # generate's self is typed differently from one transformers release to the next (a protocol that
        # LlamaForCausalLM does not spell out in 5.23, plain in 5.24): called untyped, both check alike
        out = cast(Any, model).generate(torch.tensor([input_ids]), max_new_tokens=NUM_SAMPLE_TOKENS,
                                        do_sample=False)
    text = tokenizer.decode(out[0, len(input_ids):], skip_special_tokens=True)
    assert isinstance(text, str)  # one sequence decodes to one string
    return text


def samples(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast) -> dict[str, str]:
    chat = chat_token_ids(tokenizer, [{"role": "user", "content": SAMPLE_QUESTION}], add_generation_prompt=True)
    return {SAMPLE_PROMPT: greedy(model, tokenizer, tokenizer(SAMPLE_PROMPT).input_ids),
            f"(chat) {SAMPLE_QUESTION}": greedy(model, tokenizer, chat)}


def build(out: Path, minutes: float) -> None:
    torch.set_num_threads(1)
    cfg = TrainingConfig(minutes=minutes)
    corpus = load_corpus()
    print(f"corpus: {len(corpus.documents)} documents, {corpus.num_chars / 1e6:.2f}M characters")
    tokenizer = train_tokenizer(corpus.documents, VOCAB_SIZE, MAX_MODEL_LEN)
    stream = token_stream(tokenizer, corpus, cfg.seed)
    model = new_model(model_config(tokenizer, MAX_MODEL_LEN), cfg.seed)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    result = train(model, stream, cfg, log=lambda line: print(line, flush=True))
    model = model.to(torch.bfloat16).eval()  # type: ignore[arg-type]  # transformers' wrapper types `to` wrongly
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    outputs = samples(model, tokenizer)
    for prompt, text in outputs.items():
        print(f"{prompt!r} -> {text!r}")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "README.md").write_text(model_card(model, result, outputs), encoding="utf-8")
    num_bytes = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote {out} ({num_bytes / 2**20:.1f} MiB)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"folder to write (default ./{DEFAULT_OUT}; the shipped one is {DEMO_MODEL_DIR})")
    parser.add_argument("--minutes", type=float, default=DEFAULT_MINUTES)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    start = time.monotonic()
    build(args.out, args.minutes)
    print(f"total {time.monotonic() - start:.0f}s")


if __name__ == "__main__":
    main()
