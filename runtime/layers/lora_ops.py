"""The batched LoRA matmul (Punica's gathered matmul): each token times the weight of its own LoRA slot.

    out[t, :] (=, or +=) x[t, :] @ w[slot[t]].T        for every token t with an adapter

Two uses per LoRA layer: shrink (x = hidden states [T, in], w = lora_a [L, rank, in], out = [T, rank]
fresh) and expand (x = the shrink output [T, rank], w = lora_b [L, out, rank], out = the layer's output
slice, added to in place). The tokens of a step are sorted by slot on the host once (lora_batch.py), so
the kernel reads each slot's tokens as one contiguous run.
"""

from __future__ import annotations

import torch

from shardserve.runtime.layers.lora_batch import LoRABatch, check_gathered_shapes


def gathered_matmul_reference(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, batch: LoRABatch,
                              add: bool) -> None:
    """The torch path: x [T, K], w [L, N, K], out [T, N] written in place (any strides); products in
    float32. add=False zeroes out first, so rows of tokens without an adapter end up zero; add=True sums
    in float32 before the one rounding to out's dtype, as the kernel does."""
    check_gathered_shapes(x, w, out, batch)
    if not add:
        out.zero_()
    sorted_tokens = batch.sorted_tokens.to(torch.int64)
    starts = batch.slot_starts.tolist()
    for slot in batch.active_slots:
        rows = sorted_tokens[starts[slot]:starts[slot + 1]]
        product = x[rows].float() @ w[slot].float().T  # [rows, N]
        if add:
            product += out[rows].float()
        out[rows] = product.to(out.dtype)


def gathered_matmul(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, batch: LoRABatch, add: bool) -> None:
    """out (=, or +=) x @ w[slot].T per token, in place: the Triton kernel on CUDA, the torch path
    elsewhere. x [T, K] and out [T, N] need a unit stride in their last dim; w [L, N, K] any strides."""
    if x.is_cuda:
        from shardserve.runtime.layers import triton_lora  # triton is needed only on CUDA
        triton_lora.lora_gathered_matmul(x, w, out, batch, add)
    else:
        gathered_matmul_reference(x, w, out, batch, add)
