"""Flags of older vLLM releases, gone from its current `vllm serve` but still in pasted command lines."""

from __future__ import annotations

from shardserve.launch.vllm_flags.entry import MULTIMODAL, SPECULATIVE, notice, refuse

OLDER = (
    *notice("vLLM's CPU swap space for preempted requests; here a preempted request is recomputed, and "
            "--kv-offloading-size is the CPU tier of the KV cache", "--swap-space"),
    *refuse("the task; here --runner pooling serves embeddings (/v1/embeddings), generate text",
            "--task", accepted=("auto", "generate")),
    *refuse("several scheduler steps per call; here one", "--num-scheduler-steps", accepted=("1",)),
    *notice("a setting of vLLM's old engine (V0), which later releases dropped", "--use-v2-block-manager! "
            "--disable-async-output-proc!"),
    *refuse("the longest sequence CUDA graphs cover; not configurable: --enforce-eager turns decode graphs off",
            "--max-seq-len-to-capture"),
    *refuse("the structured-output backend; here xgrammar compiles every grammar",
            "--guided-decoding-backend", accepted=("xgrammar", "auto")),
    *notice("here --reasoning-parser alone turns reasoning parsing on", "--enable-reasoning!"),
    *refuse("how preempted requests come back; here recomputed (vLLM's recompute)", "--preemption-mode",
            accepted=("recompute",)),
    *refuse("rope overrides; not supported: here the model folder's config.json is read: edit it in a copy "
            "of the folder", "--rope-scaling --rope-theta"),
    *refuse("tokenizer worker processes; not served", "--tokenizer-pool-size", accepted=("0",)),
    *refuse(SPECULATIVE, "--speculative-model --num-speculative-tokens --speculative-draft-tensor-parallel-size "
            "--speculative-max-model-len --ngram-prompt-lookup-max --ngram-prompt-lookup-min"),
    *refuse("pooling settings as JSON; here --pooling-type LAST|MEAN|CLS and --normalize/--no-normalize",
            "--override-pooler-config"),
    *notice(MULTIMODAL, "--disable-mm-preprocessor-cache!"),
    *refuse("the engine in the API server's process; here each replica's engine runs in a process of its own",
            "--disable-frontend-multiprocessing!"),
    *refuse("a delay before scheduling prompts; here none", "--scheduler-delay-factor", accepted=("0", "0.0")),
)
