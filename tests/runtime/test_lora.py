"""LoRA adapters in the engine: each request's greedy tokens equal transformers' with its PEFT adapter merged,
with different adapters and the base model in one batch, at tp 1, tp 2 and pp 2; fewer slots than adapters;
the prefix cache kept apart per adapter; the refusals; and an adapter whose files change after its check
failing its own prompts alone."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from lora_adapters import ALL_MODULES, save_adapter
from shardserve.planner.lora import WEIGHTS_FILE, AdapterError, slot_bytes
from shardserve.planner.model_spec import ModelSpec
from shardserve.planner.settings import SettingError
from shardserve.runtime import LLM, AsyncEngine, SamplingParams
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


def test_drafts_are_verified_under_their_requests_adapters(adapters):
    """Speculative decoding with adapters: each draft row runs (and samples) under its request's adapter, so the
    tokens are those without speculation."""
    folder, (a1, a2), _, _ = adapters
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    runs = []
    for spec in (None, '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'):
        with LLM(folder, device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16, speculative_config=spec) as llm:
            outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, lora_request=[a1, a2, None, a1, a2])
            runs.append(([list(o.outputs[0].token_ids) for o in outputs], llm.engine.get_stats().spec_decode))
    (plain, _), (tokens, stats) = runs
    assert tokens == plain and stats.num_drafts > 0


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



def broken_copy(root: Path, tmp_path: Path, lora_int_id: int) -> tuple[LoRARequest, Path]:
    """a1's adapter in a folder of its own (read by no engine yet), and its weights file."""
    shutil.copytree(root / "a1", tmp_path / "broken")
    return LoRARequest("broken", lora_int_id, str(tmp_path / "broken")), tmp_path / "broken" / WEIGHTS_FILE


def step_until_done(llm: LLM) -> dict[str, list[int]]:
    """Each prompt's greedy tokens from LLM.step's deltas, once nothing is left."""
    tokens: dict[str, list[int]] = {}
    while llm.has_unfinished_requests():
        for delta in llm.step():
            tokens.setdefault(delta.prompt_id, []).extend(delta.samples[0].new_token_ids)
    return tokens


def check_failed(llm: LLM, prompt_id: str, tmp_path: Path) -> None:
    """The prompt failed with the adapter's name, nothing of its files; no slot or host cache keeps it."""
    error = llm.failed_prompts.pop(prompt_id)
    assert isinstance(error, ValueError) and "'broken': its weights could not be read" in str(error)
    assert str(tmp_path) not in str(error) and WEIGHTS_FILE not in str(error) and "lora_" not in str(error)
    slots = llm.engine.scheduler.lora_slots
    assert slots is not None and slots.users == [0, 0] and all(a is None or a.lora_name != "broken"
                                                               for a in slots.adapters)
    assert not llm.failed_prompts and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_an_adapter_cut_short_after_its_check_fails_its_prompt_alone(is_async, adapters, tmp_path):
    """The weights file is cut short between add_request's check and the step that loads it: that prompt fails
    with a ValueError naming the adapter, the base prompt beside it gets the tokens it gets alone, the adapter is
    checked again at its next add (refused while cut short), and once whole again it serves as before."""
    folder, (_, a2), expected, root = adapters
    broken, weights = broken_copy(root, tmp_path, 7)
    whole = weights.read_bytes()
    with LLM(folder, device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16, async_scheduling=is_async) as llm:
        alone = generate(llm, [None] * len(PROMPTS))
        llm.add_request("a", {"prompt_token_ids": PROMPTS[0]}, GREEDY, broken)
        llm.add_request("b", {"prompt_token_ids": PROMPTS[2]}, GREEDY)
        llm.add_request("c", {"prompt_token_ids": PROMPTS[1]}, GREEDY, a2)
        weights.write_bytes(whole[: len(whole) // 2])
        tokens = step_until_done(llm)
        assert not tokens.get("a") and tokens["b"] == alone[2] and tokens["c"] == expected[1]
        check_failed(llm, "a", tmp_path)
        assert 7 not in llm.engine.executor.worker.adapters.cache
        with pytest.raises(AdapterError, match="'broken'"):
            llm.generate([PROMPTS[0]], GREEDY, lora_request=broken)
        weights.write_bytes(whole)
        assert generate(llm, [broken, a2, None, broken, a2]) == expected


def test_generate_raises_for_an_adapter_removed_after_its_check(adapters, tmp_path, monkeypatch):
    """LLM.generate's prompts: one fails mid-run, the call raises its error (as for a prompt refused when it is
    added) and the engine keeps serving."""
    folder, _, expected, root = adapters
    broken, weights = broken_copy(root, tmp_path, 7)
    with LLM(folder, device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16) as llm:
        check = llm.engine.adapter_checks.check

        def check_then_remove(lora: LoRARequest | None) -> None:
            check(lora)
            if lora == broken:
                weights.unlink()

        monkeypatch.setattr(llm.engine.adapter_checks, "check", check_then_remove)
        with pytest.raises(AdapterError, match="'broken': its weights could not be read"):
            llm.generate([PROMPTS[0], PROMPTS[2]], GREEDY, lora_request=[broken, None])
        assert not llm.engine.has_unfinished_requests() and not llm.failed_prompts
        assert generate(llm, [None, None, None, None, None])[2] == expected[2]


def test_an_async_stream_ends_with_its_adapters_error_and_the_others_run_on(adapters, tmp_path, monkeypatch):
    """Through the core's loop: the prompt's stream raises the ValueError (PromptFailed), the base stream beside
    it ends as it would alone, and the engine serves the next prompt."""
    folder, _, expected, root = adapters
    broken, weights = broken_copy(root, tmp_path, 7)
    whole = weights.read_bytes()

    async def tokens(engine: AsyncEngine, prompt_id: str, prompt: list[int], lora: LoRARequest | None) -> list[int]:
        ids: list[int] = []
        async for delta in engine.generate({"prompt_token_ids": prompt}, GREEDY, prompt_id, lora):
            ids.extend(delta.samples[0].new_token_ids)
        return ids

    async def main() -> tuple[list, list[int], BaseException | None]:
        engine = AsyncEngine(folder, device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16)
        check = engine.engine.adapter_checks.check

        def check_then_cut(lora: LoRARequest | None) -> None:
            check(lora)
            if lora == broken:
                weights.write_bytes(whole[: len(whole) // 2])

        monkeypatch.setattr(engine.engine.adapter_checks, "check", check_then_cut)
        try:
            both = await asyncio.gather(tokens(engine, "a", PROMPTS[0], broken), tokens(engine, "b", PROMPTS[2], None),
                                        return_exceptions=True)
            return both, await tokens(engine, "c", PROMPTS[2], None), engine.error
        finally:
            await engine.shutdown()

    (failed, base), after, engine_error = asyncio.run(main())
    assert isinstance(failed, AdapterError) and "'broken': its weights could not be read" in str(failed)
    assert str(tmp_path) not in str(failed)
    assert base == after == expected[2] and engine_error is None


@pytest.mark.slow
def test_an_adapter_only_the_first_stage_cannot_read_fails_its_prompt_on_every_stage(adapters, tmp_path):
    """pp 2 in processes: the file changes so that only stage 0's layer cannot be read (a B with too few rows);
    the ranks agree, the output rank (stage 1, which read it) reports it, and the base prompt beside it runs on."""
    folder, _, _, root = adapters
    broken, weights = broken_copy(root, tmp_path, 7)
    tensors = load_file(weights)
    stage_0 = next(name for name in tensors if ".layers.0." in name and name.endswith("lora_B.weight"))
    tensors[stage_0] = tensors[stage_0][:1].clone()
    with LLM(folder, device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16, pipeline_parallel_size=2,
             distributed_executor_backend="mp") as llm:
        alone = generate(llm, [None] * len(PROMPTS))
        llm.add_request("a", {"prompt_token_ids": PROMPTS[0]}, GREEDY, broken)
        llm.add_request("b", {"prompt_token_ids": PROMPTS[2]}, GREEDY)
        save_file(tensors, weights, metadata={"format": "pt"})
        tokens = step_until_done(llm)
        assert not tokens.get("a") and tokens["b"] == alone[2]
        check_failed(llm, "a", tmp_path)
        assert generate(llm, [None] * len(PROMPTS)) == alone
