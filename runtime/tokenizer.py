"""Loading the tokenizer that ships with a model folder, the model's end-of-sequence ids, and how many
characters one token can cover."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardserve.runtime.config import ModelConfig

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_config: ModelConfig):
    """A transformers tokenizer, or None with skip_tokenizer_init."""
    if model_config.skip_tokenizer_init:
        return None
    folder = model_config.model
    if not any(os.path.isfile(os.path.join(folder, name)) for name in _TOKENIZER_FILES):
        raise ValueError(f"{folder!r} has no tokenizer files; pass skip_tokenizer_init=True and give "
                         "prompts as {'prompt_token_ids': [...]}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if model_config.chat_template is not None:
        tokenizer.chat_template = read_chat_template(model_config.chat_template)
    return tokenizer


def read_chat_template(value: str) -> str:
    """chat_template as given: inline Jinja, or the path of a file holding it."""
    if "{{" in value or "{%" in value:
        return value
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    raise ValueError(f"chat_template {value!r} is neither a Jinja template nor a file: give the template "
                     "itself or the path of a .jinja file")


def eos_token_ids(model_config: ModelConfig, tokenizer) -> frozenset[int]:
    """generation_config.json's eos ids if present (Llama 3 lists several), else config.json's,
    else the tokenizer's."""
    path = os.path.join(model_config.model, "generation_config.json")
    value = None
    if os.path.isfile(path):
        with open(path) as f:
            value = json.load(f).get("eos_token_id")
    if value is None:
        value = getattr(model_config.hf_config, "eos_token_id", None)
    if value is None and tokenizer is not None:
        value = tokenizer.eos_token_id
    if value is None:
        return frozenset()
    ids = value if isinstance(value, (list, tuple)) else [value]
    return frozenset(int(i) for i in ids if 0 <= int(i) < model_config.vocab_size)


_KEEPS_TEXT = {"ByteLevel", "Metaspace", "Digits", "Sequence", "Split"}  # pre-tokenizers that drop nothing


def longest_token_chars(tokenizer) -> int | None:
    """The most characters one token covers, or None where no sound bound is known. NOTE: a BPE
    tokenizer that normalizes nothing and drops nothing (byte-level BPE: a vocabulary string holds one
    character per byte) turns N characters into at least N / this many tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not _drops_no_text(json.loads(backend.to_str())):
        return None
    return max(len(token) for token in tokenizer.get_vocab())


def _drops_no_text(spec: dict) -> bool:
    """A tokenizer.json whose text reaches the tokens whole: no normalizer, no pre-tokenizer that removes
    text, no unknown token fused over a span, no added token that swallows spaces."""
    model = spec.get("model") or {}
    pre_tokenizers, stack = [], [spec.get("pre_tokenizer")]
    while stack:
        pre = stack.pop()
        if pre is not None:
            pre_tokenizers.append(pre)
            stack.extend(pre.get("pretokenizers") or ())
    return (spec.get("normalizer") is None and model.get("type") == "BPE"
            and bool(model.get("byte_fallback") or not model.get("fuse_unk"))
            and all(p.get("type") in _KEEPS_TEXT and p.get("behavior") != "Removed" for p in pre_tokenizers)
            and not any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or ()))
