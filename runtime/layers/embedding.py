"""Vocabulary-parallel token embedding, the matching LM head, and replicated position embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.runtime.worker.checkpoint import CheckpointTensor
from shardserve.runtime.layers.weights import copy_into
from shardserve.runtime.distributed.parallel_state import (get_parallel_state, tensor_parallel_all_gather,
                                               tensor_parallel_all_reduce)

VOCAB_PADDING = 64


def pad_vocab(vocab_size: int, tp_size: int) -> int:
    multiple = VOCAB_PADDING * tp_size
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the (padded) vocabulary on each rank; out-of-range ids embed to zero
    locally and the all-reduce fills them in from the owning rank."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None):
        super().__init__()
        state = get_parallel_state()
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        self.num_embeddings = num_embeddings
        self.num_padded = pad_vocab(num_embeddings, self.tp_size)
        self.rows_per_rank = self.num_padded // self.tp_size
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, embedding_dim, dtype=dtype), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor) -> None:
        if loaded.shape[0] != self.num_embeddings:
            raise ValueError(f"embedding has {loaded.shape[0]} rows, config.json says vocab_size={self.num_embeddings}")
        start = min(self.vocab_start, self.num_embeddings)
        num_rows = min(self.rows_per_rank, self.num_embeddings - start)
        copy_into(param.data.narrow(0, 0, num_rows), loaded.narrow(0, start, num_rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, dim]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return tensor_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits over the real vocabulary (padding rows dropped after the gather)."""

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [n, dim] -> [n, vocab]
        logits = F.linear(hidden_states, self.weight)
        logits = tensor_parallel_all_gather(logits)
        return logits[..., : self.num_embeddings]


class ReplicatedEmbedding(nn.Module):
    """A small table kept whole on every rank (learned positions)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
