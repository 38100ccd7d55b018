"""Every `vllm serve` flag of the vLLM release below: the ones `launch` takes under the same name, and an
answer for each of the others (FLAGS, by option string)."""

from __future__ import annotations

from shardserve.launch.vllm_flags.engine import CACHE, CONFIGS, KERNEL_FLAGS, PARALLEL, SCHEDULER
from shardserve.launch.vllm_flags.entry import VllmFlag
from shardserve.launch.vllm_flags.frontend import FRONTEND
from shardserve.launch.vllm_flags.model import LOAD, LOGGING, LORA, MODEL, MULTIMODAL_FLAGS
from shardserve.launch.vllm_flags.older import OLDER

# read from `vllm serve`'s parser (vllm.entrypoints.common.cli_args.make_arg_parser) of this release
VLLM_VERSION = "0.33.0"

# vLLM's option strings that `launch` takes as they are (tests/launch/test_vllm_flag_table.py checks both ways)
SAME_NAME = (
    "--model --runner --dtype --seed --revision --max-model-len --quantization --enforce-eager --no-enforce-eager "
    "--max-logprobs --served-model-name --hf-token --generation-config --load-format --download-dir "
    "--reasoning-parser --distributed-executor-backend --pipeline-parallel-size -pp --tensor-parallel-size -tp "
    "--data-parallel-size -dp --enable-expert-parallel --block-size --gpu-memory-utilization "
    "--kv-cache-memory-bytes --kv-cache-dtype --enable-prefix-caching --kv-offloading-size --enable-lora "
    "--max-loras --max-lora-rank --max-cpu-loras --max-num-batched-tokens --max-num-seqs --enable-chunked-prefill "
    "--async-scheduling --no-async-scheduling --speculative-config --shutdown-timeout --lora-modules --chat-template "
    "--trust-request-chat-template --no-trust-request-chat-template --return-tokens-as-token-ids "
    "--no-return-tokens-as-token-ids --enable-auto-tool-choice --tool-call-parser --enable-prompt-tokens-details "
    "--enable-server-load-tracking --enable-force-include-usage --enable-tokenizer-info-endpoint --host --port "
    "--allowed-origins --api-key --root-path --help"
).split()

# vLLM's current flags by group, then older releases' (OLDER)
CURRENT: tuple[VllmFlag, ...] = (*FRONTEND, *MODEL, *LOAD, *LORA, *MULTIMODAL_FLAGS, *LOGGING, *PARALLEL, *CACHE,
                                 *SCHEDULER, *KERNEL_FLAGS, *CONFIGS)


def _by_option(flags: tuple[VllmFlag, ...]) -> dict[str, VllmFlag]:
    table: dict[str, VllmFlag] = {}
    for flag in flags:
        for name in flag.names:
            if name in table:
                raise ValueError(f"{name} has two answers in the vLLM flag table")
            table[name] = flag
    return table


FLAGS: dict[str, VllmFlag] = _by_option(CURRENT + OLDER)
