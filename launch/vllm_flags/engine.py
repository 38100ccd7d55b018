"""vLLM's parallel, KV cache, offload, scheduler, compilation and kernel flags that `launch` takes under no
same name."""

from __future__ import annotations

from shardserve.launch.vllm_flags.entry import KERNELS, MULTINODE, SPECULATIVE, notice, refuse, rename

NOT_CONFIGURABLE = "a tuning knob of vLLM's; not configurable here"
CONTEXT_PARALLEL = "context parallelism; not served: -tp, -pp and -dp are the layouts here"
ONE_POOL = "here one KV pool serves every layer (blocks behind a window are freed only when every layer has it)"
GRAPHS = ("torch.compile and CUDA graph settings; here no torch.compile, and decode CUDA graphs for batch sizes "
          "up to --max-num-seqs (--enforce-eager: none)")
MAMBA = "for Mamba (state-space) layers; shardserve serves no such model"
REPLICAS = "for data-parallel engines kept in step; here replicas are independent engines"

PARALLEL = (
    *refuse(MULTINODE, "--master-addr --master-port --nnodes|-n --node-rank|-r --data-parallel-rank|-dpn "
            "--data-parallel-start-rank|-dpr --data-parallel-size-local|-dpl --data-parallel-address|-dpa "
            "--data-parallel-rpc-port|-dpp --data-parallel-hybrid-lb|-dph! --data-parallel-external-lb|-dpe! "
            "--data-parallel-multi-port-external-lb|-dpm!"),
    *notice("one server fronts every replica here", "--no-data-parallel-hybrid-lb! --no-data-parallel-external-lb!"),
    *refuse("how data-parallel engines start; here each replica is a process of this host, its ranks local "
            "or on Ray (--distributed-executor-backend ray)", "--data-parallel-backend|-dpb", accepted=("mp",)),
    *refuse("timeouts of torch.distributed's groups; not configurable (PyTorch's defaults)",
            "--distributed-timeout-seconds --cpu-distributed-timeout-seconds"),
    *refuse("NUMA binding of workers; not served", "--numa-bind! --numa-bind-nodes+ --numa-bind-cpus+"),
    *notice("workers are not NUMA-bound here", "--no-numa-bind!"),
    *refuse("the GPUs to use; here set CUDA_VISIBLE_DEVICES", "--device-ids"),
    *refuse(CONTEXT_PARALLEL, "--decode-context-parallel-size|-dcp --prefill-context-parallel-size|-pcp",
            accepted=("1",)),
    *notice("for context parallelism, which is not served", "--dcp-comm-backend --dcp-q-replicate! "
            "--no-dcp-q-replicate! --dcp-kv-cache-interleave-size --cp-kv-cache-interleave-size"),
    *rename("-ep!", "--enable-expert-parallel"),
    *rename("--disable-expert-parallel!", "--no-enable-expert-parallel"),
    *refuse("sequence parallelism for HyperConnection models; not served", "--enable-hc-sp!"),
    *refuse(NOT_CONFIGURABLE, "--enable-batch-sharded-sampling! --enable-ep-weight-filter! --enable-dbo! "
            "--all2all-backend"),
    *refuse(NOT_CONFIGURABLE, "--ubatch-size", accepted=("0",)),
    *notice("it is off here too", "--disable-hc-sp! --disable-batch-sharded-sampling! --disable-ep-weight-filter! "
            "--disable-dbo! --disable-elastic-ep! --disable-eplb! --no-ray-workers-use-nsight! "
            "--disable-fault-tolerance! --no-kv-sharing-fast-prefill!"),
    *notice("it sets dual-batch overlap (--enable-dbo), which is not served",
            "--dbo-decode-token-threshold --dbo-prefill-token-threshold"),
    *notice("it is for multimodal inputs sent to workers: " + "no image, audio or video input here",
            "--enable-shm-tensor-arena! --disable-shm-tensor-arena!"),
    *refuse("elastic expert parallelism; not served", "--enable-elastic-ep!"),
    *notice("it sets elastic expert parallelism, which is not served", "--elastic-ep-max-dp-size"),
    *notice(REPLICAS, "--dp-sync-interval --disable-nccl-for-dp-synchronization! "
            "--enable-nccl-for-dp-synchronization!"),
    *refuse("expert load balancing (redundant experts); not served", "--enable-eplb! --eplb-config"),
    *refuse("where experts go; here each rank takes a contiguous range (vLLM's linear)",
            "--expert-placement-strategy", accepted=("linear",)),
    *refuse("Nsight profiling of Ray workers; not served", "--ray-workers-use-nsight!"),
    *notice("here the all-reduce is NCCL's (torch.distributed), no custom kernel", "--disable-custom-all-reduce!"),
    *refuse("vLLM's custom all-reduce kernel; here NCCL's (torch.distributed), not configurable",
            "--enable-custom-all-reduce!"),
    *refuse("a worker class by import path; not served", "--worker-cls", accepted=("auto",)),
    *refuse("a worker extension class by import path; not served", "--worker-extension-cls", accepted=("",)),
    *refuse("engine fault tolerance; here a dead replica is restarted while the others serve, and "
            "--restart starts the gang again", "--enable-fault-tolerance! --fault-tolerance-config"),
)

CACHE = (
    *rename("--device-memory-utilization", "--gpu-memory-utilization"),
    *rename("--disable-prefix-caching!", "--no-enable-prefix-caching"),
    *refuse("a fixed number of KV blocks; here --kv-cache-memory-bytes sets the KV pool per rank",
            "--num-gpu-blocks-override"),
    *refuse("the prefix-cache hash; here a chained blake2b of each block's tokens, not configurable",
            "--prefix-caching-hash-algo"),
    *refuse("prefix-cache hits finer than a block; here hits land on whole blocks (--block-size)",
            "--prefix-match-unit"),
    *refuse("prefix-cache checkpoints of sliding-window layers; not configurable",
            "--prefix-cache-retention-interval"),
    *refuse("layers kept out of --kv-cache-dtype; here it applies to every layer", "--kv-cache-dtype-skip-layers+"),
    *refuse("KV sharing across layers (YOCO models such as Gemma 3n); not served", "--kv-sharing-fast-prefill!"),
    *notice("for DeepSeek-V4.1's sliding-window KV, a model shardserve does not serve",
            "--swa-bounded-replay! --no-swa-bounded-replay!"),
    *notice(MAMBA, "--mamba-backend --mamba-ssu-algorithm --enable-mamba-cache-stochastic-rounding! "
            "--disable-mamba-cache-stochastic-rounding! --mamba-cache-philox-rounds --mamba-cache-dtype "
            "--mamba-ssm-cache-dtype --mamba-block-size --mamba-cache-mode --enable-mamba-shared-prefix-checkpoint! "
            "--disable-mamba-shared-prefix-checkpoint! --replayssm-buffer-len --use-replayssm! --no-use-replayssm! "
            "--engram-config"),
    *refuse("the CPU tier's backend; here shardserve's own (vLLM's native), sized by --kv-offloading-size",
            "--kv-offloading-backend", accepted=("native",)),
    *refuse("weights kept in host memory; not served: every weight stays on the GPUs (more GPUs: -tp, -pp, "
            "or let `shardserve plan` choose)", "--cpu-offload-gb", accepted=("0",)),
    *refuse("weight offloading; not served: every weight stays on the GPUs", "--offload-backend",
            accepted=("auto",)),
    *refuse("weight offloading; not served: every weight stays on the GPUs", "--cpu-offload-params+ "
            "--offload-group-size --offload-num-in-group --offload-prefetch-step --offload-params+"),
)

SCHEDULER = (
    *refuse("a step's token cap below max_num_batched_tokens (for speculative decoding); here "
            "--max-num-batched-tokens is the one cap", "--max-num-scheduled-tokens"),
    *refuse("requests running at once below max_num_seqs; here --max-num-seqs is the one limit",
            "--max-num-active-seqs"),
    *refuse("requests in flight before a 503; here --max-queued-requests (the API requests in flight)",
            "--max-num-queued-reqs"),
    *refuse("prompt tokens in prefill before a 503; not served: --max-queued-requests bounds requests",
            "--max-num-queued-tokens"),
    *refuse("a cap on one prompt's chunk; here a prompt takes the token budget left in the step "
            "(--max-num-batched-tokens)", "--long-prefill-token-threshold", accepted=("0",)),
    *notice("it tunes --long-prefill-token-threshold, which is not served",
            "--long-prefill-token-threshold-adaptive! --no-long-prefill-token-threshold-adaptive!"),
    *refuse("the scheduling policy; here first come, first served (vLLM's fcfs), and clients share the engines "
            "fairly", "--scheduling-policy", accepted=("fcfs",)),
    *rename("--disable-chunked-prefill!", "--no-enable-chunked-prefill"),
    *refuse("a scheduler class by import path; not served", "--scheduler-cls"),
    *refuse("room for the whole prompt before admitting it; here a prompt is admitted when its first chunk's "
            "blocks fit (vLLM's --no-scheduler-reserve-full-isl)", "--scheduler-reserve-full-isl!"),
    *notice("a prompt is admitted when its first chunk's blocks fit here too", "--no-scheduler-reserve-full-isl!"),
    *refuse("KV blocks kept free when admitting; here none", "--watermark", accepted=("0", "0.0")),
    *refuse("prefill admitted every Nth step; here every step", "--prefill-schedule-interval", accepted=("1",)),
    *notice(ONE_POOL, "--disable-hybrid-kv-cache-manager!"),
    *refuse("a KV pool per attention type; " + ONE_POOL, "--enable-hybrid-kv-cache-manager!"),
    *refuse("tokens buffered per streamed chunk; here each step's tokens go out at once",
            "--stream-interval", accepted=("1",)),
    *refuse(GRAPHS, "--cudagraph-capture-sizes+ --max-cudagraph-capture-size --compilation-config|-cc "
            "--optimization-level"),
    *refuse("a latency or throughput preset; here the settings are the flags given (or the plan's)",
            "--performance-mode", accepted=("balanced",)),
)

KERNEL_FLAGS = (
    *refuse(KERNELS, "--ir-op-priority --attention-config|-ac --kernel-config --monokernel!"),
    *refuse(KERNELS, "--moe-backend --linear-backend --sparse-indexer-topk-backend", accepted=("auto",)),
    *notice("FlashInfer's autotuning; shardserve runs no FlashInfer kernel",
            "--enable-flashinfer-autotune! --disable-flashinfer-autotune!"),
    *notice("it is off here too", "--no-monokernel!"),
)

CONFIGS = (
    *rename("-sc", "--speculative-config"),
    *refuse(SPECULATIVE, "--spec-method --spec-model --spec-tokens"),
    *refuse("watermarked outputs; not served", "--watermark-config"),
    *refuse("diffusion language models; not served", "--diffusion-config|-dc"),
    *refuse("disaggregated serving (KV or encoder-cache connectors); not served",
            "--kv-transfer-config --ec-transfer-config"),
    *refuse("KV cache events for an external router; not served: with --data-parallel-size the server routes "
            "by cached prefix itself (--routing-policy cache_aware)", "--kv-events-config"),
    *refuse("a reasoning budget (forced end strings); not served: --reasoning-parser splits the reasoning",
            "--reasoning-config"),
    *refuse("platform plugins' extra settings; not served", "--additional-config"),
    *refuse("the structured-output backend; here xgrammar compiles every grammar, not configurable",
            "--structured-outputs-config"),
    *refuse("auxiliary outputs (routed experts); not served", "--aux-output-config"),
    *refuse("the engine profiler (/start_profile); not served", "--profiler-config"),
    *refuse("a stack-dump watchdog; here each engine sends a heartbeat, and 15 s of silence is its death",
            "--watchdog-config"),
    *refuse("weight updates from a trainer (RL); not served", "--weight-transfer-config"),
)
