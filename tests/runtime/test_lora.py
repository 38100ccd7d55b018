"""LoRA adapters in the engine: each request's greedy tokens equal transformers' with its PEFT adapter merged,
with different adapters and the base model in one batch, at tp 1, tp 2 and pp 2; fewer slots than adapters;
the prefix cache kept apart per adapter; and the refusals."""

from __future__ import annotations

import json
import os

import pytest

from lora_adapters import ALL_MODULES, save_adapter
from shardserve.planner.lora import AdapterError, slot_bytes
from shardserve.planner.model_spec import ModelSpec
from shardserve.planner.settings import SettingError
from shardserve.runtime import LLM, SamplingParams
from shardserve.runtime.lora_request import LoRARequest
from shardserve.runtime.core.lora_slots import LoRASlots
from test_runtime_matches_transformers import random_prompts, reference

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
PROMPTS = random_prompts(5, [9, 13, 7, 11, 10])


@pytest.fixture(scope="module")
def adapters(checkpoint_factory, tmp_path_factory):
    """The base folder, two adapters (every module at rank 8; q and v at rank 16 with rsLoRA) and each
    prompt's expected tokens under [a1, a2, base, a1, a2]."""
    folder, hf_model = checkpoint_factory("llama3")
    root = tmp_path_factory.mktemp("lora")
    merged_1 = save_adapter(str(root / "a1"), hf_model, 1, 8, ALL_MODULES)
    merged_2 = save_adapter(str(root / "a2"), hf_model, 2, 16, ["q_proj", "v_proj"], use_rslora=True)
    loras = [LoRARequest("a1", 1, str(root / "a1")), LoRARequest("a2", 2, str(root / "a2"))]
    models = [merged_1, merged_2, hf_model, merged_1, merged_2]
    expected = [reference(model, [prompt], GREEDY.max_tokens)[0] for model, prompt in zip(models, PROMPTS)]
    base = reference(hf_model, PROMPTS, GREEDY.max_tokens)
    assert [e != b for e, b in zip(expected, base)] == [True, True, False, True, True]  # the adapters change tokens
    return folder, loras, expected, root


def generate(llm: LLM, loras) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, lora_request=loras)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("layout", [pytest.param({}, id="tp1"),  # ranks in processes: slow
                                    pytest.param({"tensor_parallel_size": 2}, id="tp2", marks=pytest.mark.slow),
                                    pytest.param({"pipeline_parallel_size": 2}, id="pp2", marks=pytest.mark.slow)])
def test_mixed_adapters_in_one_batch_match_transformers(layout, adapters):
    folder, (a1, a2), expected, _ = adapters
    parallel = {**layout, "distributed_executor_backend": "mp"} if layout else {}
    with LLM(folder, device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16, **parallel) as llm:
        assert generate(llm, [a1, a2, None, a1, a2]) == expected


def test_one_slot_serves_two_adapters_in_turn(adapters):
    """max_loras=1 and max_cpu_loras=1: requests of the other adapter wait for the slot, and each swap reads
    the adapter again; the base model's requests never wait."""
    folder, (a1, a2), expected, _ = adapters
    with LLM(folder, device="cpu", enable_lora=True, max_loras=1, max_lora_rank=16, max_cpu_loras=1) as llm:
        assert generate(llm, [a1, a2, None, a1, a2]) == expected
        slots = llm.engine.scheduler.lora_slots
        assert slots is not None and slots.users == [0] and slots.adapters[0] in (a1, a2)


def test_an_adapter_does_not_reuse_the_base_models_cached_prefix(adapters):
    folder, (a1, _), expected, _ = adapters
    with LLM(folder, device="cpu", enable_lora=True, block_size=4) as llm:
        base = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)[0]
        adapted = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, lora_request=a1)[0]
        again = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, lora_request=a1)[0]
    assert list(adapted.outputs[0].token_ids) == list(again.outputs[0].token_ids) == expected[0]
    assert adapted.num_cached_tokens == 0 and again.num_cached_tokens == 8  # its own blocks, not the base's
    assert list(base.outputs[0].token_ids) != expected[0]


def test_the_slots_take_the_bytes_the_plan_counts(adapters):
    folder, _, _, _ = adapters
    with LLM(folder, device="cpu", enable_lora=True, max_loras=3, max_lora_rank=8) as llm:
        slots = llm.engine.executor.worker.adapters.slots.values()
        allocated = sum(w.a.nbytes + w.b.nbytes for w in slots)
        model = llm.engine.config.model
    spec = ModelSpec.from_config("llama3", model.hf_config.to_dict())
    assert allocated == 3 * slot_bytes(spec, 1, spec.num_layers, 8, 4) > 0


def test_slots_go_to_the_least_recently_used_free_slot():
    a, b, c = (LoRARequest(n, i, "/x") for i, n in enumerate("abc", 1))
    slots = LoRASlots(2)
    assert slots.take(a) == 0 and slots.take(b) == 1 and slots.take(a) == 0
    assert not slots.can_take(c)  # both slots have running requests
    slots.release(1)
    slots.release(0)
    assert slots.can_take(c) and slots.users == [1, 0]
    assert slots.take(c) == 1 and slots.loads == [(0, a), (1, b), (1, c)]
    slots.check_integrity([0, 1])


def test_adapters_that_do_not_fit_are_refused_before_they_run(adapters, checkpoint_factory, tmp_path):
    folder, (a1, a2), _, root = adapters
    with pytest.raises(SettingError, match="max_loras applies with enable_lora"):
        LLM(folder, device="cpu", max_loras=2)
    with pytest.raises(SettingError, match="max_cpu_loras=1 is below max_loras=2"):
        LLM(folder, device="cpu", enable_lora=True, max_loras=2, max_cpu_loras=1)
    with LLM(folder, device="cpu") as llm:
        with pytest.raises(AdapterError, match="start it with enable_lora=True"):
            llm.generate([PROMPTS[0]], GREEDY, lora_request=a1)
    moe_folder, _ = checkpoint_factory("mixtral")
    with pytest.raises(SettingError, match="MixtralForCausalLM is not served with LoRA adapters"):
        LLM(moe_folder, device="cpu", enable_lora=True)
    _, other_model = checkpoint_factory("qwen3")  # 24-wide heads: its q_proj is [96, 64], llama3's [64, 64]
    save_adapter(str(tmp_path / "other"), other_model, 3, 8, ["q_proj"])
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"r": 8, "use_dora": True}))
    (broken / "adapter_model.safetensors").write_bytes(open(os.path.join(root, "a1", "adapter_model.safetensors"),
                                                            "rb").read())
    with LLM(folder, device="cpu", enable_lora=True, max_lora_rank=8) as llm:
        cases = [(a2, "rank 16, above max_lora_rank=8"), (LoRARequest("o", 3, str(tmp_path / "other")),
                                                           "does not fit"),
                 (LoRARequest("b", 4, str(broken)), "use_dora is set, which is not served"),
                 (LoRARequest("m", 5, str(tmp_path)), "not a PEFT adapter folder")]
        for lora, words in cases:
            with pytest.raises(AdapterError, match=words):
                llm.generate([PROMPTS[0]], GREEDY, lora_request=lora)
        assert not llm.engine.has_unfinished_requests()
