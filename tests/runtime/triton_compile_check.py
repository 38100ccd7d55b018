"""Compile every Triton kernel ahead of time for a Hopper GPU (sm_90), no GPU needed.

Run in a fresh process without TRITON_INTERPRET (test_triton_compile.py does that). The interpreter
checks what the kernels compute; this checks that the real compiler accepts them (types of
loop-carried values, tl.dot shapes and dtypes) all the way to a cubin, and for the bf16 attention
kernels what the issue asks of their code: wgmma in the prefill's dots, no register spills (ptxas -v)
at head_dim 64, 128 and 256 (Gemma), with attention sinks too (gpt-oss: head_dim 64, sliding windows)."""

from __future__ import annotations

import re
import subprocess
import tempfile

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from triton.compiler import compile as triton_compile

from shardserve.runtime.attention import triton_decode, triton_prefill, triton_rotary_kv
from shardserve.runtime.attention import triton_kernels as kernels
from shardserve.runtime.layers import triton_activation, triton_gated_delta, triton_lora, triton_moe, triton_norm
from shardserve.runtime.layers.quantization import triton_packed_int, triton_quant_moe

INDEX = {"query_start_ptr": "*i32", "seq_lens_ptr": "*i32", "tables_ptr": "*i32", "table_stride": "i32",
         "scale": "fp32", "num_heads": "i32", "num_kv_heads": "i32", "head_dim": "i32", "block_size": "i32",
         "window": "i32", "soft_cap": "fp32"}
TORCH = {"*bf16": torch.bfloat16, "*fp32": torch.float32}


def compile_kernel(fn, types: dict, constexprs: dict, divisible: tuple[str, ...] = (), **options):
    """divisible: integer arguments a launch specializes as multiples of 16 (as Triton's JIT does for
    every pointer, since torch allocations are 16-byte aligned): head_dim 64/128 and block_size 16."""
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else types[n] for n in names}
    aligned = [n for n in names if n not in constexprs and (types[n].startswith("*") or n in divisible)]
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constexprs.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    compiled = triton_compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert "cubin" in compiled.asm, fn.__name__
    return compiled


def spill_bytes(compiled) -> int:
    """Spill stores + loads ptxas reports for the kernel's PTX, on sm_90a as Triton builds it."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", ptx.name, "-o", "/dev/null"],
                             capture_output=True, text=True, check=True).stderr
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))


def require_fast(compiled, name: str, wgmma: bool) -> None:
    assert spill_bytes(compiled) == 0, f"{name} spills registers"
    if wgmma:
        assert "wgmma.mma_async" in compiled.asm["ptx"], f"{name} does not use wgmma"


def compile_attention(dtype: str, cache: str, is_fp32: bool) -> None:
    is_fp8 = cache.startswith("*fp8")
    scales = {"k_scale": "fp32", "v_scale": "fp32"}
    compile_kernel(kernels._store_kv_kernel, {"k_ptr": dtype, "v_ptr": dtype, "k_cache_ptr": cache,
                                              "v_cache_ptr": cache, "slot_ptr": "*i64", "row_size": "i32",
                                              **scales, "largest": "fp32"}, {"BLOCK": 1024, "IS_FP8": is_fp8})
    compile_rotary_kv(dtype, cache, is_fp8)
    tensors = {"q_ptr": dtype, "k_cache_ptr": cache, "v_cache_ptr": cache, "sinks_ptr": "*fp32"}
    parts = {"part_out_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32"}
    variants = ((False, False, False), (True, True, False), (True, False, True)) if cache == dtype else \
        ((False, False, False), (False, False, True))
    for has_window, has_cap, has_sinks in variants:
        flags = {"IS_FP32": is_fp32, "HAS_WINDOW": has_window, "IS_FP8": is_fp8, "HAS_SOFT_CAP": has_cap,
                 **sinks_flags(has_sinks)}
        for head_dim in (64, 128, 256) if cache == dtype and not is_fp32 else (128,):
            block_m, block_n, num_warps = triton_prefill.prefill_tile(TORCH[dtype], head_dim, 4)
            prefill = compile_kernel(triton_prefill._prefill_kernel, {**tensors, "out_ptr": dtype, **INDEX, **scales},
                                     {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": head_dim, **flags},
                                     divisible=("head_dim", "block_size"), num_warps=num_warps, num_stages=2)
            decode = compile_kernel(triton_decode._decode_kernel,
                                    {**tensors, "out_ptr": dtype, **parts, **INDEX, "max_splits": "i32", **scales},
                                    {"BLOCK_G": 16, "BLOCK_N": 64, "BLOCK_D": head_dim,
                                     "SPLIT_MIN": triton_decode.SPLIT_MIN, "NUM_STAGES": 3, **flags},
                                    divisible=("head_dim", "block_size"), num_warps=4)
            if not is_fp32:
                name = f"{dtype} {cache} head_dim {head_dim}{' with sinks' if has_sinks else ''}"
                require_fast(prefill, f"prefill {name}", wgmma=True)
                require_fast(decode, f"decode {name}", wgmma=False)
        compile_kernel(triton_decode._decode_reduce_kernel,
                       {**parts, "out_ptr": dtype, "sinks_ptr": "*fp32", "query_start_ptr": "*i32",
                        "seq_lens_ptr": "*i32", "num_heads": "i32", "head_dim": "i32", "max_splits": "i32",
                        "window": "i32"},
                       {"BLOCK_S": 4, "BLOCK_D": 128, "SPLIT_MIN": triton_decode.SPLIT_MIN, "HAS_WINDOW": has_window,
                        **sinks_flags(has_sinks)})


def sinks_flags(has_sinks: bool) -> dict:
    """HAS_SINKS, and without sinks the None a launch passes for sinks_ptr (a constexpr, as Triton's JIT
    makes every None argument): the kernel then compiles exactly as it did before sinks existed."""
    return {"HAS_SINKS": True} if has_sinks else {"HAS_SINKS": False, "sinks_ptr": None}


def compile_mla_attention() -> None:
    """MLA's 576-wide entries (BLOCK_D 1024) at the tiles the launchers pick for them, 16 heads per
    launch: decode without spills, prefill within 64 spilled bytes; both within sm_90's shared memory."""
    tensors = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "out_ptr": "*bf16"}
    scales = {"k_scale": "fp32", "v_scale": "fp32"}
    flags = {"IS_FP32": False, "HAS_WINDOW": False, "IS_FP8": False, "HAS_SOFT_CAP": False, **sinks_flags(False)}
    block_m, block_n, num_warps = triton_prefill.prefill_tile(torch.bfloat16, 576, 16)
    prefill = compile_kernel(triton_prefill._prefill_kernel, {**tensors, **INDEX, **scales},
                             {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": 1024, **flags},
                             divisible=("head_dim", "block_size"), num_warps=num_warps, num_stages=2)
    decode = compile_kernel(triton_decode._decode_kernel,
                            {**tensors, "part_out_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
                             **INDEX, "max_splits": "i32", **scales},
                            {"BLOCK_G": 16, "BLOCK_N": 16, "BLOCK_D": 1024, "SPLIT_MIN": triton_decode.SPLIT_MIN,
                             "NUM_STAGES": 2, **flags}, divisible=("head_dim", "block_size"), num_warps=8)
    assert spill_bytes(decode) == 0, "MLA decode spills registers"
    assert spill_bytes(prefill) <= 64, "MLA prefill spills more than 64 bytes"
    assert max(decode.metadata.shared, prefill.metadata.shared) <= 227 * 1024, "MLA tiles exceed shared memory"


def compile_rotary_kv(dtype: str, cache: str, is_fp8: bool) -> None:
    for is_partial in (False, True):
        compile_kernel(triton_rotary_kv._rotary_kv_kernel,
                       {"q_ptr": dtype, "k_ptr": dtype, "v_ptr": dtype, "positions_ptr": "*i64", "cos_ptr": "*fp32",
                        "sin_ptr": "*fp32", "q_out_ptr": dtype, "k_cache_ptr": cache, "v_cache_ptr": cache,
                        "slot_ptr": "*i64", "q_stride": "i32", "k_stride": "i32", "v_stride": "i32",
                        "num_heads": "i32", "num_kv_heads": "i32", "head_dim": "i32", "rotary_dim": "i32",
                        "k_scale": "fp32", "v_scale": "fp32", "largest": "fp32"},
                       {"BLOCK_H": 32, "BLOCK_KV": 8, "BLOCK_HALF": 64, "BLOCK_D": 128, "IS_FP8": is_fp8,
                        "IS_PARTIAL": is_partial}, num_warps=4)


def compile_packed_int_gemm(dtype: str, is_fp32: bool) -> None:
    for bits, is_awq in ((4, True), (4, False), (8, False)):
        compile_kernel(triton_packed_int._packed_int_gemm_kernel,
                       {"x_ptr": dtype, "qweight_ptr": "*i32", "qzeros_ptr": "*i32", "scales_ptr": dtype,
                        "group_ptr": "*i32", "out_ptr": dtype, "M": "i32", "N": "i32", "K": "i32",
                        "zero_offset": "i32", "stride_xm": "i32", "stride_qw": "i32", "stride_qz": "i32",
                        "stride_s": "i32", "stride_om": "i32"},
                       {"BITS": bits, "IS_AWQ": is_awq, "IS_FP32": is_fp32, "BLOCK_M": 16, "BLOCK_N": 32,
                        "BLOCK_K": 32})


def compile_moe(dtype: str, is_fp32: bool) -> None:
    """The grouped expert GEMMs at the tiles and warps they launch with (decode-sized blocks and 64-row ones):
    float experts, fp8 (per-tensor, per-channel and block scales share one kernel), AWQ int4, GPTQ int4 and
    int8, and gpt-oss's MXFP4 with biases and swigluoai (also on float experts); quantized ones in bf16
    without spills, and with wgmma at 64 rows."""
    index = {"out_ptr": dtype, "sorted_pairs_ptr": "*i32", "block_experts_ptr": "*i32", "num_pairs": "i32",
             "num_experts": "i32", "intermediate": "i32", "hidden_size": "i32", "stride_xm": "i32",
             "stride_om": "i32", "stride_we": "i32", "stride_wr": "i32", "stride_se": "i32", "stride_sr": "i32",
             "stride_ze": "i32", "stride_zr": "i32", "group_n": "i32", "group_k": "i32", "zero_offset": "i32",
             "b_ptr": dtype, "stride_be": "i32", "alpha": "fp32", "limit": "fp32"}
    m, q = triton_moe, triton_quant_moe
    for fmt, bits, weight, scale, zeros, gpt_oss in (
            (m.FLOAT, 8, dtype, dtype, dtype, False), (m.FP8, 8, "*fp8e4nv", "*fp32", "*fp32", False),
            (m.AWQ, 4, "*i32", dtype, "*i32", False), (m.GPTQ, 4, "*i32", dtype, "*i32", False),
            (m.GPTQ, 8, "*i32", dtype, "*i32", False), (m.MXFP4, 4, "*u8", "*u8", "*u8", True),
            (m.FLOAT, 8, dtype, dtype, dtype, True)):
        matrix = {"x_ptr": dtype, "w_ptr": weight, "s_ptr": scale, "z_ptr": zeros, **index}
        for num_pairs in (1, 4096):
            sizes, warps = ((m.block_sizes, 4) if fmt == m.FLOAT else (q.quantized_block_sizes, q.NUM_WARPS))
            block_m, block_n, block_k = sizes(num_pairs, 8, is_fp32)
            blocks = {"FORMAT": fmt, "BITS": bits, "IS_FP32": is_fp32, "BLOCK_M": block_m, "BLOCK_N": block_n,
                      "BLOCK_K": block_k, "HAS_BIAS": gpt_oss}
            kernels = [compile_kernel(m._moe_gate_up_kernel, {**matrix, "top_k": "i32"},
                                      {**blocks, "ACTIVATION": int(gpt_oss)}, num_warps=warps),
                       compile_kernel(m._moe_down_kernel, {**matrix, "weights_ptr": "*fp32"}, blocks,
                                      num_warps=warps)]
            for name, kernel in zip(("gate-up", "down"), kernels) if not is_fp32 and fmt != m.FLOAT else ():
                require_fast(kernel, f"quantized MoE {name} format {fmt} int{bits} BLOCK_M {block_m}",
                             wgmma=block_m == 64)


def compile_lora(dtype: str, is_fp32: bool) -> None:
    """The batched LoRA gathered matmul at the tiles it launches with: shrink (hidden 4096 -> rank 16, a fresh
    output) and expand (rank 16 -> 4096, added in place), decode-sized (16-row) and prefill (64-row) blocks;
    in bf16 without spills."""
    types = {"x_ptr": dtype, "w_ptr": dtype, "out_ptr": dtype, "sorted_tokens_ptr": "*i32", "slot_starts_ptr": "*i32",
             "num_outputs": "i32", "num_inputs": "i32", "stride_xt": "i32", "stride_wl": "i32", "stride_wn": "i32",
             "stride_wk": "i32", "stride_ot": "i32"}
    for name, num_outputs, num_inputs, add in (("shrink", 16, 4096, False), ("expand", 4096, 16, True)):
        for max_tokens in (1, 4096):
            block_m, block_n, block_k = triton_lora.block_sizes(max_tokens, num_outputs, num_inputs, is_fp32)
            kernel = compile_kernel(triton_lora._gathered_matmul_kernel, types,
                                    {"ADD": add, "IS_FP32": is_fp32, "BLOCK_M": block_m, "BLOCK_N": block_n,
                                     "BLOCK_K": block_k}, num_warps=4)
            if not is_fp32:
                require_fast(kernel, f"LoRA {name} BLOCK_M {block_m}", wgmma=False)


def compile_gated_delta(dtype: str, is_fp32: bool) -> None:
    """Gated DeltaNet's varlen kernels (every step: prefill, mixed, decode) at Qwen3-Next's sizes (kernel 4,
    head dims 128), launched as triton_gated_delta launches them; in bf16 without spills."""
    index = {"slots_ptr": "*i64", "seq_lens_ptr": "*i32", "query_start_ptr": "*i32"}
    for has_verify in (False, True):  # a step verifying drafts also keeps each token's states
        conv = compile_kernel(triton_gated_delta._conv1d_varlen_kernel,
                              {"x_ptr": dtype, "weight_ptr": dtype, "state_ptr": dtype, "out_ptr": dtype, **index,
                               "verify_ptr": dtype, "verifying_ptr": "*i32", "x_stride": "i32",
                               "weight_stride": "i32", "dim": "i32", "num_rows": "i32"},
                              {"KERNEL": 4, "BLOCK_C": triton_gated_delta.CONV_BLOCK_C, "BLOCK_W": 4,
                               "HAS_VERIFY": has_verify}, num_warps=4)
        delta = compile_kernel(triton_gated_delta._gated_delta_varlen_kernel,
                               {"q_ptr": dtype, "k_ptr": dtype, "v_ptr": dtype, "g_ptr": "*fp32", "beta_ptr": dtype,
                                "state_ptr": "*fp32", "out_ptr": dtype, **index, "verify_ptr": "*fp32",
                                "verifying_ptr": "*i32", "q_stride": "i32", "k_stride": "i32", "v_stride": "i32",
                                "num_v_heads": "i32", "group": "i32", "head_k_dim": "i32", "head_v_dim": "i32",
                                "num_rows": "i32", "scale": "fp32", "eps": "fp32"},
                               {"BLOCK_K": 128, "BLOCK_V": triton_gated_delta.MAX_BLOCK_V, "HAS_VERIFY": has_verify},
                               divisible=("head_k_dim", "head_v_dim"), num_warps=4)
        if not is_fp32:
            require_fast(conv, "Gated DeltaNet conv", wgmma=False)
            require_fast(delta, "Gated DeltaNet delta rule", wgmma=False)


def main() -> None:
    for dtype, is_fp32 in (("*bf16", False), ("*fp32", True)):
        for cache in (dtype, "*fp8e4nv", "*fp8e5"):
            compile_attention(dtype, cache, is_fp32)
        compile_packed_int_gemm(dtype, is_fp32)
        compile_kernel(triton_activation._silu_and_mul_kernel,
                       {"x_ptr": dtype, "out_ptr": dtype, "x_stride": "i64", "size": "i32"}, {"BLOCK": 1024})
        compile_moe(dtype, is_fp32)
        compile_lora(dtype, is_fp32)
        compile_gated_delta(dtype, is_fp32)
        if not is_fp32:
            compile_mla_attention()
        for has_residual in (False, True):
            compile_kernel(triton_norm._rms_norm_kernel,
                           {"x_ptr": dtype, "residual_ptr": dtype, "weight_ptr": dtype, "out_ptr": dtype,
                            "residual_out_ptr": dtype, "x_stride": "i64", "residual_stride": "i64",
                            "hidden_size": "i32", "eps": "fp32"}, {"HAS_RESIDUAL": has_residual, "BLOCK": 4096})
    print("compiled")


if __name__ == "__main__":
    main()
