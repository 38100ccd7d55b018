"""The offline Python API (vLLM's): LLM(...).generate(prompts, sampling_params), .chat(...) and .embed(...)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

from shardserve.runtime.config import KVCacheInfo
from shardserve.runtime.core.engine import EngineCore
from shardserve.runtime.engine_args import EngineArgs
from shardserve.runtime.input_processor import ProcessedPrompt, PromptType
from shardserve.runtime.lora_request import LoRARequest
from shardserve.runtime.output_processor import OutputProcessor
from shardserve.runtime.outputs import (EmbeddingRequestOutput, PromptDelta, RequestOutput, RequestOutputBuilder,
                                       embedding_output)
from shardserve.runtime.pooling_params import PoolingParams
from shardserve.runtime.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **kwargs):
        """`model`: a folder, or a Hub id (org/name) served from the Hugging Face cache, downloaded as `launch`
        downloads it when the cache lacks it (download_dir, revision, hf_token say where and how).
        kwargs: any setting of the engine layer in planner/settings.py (vLLM's names: dtype,
        max_model_len, tensor_parallel_size, ...); any other name is refused by name."""
        args = EngineArgs.from_kwargs(model, kwargs, "LLM(...)")
        self.engine_args = args
        self.engine = EngineCore(args.create_engine_config())
        self.output_processor = OutputProcessor(self.engine.tokenizer)  # (the core's: one process)
        self.failed_prompts: dict[str, BaseException] = {}  # prompt id -> why a step failed it; the caller pops
        self._next_id = 0

    @property
    def kv_cache_info(self) -> KVCacheInfo:
        return self.engine.kv_cache_info

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a prompt gets without SamplingParams: the model's generation_config.json defaults."""
        return self.engine.default_sampling_params()

    def generate(self, prompts: str | dict | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. One prompt of token ids
        goes in a list ([ids]) or as {"prompt_token_ids": ids}. lora_request: one adapter for every prompt,
        or one per prompt (None: the base model), as vLLM's."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        processor = self.engine.input_processor
        return self._run([processor.process(p, sp) for p, sp in zip(prompts, params)], params, loras)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate."""
        conversations = cast("list[list[dict]]", [messages] if messages and isinstance(messages[0], dict) else messages)
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        processor = self.engine.input_processor
        prompts = [processor.process_chat(c, params, add_generation_prompt) for c in conversations]
        return self._run(prompts, [params] * len(prompts))

    def embed(self, prompts: str | dict | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (vLLM's LLM.embed), in input order: the prompt's final hidden states
        pooled as its PoolingParams ask (unset fields: the engine's, from --pooling-type and --normalize or
        the checkpoint's sentence-transformers files). Needs runner='pooling'."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = pooling_params if pooling_params is not None else PoolingParams()
        if isinstance(params, PoolingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} pooling params for {len(prompts)} prompts")
        processed = [self.engine.input_processor.process(p, pp) for p, pp in zip(prompts, params)]
        prompt_ids = self._queue(processed, params)
        last: dict[str, PromptDelta] = {}
        self._step_until_done(prompt_ids, lambda delta: last.__setitem__(delta.prompt_id, delta))
        return [embedding_output(i, prompt, last[i]) for i, prompt in zip(prompt_ids, processed)]

    # ---- the in-process client of the engine core: prompts in, token updates back as text ----------
    def add_request(self, prompt_id: str, prompt: PromptType | ProcessedPrompt, params: SamplingParams | PoolingParams,
                    lora_request: LoRARequest | None = None) -> None:
        """Hand the core a prompt (processed here, with the core's rules, if it is not yet); its deltas come
        from step()."""
        self.engine.add_request(prompt_id, prompt, params, lora_request)
        self.output_processor.add_prompt(prompt_id, params)

    def abort_request(self, prompt_id: str) -> None:
        self.engine.abort_request(prompt_id)
        self.output_processor.abort(prompt_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> list[PromptDelta]:
        """One step of the core, its token updates as deltas; a sample a stop string ended is stopped in the
        core before its next step (with batches in flight, its later tokens are dropped here). A prompt the
        step failed (its adapter's weights could not be read) has no more deltas: its error is put in
        failed_prompts, and the other prompts run on."""
        deltas, stopped = self.output_processor.process(self.engine.step())
        self.engine.stop_requests(stopped)
        for failed in self.engine.take_failed_prompts():
            self.output_processor.abort(failed.prompt_id)
            self.failed_prompts[failed.prompt_id] = failed.error
        return deltas

    def shutdown(self) -> None:
        """Stop the workers (other processes, with tensor or pipeline parallelism)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _run(self, prompts: list[ProcessedPrompt], params: Sequence[SamplingParams],
             loras: Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Queue every prompt, step until all finish, assemble their deltas."""
        prompt_ids = self._queue(prompts, params, loras)
        builders = {i: RequestOutputBuilder(i, prompt, prompt_params)
                    for i, prompt, prompt_params in zip(prompt_ids, prompts, params)}
        self._step_until_done(prompt_ids, lambda delta: builders[delta.prompt_id].add(delta))
        return [builder.build() for builder in builders.values()]

    def _queue(self, prompts: list[ProcessedPrompt], params: Sequence[SamplingParams | PoolingParams],
               loras: Sequence[LoRARequest | None] | None = None) -> list[str]:
        """Add every prompt to the engine (one refused: none); their ids, in order."""
        prompt_ids: list[str] = []
        try:
            for prompt, prompt_params, lora in zip(prompts, params, loras or [None] * len(prompts)):
                prompt_id = str(self._next_id)
                self._next_id += 1
                self.add_request(prompt_id, prompt, prompt_params, lora)
                prompt_ids.append(prompt_id)
        except Exception:
            for prompt_id in prompt_ids:
                self.abort_request(prompt_id)
            raise
        return prompt_ids

    def _step_until_done(self, prompt_ids: list[str], take: Callable[[PromptDelta], None]) -> None:
        """Step until nothing is left; the deltas of these prompts go to `take`. One of them failed: the
        others are aborted and its error raised (as for a prompt refused when it was added)."""
        queued = set(prompt_ids)
        while self.has_unfinished_requests():
            for delta in self.step():
                if delta.prompt_id in queued:
                    take(delta)
            errors = [self.failed_prompts.pop(i) for i in prompt_ids if i in self.failed_prompts]
            if errors:
                for prompt_id in prompt_ids:
                    self.abort_request(prompt_id)
                raise errors[0]
