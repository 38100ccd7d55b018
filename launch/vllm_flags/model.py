"""vLLM's model, loading, LoRA, multimodal, logging and metrics flags that `launch` takes under no same name."""

from __future__ import annotations

from shardserve.launch.vllm_flags.entry import KERNELS, MULTIMODAL, notice, refuse, rename

EDIT_A_COPY = "here the model folder's config.json is read: edit it in a copy of the folder"
SLEEP = "sleep mode (freeing GPU memory between uses, for RL); not served"
NO_TRACES = "tracing or extra metrics; not served: /metrics serves vLLM's series (docs/server.md, Metrics)"

MODEL = (
    *refuse("turns a generative model into a pooling one; here --runner pooling pools a causal LM's final "
            "hidden states (vLLM's --convert embed); classify and reward are not served", "--convert",
            accepted=("auto",)),
    *refuse("a tokenizer other than the model's; here the model folder's own is read: copy the folder and put "
            "the other tokenizer's files in the copy", "--tokenizer"),
    *refuse("a tokenizer implementation; here transformers' AutoTokenizer (the fast one where there is one: "
            "vLLM's auto and hf)", "--tokenizer-mode", accepted=("auto", "hf")),
    *refuse("the tokenizer from another revision; here it comes with the model's --revision",
            "--tokenizer-revision"),
    *notice("every architecture shardserve serves is its own code; none runs from the Hub",
            "--trust-remote-code! --no-trust-remote-code! --code-revision"),
    *refuse("config.json from elsewhere; " + EDIT_A_COPY, "--hf-config-path"),
    *refuse("overrides of config.json values; not supported: " + EDIT_A_COPY, "--hf-overrides"),
    *refuse("another model class for an architecture; not supported: each architecture has one implementation",
            "--model-class-overrides"),
    *refuse("overrides of the checkpoint's quantization_config; " + EDIT_A_COPY, "--quantization-config"),
    *rename("-q", "--quantization"),
    *notice("every --quantization choice is served; none is deprecated",
            "--allow-deprecated-quantization! --no-allow-deprecated-quantization!"),
    *refuse("the config format; here Hugging Face's config.json", "--config-format", accepted=("auto", "hf")),
    *refuse("the modeling code: here each architecture's own (vLLM's vllm), never Transformers' or a plugin's",
            "--model-impl", accepted=("auto", "vllm")),
    *refuse("a MoE model's routed experts in outputs; not served", "--enable-return-routed-experts!"),
    *refuse("the sampling mask in outputs; not served", "--return-sampling-mask!"),
    *refuse("request trace replay; not served", "--enable-trace-replay!"),
    *notice("it is off here too", "--disable-return-routed-experts! --no-return-sampling-mask! "
            "--disable-trace-replay! --no-use-fp64-gumbel! --disable-prompt-embeds! --no-skip-tokenizer-init! "
            "--disable-sleep-mode! --no-sleep-mode-offload-cudagraph! --disable-cumem-allocator! "
            "--disable-nccl-comm-suspend! --disable-tower-connector-lora! --no-fully-sharded-loras! "
            "--no-specialize-active-lora! --disable-mixed-moe-lora-format! --disable-moe-shared-loras! "
            "--no-kv-cache-metrics! --no-cudagraph-metrics! --disable-layerwise-nvtx-tracing! "
            "--disable-mfu-metrics! --disable-logging-iteration-details! --no-jit-monitor-verbose! "
            "--enable-sliding-window!"),
    *refuse("which logprobs are returned; here those of the raw logits, before any sampling parameter "
            "(vLLM's raw_logprobs)", "--logprobs-mode", accepted=("raw_logprobs",)),
    *refuse("float64 Gumbel noise in sampling; not configurable", "--use-fp64-gumbel!"),
    *refuse("full attention with max_model_len capped to the sliding window; here the same: --max-model-len "
            "the model's sliding_window", "--disable-sliding-window!"),
    *notice("vLLM removed cascade attention: it changes nothing there either",
            "--disable-cascade-attn! --enable-cascade-attn!"),
    *refuse("a server without a tokenizer; here the server always loads one (the Python API's "
            "LLM(skip_tokenizer_init=True) has none)", "--skip-tokenizer-init!"),
    *refuse("prompts as embeddings; not served: prompts are text or token ids", "--enable-prompt-embeds!"),
    *refuse("pooling settings as JSON; here --pooling-type LAST|MEAN|CLS and --normalize/--no-normalize",
            "--pooler-config"),
    *refuse("overrides of generation_config.json's sampling defaults; here --generation-config takes a folder "
            "holding another generation_config.json", "--override-generation-config"),
    *refuse(SLEEP, "--enable-sleep-mode! --sleep-mode-backend --sleep-mode-offload-cudagraph! "
            "--sleep-preserve-parameter-names+ --enable-cumem-allocator! --enable-nccl-comm-suspend!"),
    *refuse("logits processors by import path; not served", "--logits-processors+"),
    *refuse("an IO processor plugin; not served", "--io-processor-plugin"),
    *refuse("threads rendering chat templates; not configurable here", "--renderer-num-workers",
            accepted=("1",)),
    *refuse("a reasoning parser plugin; here the built-in deepseek_r1, qwen3 and openai_gptoss "
            "(--reasoning-parser)", "--reasoning-parser-plugin"),
)

LOAD = (
    *refuse("how safetensors are read; here each rank reads its own slices lazily (vLLM's lazy)",
            "--safetensors-load-strategy", accepted=("lazy",)),
    *notice("vLLM's prefetch loading only; here each rank reads its own slices lazily",
            "--safetensors-prefetch-num-threads --safetensors-prefetch-block-size"),
    *notice("it loads in batches to bound host memory; here each rank reads its own slices lazily, one at a time",
            "--max-parallel-loading-workers"),
    *refuse("extra settings for a model loader; not served", "--model-loader-extra-config"),
    *refuse("files left out of a download; not configurable: the weights, config and tokenizer files are read",
            "--ignore-patterns+"),
    *notice("it sets progress bars while loading", "--use-tqdm-on-load! --no-use-tqdm-on-load!"),
    *notice("it is for PyTorch .bin/.pt weights; here safetensors only", "--pt-load-map-location"),
    *refuse(KERNELS, "--attention-backend"),
)

LORA = (
    *rename("--disable-lora!", "--no-enable-lora"),
    *refuse("the adapters' dtype; here the model's (vLLM's auto)", "--lora-dtype", accepted=("auto",)),
    *refuse("LoRA on a multimodal model's tower and connector; not served (text only)",
            "--enable-tower-connector-lora!"),
    *refuse("adapter computation sharded across tensor-parallel ranks; not configurable", "--fully-sharded-loras!"),
    *refuse("modules adapters may apply to; here every module an adapter carries (q/k/v/o, gate/up/down)",
            "--lora-target-modules+"),
    *notice(MULTIMODAL, "--default-mm-loras"),
    *refuse("LoRA kernels specialized to the active adapters; not configurable", "--specialize-active-lora!"),
    *refuse("MoE LoRA adapters; not served: adapters on dense models (Llama, Mistral, Qwen2, Qwen3)",
            "--enable-mixed-moe-lora-format! --enable-moe-shared-loras!"),
    *notice("classification adapters are not served", "--max-lora-cls-labels"),
)

MULTIMODAL_FLAGS = (
    *notice("here a multimodal checkpoint serves its language model (its vision tower is not loaded)",
            "--language-model-only!"),
    *refuse("image, audio or video input; not served: a multimodal checkpoint serves its language model only",
            "--no-language-model-only! --enable-mm-embeds! --mm-encoder-only!"),
    *notice(MULTIMODAL, "--allowed-local-media-path --allowed-media-domains+ --limit-mm-per-prompt "
            "--disable-mm-embeds! --media-io-kwargs --mm-processor-kwargs --mm-processor-cache-gb "
            "--mm-processor-cache-type --mm-hasher-algorithm --mm-shm-cache-max-object-size-mb --no-mm-encoder-only! "
            "--mm-encoder-tp-mode --mm-encoder-attn-backend --mm-encoder-attn-dtype --mm-encoder-fp8-scale-path "
            "--mm-encoder-fp8-scale-save-path --mm-encoder-fp8-scale-save-margin --interleave-mm-strings! "
            "--no-interleave-mm-strings! --skip-mm-profiling! --no-skip-mm-profiling! --video-pruning-rate "
            "--video-pruning-method --mm-tensor-ipc --mm-processor-device --mm-ipc-gpu-memory-gb "
            "--mm-device-do-normalize! --no-mm-device-do-normalize! --disable-chunked-mm-input! "
            "--enable-chunked-mm-input! --ec-manager-config"),
)

LOGGING = (
    *refuse("vLLM's logging configuration; here Python logging at INFO to stderr, not configurable",
            "--logging-config --log-config-file"),
    *refuse("the log level; here INFO, not configurable", "--log-level", accepted=("info",)),
    *refuse("metrics vLLM has deprecated; here /metrics serves the current series only",
            "--show-hidden-metrics-for-version"),
    *refuse(NO_TRACES, "--otlp-traces-endpoint --collect-detailed-traces+ --kv-cache-metrics! "
            "--custom-histogram-buckets --cudagraph-metrics! --enable-layerwise-nvtx-tracing! --enable-mfu-metrics! "
            "--enable-logging-iteration-details! --jit-monitor-verbose!"),
    *notice("it samples --kv-cache-metrics, which is not served", "--kv-cache-metrics-sample"),
    *notice("per-request speculative-decoding metrics; the engine's counters are on /metrics "
            "(vllm:spec_decode_*)", "--per-request-spec-decode-metrics"),
    *refuse("what happens on a JIT compile while serving; not configurable", "--jit-monitor-mode",
            accepted=("warn",)),
)
