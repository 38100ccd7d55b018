"""The one table of settings: each field's name (vLLM's), type, default, help and the layers using it.

Everything else is derived from SETTINGS: the planner's PlanOptions, the runtime's EngineArgs and
LLM(**kwargs), the profile schema, and the `plan` / `launch` command-line options. Layers:

    input    what a plan is made from (the model, the hardware)
    plan     the planner's options (PlanOptions)
    engine   the runtime's options (EngineArgs, LLM(...), AsyncEngine(...))
    server   the OpenAI server that `launch` runs
    profile  a profile's own notes (no layer acts on them)

A name given to a layer that does not list it is an error naming the setting, never dropped.
Torch-free: the planner, the runtime and launch all import it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from decimal import Decimal
from typing import Any, Literal, Union

from shardserve.planner.errors import PlanError
from shardserve.planner.served import QUANTIZATION_FORMATS

INPUT, PLAN, ENGINE, SERVER, PROFILE = "input", "plan", "engine", "server", "profile"
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192  # at least max_num_seqs (see resolved_max_num_batched_tokens)
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3  # the KV pool per rank on CPU when none is given
DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN = 1024, 256  # the traffic a plan is for when none is given
# vLLM's human-readable counts: a lowercase suffix is decimal, an uppercase one binary (32k = 32000, 32K = 32768)
_MULTIPLIERS = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_COUNT = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)")


class SettingError(PlanError, ValueError):
    """A setting with a bad name or value; a ValueError for the Python API, exit 1 for the CLI."""


@dataclass(frozen=True)
class Setting:
    name: str
    type: type  # int, float, bool, str, dict (str -> str), tuple (of ints) or list (of strings)
    default: Any
    help: str
    layers: frozenset[str]
    choices: tuple | None = None
    minimum: float | None = None  # inclusive
    maximum: float | None = None  # inclusive
    above: float | None = None  # exclusive lower bound
    short: str | None = None  # a short flag, such as -tp
    in_profile: bool = True  # False: a Python-API-only setting (meaningless for a server)
    words: tuple[str, ...] = ()  # strings accepted besides `type`, such as max_model_len's "auto"
    human_readable: bool = False  # an int also written 32k (x1000) or 32K (x1024), as vLLM reads it
    fixed: str | None = None  # why only the default is taken (a vLLM flag whose other value the runtime lacks)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check(self, value: Any) -> Any:
        """The value, converted where lossless (an int for a float, a list for a tuple), or a
        SettingError naming this setting."""
        if value is None:
            if self.default is not None:
                raise SettingError(f"{self.name} cannot be empty (default {self.default!r})")
            return None
        if value in self.words:
            return value
        if self.human_readable and isinstance(value, str):
            value = self._parse_count(value)
        value = self._check_type(value)
        if self.fixed is not None and value != self.default:
            raise SettingError(f"{self.name}={value!r} is not served: {self.fixed}")
        if self.choices is not None and value not in self.choices:
            raise SettingError(f"{self.name}={value!r} must be one of {', '.join(map(str, self.choices))}")
        if self.minimum is not None and value < self.minimum:
            raise SettingError(f"{self.name}={value!r} must be at least {self.minimum:g}")
        if self.maximum is not None and value > self.maximum:
            raise SettingError(f"{self.name}={value!r} must be at most {self.maximum:g}")
        if self.above is not None and value <= self.above:
            raise SettingError(f"{self.name}={value!r} must be above {self.above:g}")
        return value

    def _parse_count(self, text: str) -> int:
        """'2048', '32k' (32,000), '1.5m' (1,500,000), '128K' (131,072) or '1M' (1,048,576)."""
        match = _COUNT.fullmatch(text.strip())
        words = "".join(f" or {w!r}" for w in self.words)
        if match is None:
            raise SettingError(f"{self.name}={text!r} must be a whole number (2048, 32k = 32,000 or "
                               f"32K = 32,768){words}")
        number, suffix = match.groups()
        if suffix.isupper() and "." in number:
            raise SettingError(f"{self.name}={text!r}: a binary suffix ({suffix} = {_MULTIPLIERS[suffix]:,}) "
                               f"takes a whole number; did you mean {number}{suffix.lower()}?")
        count = Decimal(number) * _MULTIPLIERS.get(suffix, 1)
        if count != int(count):
            raise SettingError(f"{self.name}={text!r} is {count}, not a whole number")
        return int(count)

    def _check_type(self, value: Any) -> Any:
        kind = self.type
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if kind is tuple and isinstance(value, (list, tuple)) and all(
                isinstance(v, int) and not isinstance(v, bool) for v in value):
            return tuple(value)
        if kind is list and isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return list(value)
        if kind is dict and isinstance(value, dict):
            return {str(k): str(v) for k, v in value.items()}
        if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
            return value
        kinds: dict[type, str] = {tuple: "a list of integers", list: "a list of strings", dict: "a mapping"}
        wanted = kinds.get(kind, kind.__name__)
        raise SettingError(f"{self.name}={value!r} must be {wanted}" + "".join(f" or {w!r}" for w in self.words))

    @property
    def annotation(self) -> Any:
        """The Python type of a value: `type`, or `type` or one of `words`."""
        return Union[self.type, Literal[self.words]] if self.words else self.type


def _s(name, type_, default, help_, layers, **kw) -> Setting:
    return Setting(name, type_, default, help_, frozenset(layers.split()), **kw)


SETTINGS: tuple[Setting, ...] = (
    _s("model", str, None, "A model folder, a Hugging Face Hub id (org/name, or a bare name such as gpt2: `plan` reads its config.json and "
       "safetensors headers, `launch` downloads its safetensors weights when the cache lacks them), or a catalog "
       "id; shardserve-demo is the bundled demo (bare `launch` serves it: --profile demo).",
       "input engine", short="-m"),
    _s("download_dir", str, None, "The Hugging Face cache folder to find models in and download them into "
       "(default: $HF_HUB_CACHE, else $HF_HOME/hub).", "input engine"),
    _s("revision", str, None, "The branch, tag or commit of a Hub id to plan and download (default: main).",
       "input engine"),
    _s("hf_token", str, None, "Token for gated and private Hub repos (default: $HF_TOKEN, else the one "
       "`hf auth login` saved).", "input engine"),
    _s("hardware", str, None, "Declared hardware: [NODESx]GPUSxNAME (8xH100-80GB, 2x8xH100, 3xL4), "
       "'cpu', or a YAML file. Default: the Ray cluster, else the GPUs NVML sees.", "input"),
    _s("device", str, "auto", "auto, cpu, cuda or cuda:N (the first GPU of this engine's ranks).",
       "engine"),
    _s("tensor_parallel_size", int, None, "Ranks per stage; pins the planner's choice "
       "(LLM(...): 1).", "plan engine", minimum=1, short="-tp"),
    _s("pipeline_parallel_size", int, None, "Pipeline stages; pins the planner's choice "
       "(LLM(...): 1).", "plan engine", minimum=1, short="-pp"),
    _s("data_parallel_size", int, None, "Replicas behind the one server; pins the planner's "
       "choice.", "plan server", minimum=1, short="-dp"),
    _s("routing_policy", str, "cache_aware", "How the server picks a replica (data_parallel_size > 1): "
       "cache_aware (the replica holding the longest cached prefix of the prompt, or the conversation's "
       "replica by the x-session-id header or the user field, unless it has more than max(4, the least "
       "loaded's) prompts above the least-loaded replica) or least_loaded.", "server",
       choices=("cache_aware", "least_loaded")),
    _s("distributed_executor_backend", str, None, "mp (local processes), ray, or uni (one rank "
       "in-process). Default: the planner's rule.", "plan engine", choices=("mp", "ray", "uni")),
    _s("enable_expert_parallel", bool, None, "Mixture-of-experts models: whole experts on each rank of "
       "the tensor-parallel group (num_experts divided over tensor_parallel_size) instead of every expert "
       "split; attention stays tensor parallel. Default: the planner's choice (LLM(...): off).",
       "plan engine"),
    _s("layer_split", tuple, None, "Layers per pipeline stage, such as [20, 12] (a plan's "
       "choice; default: balanced by weight bytes).", "engine"),
    _s("max_model_len", int, None, "Longest prompt plus output, in tokens, or auto: the longest whose "
       "requests fit the KV cache (at most the model's). Default: the model's.", "plan engine", minimum=1,
       words=("auto",), human_readable=True),
    _s("dtype", str, "auto", "auto (bf16 where the GPU has it, else fp16; the checkpoint's "
       "dtype, float32 on CPU), bfloat16, float16 or float32.", "plan engine"),
    _s("quantization", str, None, "The checkpoint's weight format: " + ", ".join(QUANTIZATION_FORMATS)
       + " (default: config.json's quantization_config).", "plan engine", choices=QUANTIZATION_FORMATS),
    _s("load_format", str, "auto", "How the weights are loaded: auto or safetensors (the checkpoint's "
       "safetensors files), or dummy: random weights of the checkpoint's shapes, nothing read but config.json "
       "and the tokenizer (vLLM's mode for benchmarking speed and memory; the text is noise).", "engine",
       choices=("auto", "safetensors", "dummy")),
    _s("kv_cache_dtype", str, "auto", "auto (the model's dtype), fp8 (= fp8_e4m3) or fp8_e5m2: half the "
       "bytes of bf16 per KV token.", "plan engine", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2")),
    _s("gpu_memory_utilization", float, 0.9, "Fraction of each GPU's memory for weights, "
       "activations and the KV cache.", "plan engine", above=0.0, maximum=1.0),
    _s("kv_cache_memory_bytes", int, None, "The KV pool per rank in bytes (default on CPU: "
       f"{DEFAULT_CPU_KV_CACHE_BYTES >> 30} GiB; on GPU: what gpu_memory_utilization leaves).",
       "plan engine", minimum=1, human_readable=True),
    _s("block_size", int, 16, "Tokens per KV cache block.", "plan engine",
       choices=(1, 2, 4, 8, 16, 32, 64, 128)),
    _s("max_num_seqs", int, 256, "Most requests in one batch.", "plan engine server", minimum=1),
    _s("max_num_batched_tokens", int, None, "Most tokens in one step (default: "
       f"{DEFAULT_MAX_NUM_BATCHED_TOKENS}, or max_num_seqs if larger).", "plan engine", minimum=1,
       human_readable=True),
    _s("enable_chunked_prefill", bool, True, "Prefill long prompts in chunks of the step's token budget "
       "(max_num_batched_tokens), beside running decodes; always on here.", "engine",
       fixed="the scheduler always chunks prefills (one token budget for prefill and decode, as vLLM V1 "
       "schedules); to prefill a long prompt in one step, raise --max-num-batched-tokens to max_model_len"),
    _s("enable_prefix_caching", bool, None, "Reuse the KV blocks of shared prompt prefixes. Default: on, except "
       "for models with recurrent (linear-attention) layers, whose state is one per request, not per block.",
       "plan engine"),
    _s("kv_offloading_size", float, None, "GiB of host memory per replica (summed over its ranks, as vLLM "
       "counts it) for a CPU tier of the prefix cache: full blocks evicted from the GPU pool are kept there, "
       "and a later prompt with that prefix loads them back instead of computing them again. Default: no tier.",
       "plan engine", above=0.0),
    _s("enable_lora", bool, False, "Serve LoRA adapters (PEFT checkpoints) beside the base model: a request names "
       "one in its model field, and requests for different adapters share a batch. The plan counts max_loras "
       "adapter slots of max_lora_rank on every rank before the KV cache; decode runs without CUDA graphs.",
       "plan engine"),
    _s("max_loras", int, 1, "Most adapters in one batch (the adapter slots each rank keeps on the GPU).",
       "plan engine", minimum=1),
    _s("max_lora_rank", int, 16, "Largest adapter rank served (each slot's size); a larger adapter is refused.",
       "plan engine", choices=(1, 8, 16, 32, 64, 128, 256, 320, 512)),
    _s("max_cpu_loras", int, None, "Adapters each rank keeps in host memory, ready for a slot without reading "
       "their files again (default: max_loras; at least max_loras).", "engine", minimum=1),
    _s("lora_modules", list, None, "Adapters served from the start, as name=path (a PEFT folder with "
       "adapter_config.json and adapter_model.safetensors); each is checked against the model before anything "
       "loads.", "server"),
    _s("enable_runtime_lora_updating", bool, False, "Serve POST /v1/load_lora_adapter and "
       "/v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): any client may then add adapters "
       "from paths on this machine.", "server"),
    _s("enforce_eager", bool, False, "No CUDA graphs: every decode step runs eagerly (the plan then reserves "
       "no graph memory).", "plan engine"),
    _s("async_scheduling", bool, False, "Overlap the host with the device: step N+1 is scheduled and "
       "queued while step N runs, its input ids taken on the device from step N's samples, and outputs "
       "arrive one step late. One rank in-process only (no tensor or pipeline parallel); requests with "
       "structured outputs, prompt_logprobs or penalties are refused while it is on.", "engine"),
    _s("speculative_config", str, None, "Speculative decoding, vLLM's JSON: {\"method\": \"ngram\", "
       "\"num_speculative_tokens\": K, \"prompt_lookup_max\": N, \"prompt_lookup_min\": M} drafts up to K tokens "
       "by prompt lookup; {\"method\": \"draft_model\", \"model\": FOLDER, \"num_speculative_tokens\": K} has a "
       "smaller model of the same vocabulary draft them; {\"method\": \"eagle3\", \"model\": FOLDER, ...} an EAGLE-3 "
       "head, from the model's own hidden states; {\"method\": \"mtp\", ...} the model's own MTP layer (DeepSeek-V3, Qwen3.5, Qwen3-Next). The "
       "model verifies a request's drafts in one forward (greedy and seeded output unchanged); the plan prices it "
       "at --draft-acceptance-rate. Refused with async_scheduling.", "plan engine"),
    _s("seed", int, 0, "Seed for requests that bring none.", "engine"),
    _s("chat_template", str, None, "A Jinja chat template, or the path of a file holding one, used instead of "
       "the tokenizer's.", "engine"),
    _s("generation_config", str, "auto", "Sampling defaults for requests that set none: auto (the model's "
       "generation_config.json), vllm (none), or a folder holding a generation_config.json.", "engine"),
    _s("runner", str, "auto", "generate: sample text; pooling: an embedding model, serving /v1/embeddings "
       "(each prompt's final hidden states pooled into one vector; no LM head, no generation). auto: generate "
       "(every architecture served here is a causal LM).", "engine", choices=("auto", "generate", "pooling")),
    _s("pooling_type", str, None, "How runner pooling pools a prompt (vLLM's --pooler-config pooling_type): LAST "
       "token, MEAN over the prompt, or CLS (the first token). Default: the checkpoint's sentence-transformers "
       "1_Pooling/config.json, else LAST.", "engine", choices=("LAST", "MEAN", "CLS")),
    _s("normalize", bool, None, "Runner pooling: L2-normalize each embedding (vLLM's --pooler-config normalize). "
       "Default: whether the checkpoint's sentence-transformers modules.json has a Normalize module; true for a "
       "checkpoint without those files.", "engine"),
    _s("skip_tokenizer_init", bool, False, "No tokenizer: prompts are token ids, outputs carry "
       "no text.", "engine", in_profile=False),
    _s("target_concurrency", int, 1, "KV room for this many requests of max_model_len.", "plan",
       minimum=1),
    _s("input_len", int, None, "Mean prompt tokens of the traffic the plan is for (default: "
       f"{DEFAULT_INPUT_LEN}, or less when max_model_len is shorter).", "plan server", minimum=1),
    _s("output_len", int, None, f"Mean output tokens per request (default: {DEFAULT_OUTPUT_LEN}, or less "
       "when max_model_len is shorter).", "plan server", minimum=1),
    _s("prefix_len", int, 0, "Leading prompt tokens every request shares (a system prompt), computed once "
       "and served from the prefix cache.", "plan server", minimum=0),
    _s("concurrency", float, None, "Requests in flight across the deployment, each sent when one finishes "
       "(closed loop; not with --request-rate). Default: full batches.", "plan server", above=0.0),
    _s("request_rate", float, None, "Requests per second arriving across the deployment (Poisson; not "
       "with --concurrency).", "plan server", above=0.0),
    _s("draft_acceptance_rate", float, None, "With --speculative-config: the chance the model keeps a drafted "
       "token once it kept the drafts before it, so a verify step of K drafts yields 1 + a + ... + a^K tokens "
       "(vLLM's acceptance at position 0 estimates it). Default: ngram 0.70, vLLM's measurement on code edits "
       "(chat traffic accepts far fewer); draft_model none, it depends on the pair of models.", "plan",
       above=0.0, maximum=0.99),
    _s("ttft_ms", float, None, "Target time to first token in milliseconds, at --target-percentile: the "
       "plan picks the fewest GPUs that meet the targets.", "plan server", above=0.0),
    _s("tpot_ms", float, None, "Target time per output token (after the first) in milliseconds, at "
       "--target-percentile.", "plan server", above=0.0),
    _s("target_percentile", int, 50, "The percentile the latency targets and estimates are stated at.",
       "plan server", choices=(50, 90, 95, 99)),
    _s("host", str, "127.0.0.1", "Address to listen on (default: this machine only).", "server"),
    _s("port", int, 8000, "Port to listen on.", "server", minimum=0, maximum=65535),
    _s("served_model_name", str, None, "The model name clients use (default: shardserve-demo for the "
       "bundled demo model, however given; else --model).", "server"),
    _s("max_queued_requests", int, None, "Requests in flight before the server answers 503 "
       "(default: 4 x max_num_seqs per replica).", "server", minimum=1),
    _s("queue_timeout", float, 60.0, "Seconds a request may wait for room on the engines while its client "
       "has nothing running there (one client holds at most 15/16 of the sequences the replicas run at once, "
       "so another's request finds room at once; waiting requests are served client by client); then it is "
       "answered 503 with Retry-After.",
       "server", above=0),
    _s("shutdown_timeout", float, 10.0, "Seconds that SIGTERM or Ctrl-C gives in-flight requests to finish "
       "while new ones get 503; then streams still running end with an error event and [DONE], other "
       "requests with a 503. 0 ends them at once; a second signal cuts the wait short.", "server", minimum=0),
    _s("max_request_body_bytes", int, 16 << 20, "Largest request body the server reads; a larger one is "
       "answered 413 before it is parsed (16 MiB: a million-token prompt as text or token ids).", "server",
       minimum=1),
    _s("record_trace", str, None, "Write the traffic served to this file as a trace for `plan --trace` (JSON lines: "
       "arrival_s, input_len, output_len, and prefix_id + prefix_len where the prefix cache served part of a "
       "prompt; never text). The file must not exist yet.", "server"),
    _s("request_read_timeout", float, 30.0, "Seconds a client may take to send a request's headers, and the "
       "longest pause between pieces of its body (then the connection is closed, or answered 408): a client "
       "that stalls does not hold a connection and its file descriptor.", "server", above=0),
    _s("grammar_compile_timeout", float, 10.0, "Seconds a request's grammar (response_format, guided_*, "
       "tool_choice required or named) may take to compile before the request is refused with a 400. It is "
       "compiled in the replica's process, off its step loop, so other requests go on meanwhile; the time "
       "counts from the start of its own compile.", "server", above=0),
    _s("trust_request_chat_template", bool, False, "Let a request bring its own chat template (chat_template, "
       "or chat_template_kwargs.chat_template), as vLLM's flag does; without it such a request gets a 400. "
       "A template is code the server runs: trust only clients you would let start the server.", "server"),
    _s("tool_call_parser", str, None, "How tool calls are found in free text for tool_choice auto: hermes "
       "(<tool_call> blocks; Qwen, Hermes), llama3_json, or openai (gpt-oss's commentary messages to "
       "functions.NAME; needs --reasoning-parser openai_gptoss).", "server",
       choices=("hermes", "llama3_json", "openai")),
    _s("reasoning_parser", str, None, "Split a reasoning model's chat output into message.reasoning (also "
       "reasoning_content) and content: deepseek_r1 (DeepSeek-R1, QwQ: the output starts inside <think>), qwen3 "
       "(reasoning when the output or the prompt opens <think>) or openai_gptoss (gpt-oss's harmony channels: "
       "analysis is reasoning, final is content). Structured outputs apply after the reasoning when the output "
       "starts inside it.", "server", choices=("deepseek_r1", "qwen3", "openai_gptoss")),
    _s("enable_auto_tool_choice", bool, False, "Serve tool_choice auto (needs --tool-call-parser).", "server"),
    _s("max_logprobs", int, 20, "Most log-probabilities a request may ask for per token (logprobs, top_logprobs, "
       "prompt_logprobs); a request asking for more gets a 400. A request's -1 asks for the whole vocabulary, "
       "so it needs this at least the vocabulary size, or -1 (no limit), as vLLM.", "server", minimum=-1),
    _s("return_tokens_as_token_ids", bool, False, "Write logprob tokens as 'token_id:N' unless a request's "
       "return_tokens_as_token_ids says otherwise (for tokens whose text is not valid UTF-8 alone).", "server"),
    _s("enable_force_include_usage", bool, False, "Usage in every response and stream, as if each request had "
       "set stream_options.include_usage.", "server"),
    _s("enable_prompt_tokens_details", bool, False, "usage.prompt_tokens_details.cached_tokens: the prompt "
       "tokens the prefix cache served.", "server"),
    _s("enable_tokenizer_info_endpoint", bool, False, "Serve /tokenizer_info (the tokenizer's configuration, "
       "chat template included), as vLLM's flag does.", "server"),
    _s("enable_server_load_tracking", bool, False, "Serve GET /load: server_load, the API requests in flight "
       "(vLLM's load metric, read by load-aware routers).", "server"),
    _s("root_path", str, None, "The path prefix a proxy serves this server under (FastAPI's root_path), such as "
       "/llm: the API docs link through it.", "server"),
    _s("allowed_origins", list, None, "Origins a browser may call the API from (CORS), such as "
       "https://app.example; '*' for any. Default: none (no CORS headers).", "server"),
    _s("env", dict, None, "Variables set for the engine and every rank, on every node.", "server"),
    _s("description", str, None, "What the profile is for.", "profile"),
)
BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def names(layer: str) -> tuple[str, ...]:
    return tuple(s.name for s in SETTINGS if layer in s.layers)


def profile_names() -> tuple[str, ...]:
    return tuple(s.name for s in SETTINGS if s.in_profile)


def check_names(values: dict, layer: str, where: str) -> None:
    """Refuse names the table lacks, and names it has that `layer` does not act on."""
    for name in values:
        setting = BY_NAME.get(name)
        if setting is None:
            raise SettingError(f"{where}: unknown setting {name!r}")
        if layer not in setting.layers:
            users = ", ".join(sorted(setting.layers))
            raise SettingError(f"{where}: {name} is not used here (it is a setting of: {users})")


def check_fields(record) -> None:
    """Check every field of a settings dataclass against the table (for its __post_init__);
    fields the table converts (an int for a float, a list for a tuple) are written back."""
    for f in fields(record):
        value = getattr(record, f.name)
        checked = BY_NAME[f.name].check(value)
        if checked is not value:
            object.__setattr__(record, f.name, checked)


def default(name: str) -> Any:
    """The table's default of a setting, for the settings classes' fields."""
    return BY_NAME[name].default


def for_layer(values: dict, layer: str) -> dict:
    """The entries of `values` (setting names) that `layer` acts on."""
    return {k: v for k, v in values.items() if k in BY_NAME and layer in BY_NAME[k].layers}


def resolved_max_num_batched_tokens(max_num_batched_tokens: int | None, max_num_seqs: int) -> int:
    """The step's token budget: as given, else the default raised to max_num_seqs."""
    if max_num_batched_tokens is None:
        return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_num_seqs)
    if max_num_batched_tokens < max_num_seqs:
        raise SettingError(f"max_num_batched_tokens {max_num_batched_tokens} is below max_num_seqs "
                           f"{max_num_seqs}: raise it or lower --max-num-seqs")
    return max_num_batched_tokens
