"""Trains the tiny demo Llama from scratch on CPU for a bounded wall time."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from shardserve.launch.demo.corpus import Corpus


@dataclass(frozen=True, slots=True)
class TrainingConfig:
    minutes: float = 8.0
    seq_len: int = 128
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    num_warmup_steps: int = 30
    weight_decay: float = 0.1
    heldout_fraction: float = 0.02
    num_eval_batches: int = 8
    log_every: int = 25
    seed: int = 0


@dataclass(frozen=True, slots=True)
class TrainingResult:
    num_steps: int
    num_tokens_seen: int
    seconds: float
    train_loss: float
    heldout_loss: float
    unigram_loss: float


def model_config(tokenizer: PreTrainedTokenizerFast, max_model_len: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        # rope_theta: transformers 5 still takes it (into rope_parameters), though its signature does not say so
        max_position_embeddings=max_model_len, rope_theta=10000.0, rms_norm_eps=1e-5,  # type: ignore[call-arg]
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def chat_token_ids(tokenizer: PreTrainedTokenizerFast, messages: list[dict],
                   add_generation_prompt: bool = False) -> list[int]:
    """A chat through the tokenizer's template, as token ids."""
    # a mapping with return_dict=True, which transformers' return type does not tell apart
    encoded: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 return_dict=True)
    return encoded["input_ids"]


def token_stream(tokenizer: PreTrainedTokenizerFast, corpus: Corpus, seed: int) -> torch.Tensor:
    """Every document and chat, each <|begin_of_text|> ... <|end_of_text|>, shuffled, end to end."""
    eos = [tokenizer.eos_token_id]
    pieces = [tokenizer(doc, verbose=False).input_ids + eos for doc in corpus.documents]
    pieces += [chat_token_ids(tokenizer, list(chat)) for chat in corpus.conversations]
    random.Random(seed).shuffle(pieces)
    return torch.tensor([t for piece in pieces for t in piece], dtype=torch.long)  # [num_tokens]


def unigram_loss(stream: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy of the best context-free model: the level a model must get well below."""
    p = torch.bincount(stream, minlength=vocab_size).double() / len(stream)
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def sample_batch(stream: torch.Tensor, cfg: TrainingConfig, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
    return torch.stack([stream[s:s + cfg.seq_len + 1] for s in starts.tolist()])  # [B, T + 1]


def lr_at(cfg: TrainingConfig, step: int, progress: float) -> float:
    """Linear warmup, then cosine decay over the wall-time budget to min_lr_ratio * lr."""
    if step < cfg.num_warmup_steps:
        return cfg.lr * (step + 1) / cfg.num_warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def batch_loss(model: LlamaForCausalLM, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits  # [B, T, vocab]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, stream: torch.Tensor, cfg: TrainingConfig) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    losses = [batch_loss(model, sample_batch(stream, cfg, gen)).item()
              for _ in range(cfg.num_eval_batches)]
    model.train()
    return sum(losses) / len(losses)


def train(model: LlamaForCausalLM, stream: torch.Tensor, cfg: TrainingConfig,
          log: Callable[[str], None] = print) -> TrainingResult:
    # NOTE: the budget is wall time, not steps, so a slow machine stops on time; the
    # learning-rate schedule follows the fraction of the budget spent.
    torch.manual_seed(cfg.seed)
    num_heldout = max(int(len(stream) * cfg.heldout_fraction), cfg.seq_len + 2)
    train_stream, heldout_stream = stream[:-num_heldout], stream[-num_heldout:]
    baseline = unigram_loss(train_stream, model.config.vocab_size)
    log(f"{len(train_stream)} training tokens, {num_heldout} held out; unigram loss {baseline:.3f}")
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    decay = [p for p in model.parameters() if p.ndim >= 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=cfg.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed)
    budget_s, start = cfg.minutes * 60, time.monotonic()
    step, smoothed = 0, baseline
    model.train()
    while (elapsed := time.monotonic() - start) < budget_s:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(cfg, step, elapsed / budget_s)
        loss = batch_loss(model, sample_batch(train_stream, cfg, gen))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        smoothed = loss.item() if step == 0 else 0.95 * smoothed + 0.05 * loss.item()
        step += 1
        if step % cfg.log_every == 0:
            log(f"step {step:5d}  {elapsed:6.0f}s  lr {optimizer.param_groups[0]['lr']:.2e}  "
                f"loss {loss.item():.3f}  smoothed {smoothed:.3f}")
    seconds = time.monotonic() - start
    heldout = evaluate(model, heldout_stream, cfg)
    log(f"done: {step} steps in {seconds:.0f}s; train loss {smoothed:.3f}, held-out {heldout:.3f}")
    return TrainingResult(step, step * cfg.batch_size * cfg.seq_len, seconds, smoothed, heldout,
                          baseline)


def new_model(config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)
