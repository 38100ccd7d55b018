"""Compile every Triton kernel ahead of time for a Hopper GPU (sm_90), no GPU needed.

Run in a fresh process without TRITON_INTERPRET (test_triton_compile.py does that). The interpreter
checks what the kernels compute; this checks that the real compiler accepts them (types of
loop-carried values, tl.dot shapes and dtypes) all the way to a cubin."""

from __future__ import annotations

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler import compile as triton_compile

from shardserve.runtime.attention import triton_kernels as kernels
from shardserve.runtime.layers import triton_moe, triton_norm
from shardserve.runtime.layers.quantization import triton_packed_int

INDEX = {"query_start_ptr": "*i32", "seq_lens_ptr": "*i32", "tables_ptr": "*i32", "table_stride": "i32",
         "scale": "fp32", "num_heads": "i32", "num_kv_heads": "i32", "head_dim": "i32", "block_size": "i32",
         "window": "i32"}


def compile_kernel(fn, types: dict, constexprs: dict) -> None:
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else types[n] for n in names}
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constexprs.items()})
    compiled = triton_compile(source, target=GPUTarget("cuda", 90, 32))
    assert "cubin" in compiled.asm, fn.__name__


def compile_attention(dtype: str, cache: str, is_fp32: bool) -> None:
    is_fp8 = cache.startswith("*fp8")
    scales = {"k_scale": "fp32", "v_scale": "fp32"}
    compile_kernel(kernels._store_kv_kernel, {"k_ptr": dtype, "v_ptr": dtype, "k_cache_ptr": cache,
                                              "v_cache_ptr": cache, "slot_ptr": "*i64", "row_size": "i32",
                                              **scales, "largest": "fp32"}, {"BLOCK": 1024, "IS_FP8": is_fp8})
    tensors = {"q_ptr": dtype, "k_cache_ptr": cache, "v_cache_ptr": cache}
    parts = {"part_out_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32"}
    for has_window in (False, True):
        compile_kernel(kernels._prefill_kernel, {**tensors, "out_ptr": dtype, **INDEX, **scales},
                       {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_D": 128, "IS_FP32": is_fp32, "HAS_WINDOW": has_window,
                        "IS_FP8": is_fp8})
        compile_kernel(kernels._decode_split_kernel, {**tensors, **parts, **INDEX, "num_splits": "i32", **scales},
                       {"BLOCK_N": 16, "BLOCK_D": 128, "HAS_WINDOW": has_window})
    compile_kernel(kernels._decode_reduce_kernel,
                   {**parts, "out_ptr": dtype, "query_start_ptr": "*i32", "num_heads": "i32",
                    "head_dim": "i32", "num_splits": "i32"}, {"BLOCK_S": 4, "BLOCK_D": 128})


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
    index = {"sorted_pairs_ptr": "*i32", "block_experts_ptr": "*i32", "num_pairs": "i32", "num_experts": "i32",
             "hidden_size": "i32", "intermediate": "i32", "stride_xm": "i32", "stride_we": "i32",
             "stride_wn": "i32", "stride_om": "i32"}
    for block_m in (16, 64):
        blocks = {"IS_FP32": is_fp32, "BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 64}
        compile_kernel(triton_moe._moe_gate_up_kernel,
                       {"x_ptr": dtype, "w13_ptr": dtype, "out_ptr": dtype, "top_k": "i32", **index}, blocks)
        compile_kernel(triton_moe._moe_down_kernel,
                       {"x_ptr": dtype, "w2_ptr": dtype, "weights_ptr": "*fp32", "out_ptr": dtype, **index}, blocks)


def main() -> None:
    for dtype, is_fp32 in (("*bf16", False), ("*fp32", True)):
        for cache in (dtype, "*fp8e4nv", "*fp8e5"):
            compile_attention(dtype, cache, is_fp32)
        compile_packed_int_gemm(dtype, is_fp32)
        compile_moe(dtype, is_fp32)
        for has_residual in (False, True):
            compile_kernel(triton_norm._rms_norm_kernel,
                           {"x_ptr": dtype, "residual_ptr": dtype, "weight_ptr": dtype, "out_ptr": dtype,
                            "residual_out_ptr": dtype, "x_stride": "i64", "residual_stride": "i64",
                            "hidden_size": "i32", "eps": "fp32"}, {"HAS_RESIDUAL": has_residual, "BLOCK": 4096})
    print("compiled")


if __name__ == "__main__":
    main()
