"""Writes the demo checkpoint's README.md: what it is, how it was made, how to rebuild it."""

from __future__ import annotations

import platform

from transformers import LlamaForCausalLM

from shardserve.launch.demo import DEMO_MODEL_NAME
from shardserve.launch.demo.training import TrainingResult

REBUILD_COMMAND = ".venv/bin/python -m shardserve.launch.demo.build --out launch/demo/model --minutes 8"


def model_card(model: LlamaForCausalLM, result: TrainingResult, outputs: dict[str, str]) -> str:
    c = model.config
    assert c.rope_parameters is not None  # training.model_config sets rope_theta
    num_params = sum(p.numel() for p in model.parameters())
    samples = "\n".join(f"- `{prompt}` -> `{text!r}`" for prompt, text in outputs.items())
    return f"""# {DEMO_MODEL_NAME}

A toy Llama checkpoint bundled with shardserve so that `make demo`, `shardserve launch` and the
tests have a real Hugging Face model to serve without downloading anything. It writes word-like
English about Python. It is a toy for demos and tests, **not** a useful assistant: what it says is
mostly wrong.

## What it is
- `LlamaForCausalLM` with {num_params / 1e6:.1f}M parameters, stored as bfloat16 safetensors.
- {c.num_hidden_layers} layers, hidden size {c.hidden_size}, MLP size {c.intermediate_size}.
- {c.num_attention_heads} query heads and {c.num_key_value_heads} KV heads (GQA), head size \
{c.head_dim}; RoPE with theta {c.rope_parameters["rope_theta"]:g}; \
max_position_embeddings {c.max_position_embeddings}; tied input and output embeddings.
- Byte-level BPE tokenizer with {c.vocab_size} tokens: any UTF-8 text round-trips.
- Special tokens: `<|begin_of_text|>` (bos), `<|end_of_text|>` (eos, also ends every chat turn),
  `<|pad|>`, and the role tokens `<|system|>`, `<|user|>`, `<|assistant|>`.
- Chat template: `<|begin_of_text|><|user|>\\n{{content}}<|end_of_text|><|assistant|>\\n`.

## How it was made
- Text: CPython {platform.python_version()}'s `pydoc_data.topics` and the docstrings of the
  top-level standard-library modules (PSF license); each item also appears as a one-question chat.
- Trained from scratch on one CPU thread for {result.seconds / 60:.1f} minutes: \
{result.num_steps} AdamW steps, {result.num_tokens_seen / 1e6:.2f}M tokens seen.
- Final training loss {result.train_loss:.2f}, held-out loss {result.heldout_loss:.2f} \
(unigram level {result.unigram_loss:.2f}).

Rebuild it (training is bounded by wall time, so the weights differ a little from run to run):

    {REBUILD_COMMAND}

## Greedy samples
{samples}
"""
