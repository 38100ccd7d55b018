"""The offline Python API (vLLM's): LLM(...).generate(prompts, sampling_params) and .chat(...)."""

from __future__ import annotations

from collections.abc import Sequence

from shardserve.runtime.config import KVCacheInfo
from shardserve.runtime.engine import LLMEngine
from shardserve.runtime.engine_args import EngineArgs
from shardserve.runtime.outputs import RequestOutput
from shardserve.runtime.sampling_params import SamplingParams

PromptType = str | dict


class LLM:
    def __init__(self, model: str, **kwargs):
        """kwargs: any setting of the engine layer in planner/settings.py (vLLM's names: dtype,
        max_model_len, tensor_parallel_size, ...); any other name is refused by name."""
        args = EngineArgs.from_kwargs(model, kwargs, "LLM(...)")
        self.engine_args = args
        self.engine = LLMEngine(args.create_engine_config())
        self._next_id = 0

    @property
    def kv_cache_info(self) -> KVCacheInfo:
        return self.engine.kv_cache_info

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, prompt_params in zip(prompts, params):
                text, token_ids = self._resolve_prompt(prompt)
                request_id = str(self._next_id)
                self._next_id += 1
                self.engine.add_request(request_id, token_ids, prompt_params, prompt=text)
                ids.append(request_id)
        except Exception:  # one bad prompt: queue none of the batch
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(ids)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat needs a tokenizer with a chat_template; use generate() with plain prompts")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids})
        return self.generate(prompts, sampling_params)

    def _resolve_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenize(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.engine.tokenize(prompt["prompt"])
        raise ValueError("a prompt is a str, {'prompt': str} or {'prompt_token_ids': [int, ...]}; "
                         f"got {type(prompt).__name__}")

    def shutdown(self) -> None:
        """Stop the workers (other processes, with tensor or pipeline parallelism)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[request_id] for request_id in request_ids]
