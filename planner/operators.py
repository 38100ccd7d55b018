"""The time of one engine step on one rank of one pipeline stage, built operator by operator.

A step runs `num_decode` requests one token each and prefill chunks (tokens computed, with the
context they attend over). Per decoder layer (Megatron tensor parallel, shapes per rank):

    qkv GEMM [T, hidden] x [hidden, (heads + 2 kv_heads) * head_dim / tp]
    attention: decode (batch, context) + prefill chunks (isl, causal)
    o GEMM [T, heads * head_dim / tp] x [.., hidden]        all-reduce T * hidden
    MLP: gate_up / down GEMMs, or routed experts (grouped)   all-reduce T * hidden
    norms, rotary + KV write, activation: memory-bound element-wise kernels
    (MLA: the q and kv down/up projections, the absorbed per-head products, and attention over the
    cached latent of kv_lora_rank + qk_rope_head_dim values per token, whole on every rank)
    (Gated DeltaNet linear attention: its projections, the short convolution, and the delta rule over a
    state per request instead of attention over the context: _linear_attention_ms)

then embedding (first stage), final norm, LM head, logits gather and sampling (last stage).
Each operator is looked up in the GPU's measured tables (perf_tables) and falls back to a
roofline with the efficiencies fitted to measured GPUs where a table lacks it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from shardserve.planner.hardware import GpuSpec
from shardserve.planner.model_spec import ModelSpec, kv_heads_per_rank
from shardserve.planner.perf_tables import Database, roofline_fit

ELEMENTWISE_OPS_PER_LAYER = 4  # input norm, rotary + KV write, post-attention norm, activation
SAMPLER_FLOOR_MS = 0.02


@dataclass(frozen=True)
class StageShape:
    """What one rank of a stage computes: the model, the split and the dtypes."""
    spec: ModelSpec
    tp: int
    expert_parallel: bool
    num_layers: int
    num_moe_layers: int
    num_window_layers: int  # layers attending over spec.sliding_window only
    is_first: bool
    is_last: bool
    gemm_dtype: str      # gemm table: bfloat16 | fp8 | float32
    weight_bits: int     # 16 (or 32), 8 for fp8, 4 for AWQ/GPTQ int4
    act_bytes: int       # activation element bytes
    kv_dtype: str        # attention tables: bfloat16 | fp8 | float32
    kv_bytes: int
    expert_bits: int     # the routed experts' weight bits: weight_bits, or 4 for MXFP4 (gpt-oss's experts only)
    num_linear_layers: int = 0  # Gated DeltaNet layers (no attention over the context, no KV)


@dataclass(frozen=True)
class Chunk:
    """A prefill chunk: `tokens` computed, attending over positions [0, end)."""
    tokens: int
    end: int


class Operators:
    """Operator latencies (ms) on one GPU: measured where the tables cover them, else the fitted roofline."""

    def __init__(self, gpu: GpuSpec, db: Database, link_bytes_per_s: float):
        self.gpu, self.db, self.link = gpu, db, link_bytes_per_s
        self.fit = roofline_fit()
        self.flops = gpu.bf16_flops or gpu.fp16_flops

    def _floor(self) -> float:
        return self.fit["floor_ms"]

    def elementwise(self, nbytes: float) -> float:
        return self._floor() + nbytes / (self.gpu.hbm_bytes_per_s * self.fit["gemm_memory"]) * 1e3

    @functools.lru_cache(maxsize=65536)
    def gemm(self, m: int, n: int, k: int, dtype: str, weight_bits: int) -> float:
        if m <= 0 or n <= 0 or k <= 0:
            return 0.0
        table = "fp8" if dtype == "fp8" else dtype
        measured = self.db.lookup(f"gemm.{table}", m=m, n=n, k=k)
        if measured is None:
            peak = self.flops * (2 if dtype == "fp8" and self.gpu.has_fp8 else 1)
            if dtype == "float32" and not self.gpu.is_cpu:
                peak /= 2
            compute = 2 * m * n * k / (peak * self.fit["gemm_compute"])
            nbytes = n * k * weight_bits / 8 + (m * k + m * n) * 2
            memory = nbytes / (self.gpu.hbm_bytes_per_s * self.fit["gemm_memory"])
            return max(compute, memory) * 1e3 + self._floor()
        if weight_bits < 8:
            # NOTE: int4 weights (AWQ/GPTQ) read a quarter of the bytes where the GEMM is memory-bound
            # (small m) and dequantize into the same tensor-core math where it is compute-bound.
            share = min(1.0, max(0.0, math.log2(max(m, 1) / 16) / 4))  # 0 at m <= 16, 1 at m >= 256
            return measured * (weight_bits / 16 + (1 - weight_bits / 16) * share)
        return measured

    @functools.lru_cache(maxsize=65536)
    def decode_attention(self, batch: int, context: int, kv_heads: int, head_dim: int,
                         kv_dtype: str, kv_bytes: int) -> float:
        if batch <= 0:
            return 0.0
        measured = self.db.lookup(f"decode_attention.{_attn_table(kv_dtype)}", head_dim=head_dim,
                                  num_kv_heads=kv_heads, batch=batch, context=context)
        if measured is not None:
            return measured
        nbytes = 2 * batch * context * kv_heads * head_dim * kv_bytes
        return nbytes / (self.gpu.hbm_bytes_per_s * self.fit["decode_attention_memory"]) * 1e3 + self._floor()

    @functools.lru_cache(maxsize=65536)
    def prefill_attention(self, tokens: int, end: int, heads: int, head_dim: int, kv_dtype: str) -> float:
        """A chunk of `tokens` queries ending at position `end`, causal over [0, end)."""
        if tokens <= 0:
            return 0.0
        start = end - tokens
        share = (end * end - start * start) / (end * end)  # the causal work this chunk does
        measured = self.db.lookup(f"prefill_attention.{_attn_table(kv_dtype)}", head_dim=head_dim,
                                  num_heads=heads, batch=1, isl=end)
        if measured is not None:
            return measured * share
        flops = 2 * end * end * heads * head_dim * share
        return flops / (self.flops * self.fit["prefill_attention_compute"]) * 1e3 + self._floor()

    @functools.lru_cache(maxsize=4096)
    def allreduce(self, nbytes: int, num_gpus: int) -> float:
        if num_gpus <= 1 or nbytes <= 0:
            return 0.0
        if num_gpus <= 8 and not self.gpu.is_cpu:
            measured = self.db.lookup("allreduce", num_gpus=num_gpus, bytes=nbytes)
            if measured is not None:
                return measured
        ring = 2 * (num_gpus - 1) / num_gpus * nbytes / (self.link * self.fit["allreduce_link"])
        return self.fit["allreduce_floor_ms"] + ring * 1e3


def _attn_table(kv_dtype: str) -> str:
    return "fp8" if kv_dtype.startswith("fp8") else ("float32" if kv_dtype == "float32" else "bfloat16")


def stage_step_ms(ops: Operators, shape: StageShape, num_decode: int, decode_context: int,
                  chunks: tuple[Chunk, ...], num_drafts: int = 0) -> float:
    """Milliseconds for one step on one rank of the stage (device time, no host). `num_drafts`: the decoding
    requests' drafted tokens verified beside their last ones (speculative decoding): rows of every projection
    and of the sampler, while attention reads each request's KV once for its last token and drafts together."""
    spec, tp = shape.spec, shape.tp
    tokens = num_decode + num_drafts + sum(c.tokens for c in chunks)
    if tokens == 0:
        return 0.0
    # every layer: projections and element-wise work; then each layer's attention and MLP by kind
    num_linear = shape.num_linear_layers
    total = _layer_ms(ops, shape, tokens) * (shape.num_layers - num_linear)
    if num_linear:
        total += _linear_attention_ms(ops, shape, tokens, num_decode, len(chunks)) * num_linear
    num_full = shape.num_layers - shape.num_window_layers - num_linear
    if num_full:
        total += _attention_ms(ops, shape, num_decode, decode_context, chunks, False) * num_full
    if shape.num_window_layers:
        total += _attention_ms(ops, shape, num_decode, decode_context, chunks, True) * shape.num_window_layers
    num_dense = shape.num_layers - shape.num_moe_layers
    if num_dense:
        total += _mlp_ms(ops, shape, tokens, spec.intermediate_size // tp) * num_dense
    if shape.num_moe_layers:
        total += _moe_mlp_ms(ops, shape, tokens) * shape.num_moe_layers
    if shape.is_first:
        total += ops.elementwise(tokens * spec.hidden_size * shape.act_bytes)
    if shape.is_last:
        sampled = num_decode + num_drafts + len(chunks)
        vocab = -(-spec.vocab_size // tp)
        total += ops.elementwise(2 * tokens * spec.hidden_size * shape.act_bytes)
        total += ops.gemm(sampled, vocab, spec.hidden_size, shape.gemm_dtype, 16)
        total += ops.allreduce(sampled * vocab * 4 * tp // 2, tp)  # gather the logits to one rank
        total += SAMPLER_FLOOR_MS + ops.elementwise(3 * sampled * spec.vocab_size * 4)
    return total


def _layer_ms(ops: Operators, shape: StageShape, tokens: int) -> float:
    """A decoder layer without its attention kernel and its MLP: projections, all-reduces, element-wise."""
    spec, tp = shape.spec, shape.tp
    if spec.mla:
        return _mla_layer_ms(ops, shape, tokens)
    q_width = spec.num_attention_heads * spec.head_dim // tp
    kv_width = kv_heads_per_rank(spec, tp) * spec.head_dim
    hidden, g, bits = spec.hidden_size, shape.gemm_dtype, shape.weight_bits
    gate = q_width if spec.has_attention_output_gate else 0  # q_proj also gives the output's gate
    t = ops.gemm(tokens, q_width + gate + 2 * kv_width, hidden, g, bits)
    t += ops.gemm(tokens, hidden, q_width, g, bits)
    t += 2 * ops.allreduce(tokens * hidden * shape.act_bytes, tp)
    act = shape.act_bytes
    t += ops.elementwise(4 * tokens * hidden * act)  # input norm: read x and residual, write both
    t += ops.elementwise(tokens * (q_width + 2 * kv_width) * act * 2)  # rotary + KV write
    t += ops.elementwise(4 * tokens * hidden * act)  # post-attention norm
    return t


def _mla_layer_ms(ops: Operators, shape: StageShape, tokens: int) -> float:
    """_layer_ms under MLA (attention/mla.py): q (through q_lora_rank or not), the cache entry, W_UK
    into each head's query and W_UV out of its latent output, o; two all-reduces; norms and rotary."""
    spec, m = shape.spec, shape.spec.mla
    assert m is not None  # an MLA model's layer
    heads, hidden, g, bits = spec.num_attention_heads // shape.tp, spec.hidden_size, shape.gemm_dtype, shape.weight_bits
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    if m.q_lora_rank:
        t = ops.gemm(tokens, m.q_lora_rank, hidden, g, bits) + ops.gemm(tokens, heads * qk, m.q_lora_rank, g, bits)
    else:
        t = ops.gemm(tokens, heads * qk, hidden, g, bits)
    t += ops.gemm(tokens, m.cache_width, hidden, g, bits)
    # the per-head products: as one GEMM of the same FLOPs and weight bytes (model dtype)
    t += ops.gemm(tokens, heads * m.kv_lora_rank, m.qk_nope_head_dim, "bfloat16", 16)
    t += ops.gemm(tokens, heads * m.v_head_dim, m.kv_lora_rank, "bfloat16", 16)
    t += ops.gemm(tokens, hidden, heads * m.v_head_dim, g, bits)
    t += 2 * ops.allreduce(tokens * hidden * shape.act_bytes, shape.tp)
    act = shape.act_bytes
    t += ops.elementwise(8 * tokens * hidden * act)  # input and post-attention norms
    return t + ops.elementwise(tokens * (heads * qk + 2 * m.cache_width) * act * 2)  # latent norm, rotary, write


def _linear_attention_ms(ops: Operators, shape: StageShape, tokens: int, num_decode: int, num_chunks: int) -> float:
    """A Gated DeltaNet layer without its MLP: input projections (q, k, v, z, b, a) and out_proj as GEMMs,
    two all-reduces, norms, the short convolution and gated norm, and the delta rule.
    NOTE: the delta rule is taken as ~4 products with each value head's [dk, dv] state per token (decay,
    k^T S, the rank-1 update, q^T S: 8 dk dv flops) at the GEMM's compute efficiency, plus reading and
    writing each request's state (float32, and the conv window) once per step: per decode request, and
    once per prefill chunk (the chunked form carries the state across the chunk). No measured table has
    this kernel; the chunked prefill's intra-chunk products are left out."""
    spec, tp, la = shape.spec, shape.tp, shape.spec.linear_attention
    assert la is not None  # a linear-attention model
    hidden, g, bits, act = spec.hidden_size, shape.gemm_dtype, shape.weight_bits, shape.act_bytes
    t = ops.gemm(tokens, la.projection_width(tp), hidden, g, bits) + ops.gemm(tokens, hidden, la.value_dim // tp, g, bits)
    t += 2 * ops.allreduce(tokens * hidden * act, tp)
    t += ops.elementwise(8 * tokens * hidden * act)  # input and post-attention norms
    t += ops.elementwise(2 * tokens * (la.conv_dim(tp) + 2 * la.value_dim // tp) * act)  # conv; gated norm
    t += ops.elementwise(2 * (num_decode + num_chunks) * la.state_bytes_per_layer(tp, act))
    flops = 8 * tokens * la.num_value_heads // tp * la.key_head_dim * la.value_head_dim
    return t + flops / (ops.flops * ops.fit["gemm_compute"]) * 1e3


def _mlp_ms(ops: Operators, shape: StageShape, tokens: int, inter: int) -> float:
    spec, g, bits = shape.spec, shape.gemm_dtype, shape.weight_bits
    up = 2 * inter if spec.is_gated_mlp else inter
    t = ops.gemm(tokens, up, spec.hidden_size, g, bits) + ops.gemm(tokens, spec.hidden_size, inter, g, bits)
    return t + ops.elementwise(3 * tokens * inter * shape.act_bytes)


def _moe_mlp_ms(ops: Operators, shape: StageShape, tokens: int) -> float:
    """Routed experts (balanced routing): the active experts' GEMMs over their shares of the tokens;
    whole experts per rank under expert parallel, else every expert split over the tp ranks."""
    spec, tp = shape.spec, shape.tp
    experts, topk = spec.num_experts, spec.num_experts_per_tok
    assert experts and topk and spec.moe_intermediate_size is not None  # a mixture of experts has all three
    shared = (_mlp_ms(ops, shape, tokens, spec.shared_expert_intermediate_size // tp)
              if spec.shared_expert_intermediate_size else 0.0)
    if shape.gemm_dtype == "bfloat16" and shape.expert_bits == 16:
        # vLLM's fused MoE layer measured for this model shape (router and top-k included)
        measured = ops.db.lookup(
            f"moe.bfloat16@{spec.hidden_size}x{spec.moe_intermediate_size}x{topk}x{experts}",
            tp=1 if shape.expert_parallel else tp, ep=tp if shape.expert_parallel else 1, num_tokens=tokens)
        if measured is not None:
            return measured + shared
    local = experts // tp if shape.expert_parallel else experts
    inter = spec.moe_intermediate_size if shape.expert_parallel else spec.moe_intermediate_size // tp
    pairs = tokens * topk * local / experts  # (token, expert) pairs this rank computes
    active = max(1, round(min(local, pairs)))
    per_expert = max(1, round(pairs / active))
    g, bits, hidden = shape.gemm_dtype, shape.expert_bits, spec.hidden_size
    t = ops.gemm(tokens, experts, hidden, "bfloat16" if g == "fp8" else g, 16)  # the router
    # NOTE: a grouped GEMM is one kernel over the active experts side by side: as one GEMM of
    # per_expert rows and `active` experts' columns (not `active` launches). Where the fused layer
    # was measured this reads 0.8-3x its time, 1.1-1.2x on the median: a little optimistic.
    up = 2 * inter if spec.is_gated_mlp else inter
    t += ops.gemm(per_expert, up * active, hidden, g, bits) + ops.gemm(per_expert, hidden * active, inter, g, bits)
    return t + ops.elementwise(3 * pairs * inter * shape.act_bytes) + shared


def _attention_ms(ops: Operators, shape: StageShape, num_decode: int, decode_context: int,
                  chunks: tuple[Chunk, ...], windowed: bool) -> float:
    spec, tp = shape.spec, shape.tp
    window = spec.sliding_window if windowed and spec.sliding_window else None
    heads, kv_heads = spec.num_attention_heads // tp, kv_heads_per_rank(spec, tp)
    context = min(decode_context, window) if window else decode_context
    if spec.mla:  # multi-query over the cache entries: each read once for all heads; absorbed widths
        nbytes = num_decode * max(1, context) * spec.mla.cache_width * shape.kv_bytes
        t = ops.elementwise(nbytes) if num_decode else 0.0
        width = (spec.mla.cache_width + spec.mla.kv_lora_rank) // 2  # scores over the entry, outputs over the latent
        return t + sum(ops.prefill_attention(c.tokens, c.end, heads, width, shape.kv_dtype) for c in chunks)
    t = ops.decode_attention(num_decode, max(1, context), kv_heads, spec.head_dim, shape.kv_dtype, shape.kv_bytes)
    for c in chunks:
        if window and c.end > window:
            # a windowed chunk attends over at most `window` keys: as chunks of at most `window` queries
            # ending at the window (gpt-oss's 128-token windows take prompt chunks many times as long)
            queries = min(c.tokens, window)
            t += ops.prefill_attention(queries, window, heads, spec.head_dim, shape.kv_dtype) * c.tokens / queries
        else:
            t += ops.prefill_attention(c.tokens, c.end, heads, spec.head_dim, shape.kv_dtype)
    return t
