"""async_scheduling end to end on a tiny random checkpoint: the same outputs as without it (greedy
and seeded sampling, stop strings, stop tokens, max_tokens, EOS, aborts mid-stream, preemption,
chunked prefill), step N+1 really queued before step N is read, outputs processed on a thread of
their own, and what it cannot honour refused."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from shardserve.runtime import LLM, AsyncEngine, SamplingParams
from shardserve.runtime.input_processor import InvalidPromptError
from shardserve.runtime.core.structured_output import StructuredOutputs
from test_runtime_matches_transformers import MIXED, SHARED, random_prompts, reference

PROMPTS = MIXED + SHARED + random_prompts(5, [9, 2, 28, 14])  # 22 prompts of 1 to 40 tokens


@pytest.fixture(scope="module")
def llama(checkpoint_factory):
    return checkpoint_factory("llama3")


def make_llm(folder: str, is_async: bool, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 2**24)
    return LLM(folder, device="cpu", block_size=4, async_scheduling=is_async, **kwargs)


def outputs_of(llm: LLM, params: list[SamplingParams]) -> list[list[tuple]]:
    """Per prompt, per sample: tokens, text, finish and stop reasons, and logprobs as
    {token: (logprob, rank)} per step."""
    results = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              [{t: (lp.logprob, lp.rank) for t, lp in step.items()} for step in c.logprobs or []])
             for c in r.outputs] for r in results]


def assert_same_outputs(got: list[list[tuple]], expected: list[list[tuple]]) -> None:
    """All exact but the logprob values, to 1e-4 (a batch of other requests rounds a row's last bits
    differently)."""
    assert [[sample[:4] for sample in samples] for samples in got] == \
        [[sample[:4] for sample in samples] for samples in expected]
    for samples, expected_samples in zip(got, expected):
        for sample, expected_sample in zip(samples, expected_samples):
            for step, expected_step in zip(sample[4], expected_sample[4], strict=True):
                assert step.keys() == expected_step.keys()
                for token, (logprob, rank) in step.items():
                    assert rank == expected_step[token][1] and abs(logprob - expected_step[token][0]) < 1e-4


def mixed_params(stop_texts: list[str]) -> list[SamplingParams]:
    """Greedy and seeded samples, stop strings (found mid-output), stop tokens, min_tokens, n=2, logprobs."""
    params = []
    for i in range(len(PROMPTS)):
        kind = i % 6
        if kind == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=3 + i % 9))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=12, ignore_eos=True))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.0, max_tokens=16, stop=[stop_texts[i]]))
        elif kind == 3:
            params.append(SamplingParams(temperature=0.7, top_k=20, seed=i, max_tokens=10, n=2, logprobs=2))
        elif kind == 4:
            params.append(SamplingParams(temperature=0.0, max_tokens=14, stop_token_ids=[17, 23, 41, 99],
                                         min_tokens=2, logit_bias={5: 2.0}))
        else:
            params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=1 + i % 3))
    return params


@pytest.fixture(scope="module")
def stop_texts(llama):
    """For each prompt, two characters from the middle of its greedy text (so the stop is found)."""
    with make_llm(llama[0], False) as llm:
        texts = [r.outputs[0].text for r in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                         SamplingParams(temperature=0.0, max_tokens=16))]
    return [t[len(t) // 2: len(t) // 2 + 2] or "zz" for t in texts]


@pytest.mark.parametrize("layout", [
    {},
    {"max_num_batched_tokens": 7, "max_num_seqs": 4},  # chunked prefill beside decodes
    {"max_model_len": 60, "kv_cache_memory_bytes": "16 blocks"},  # preemption
    {"enable_prefix_caching": False, "max_num_seqs": 3},
], ids=["default", "chunked", "preempting", "no-prefix-cache"])
def test_outputs_are_identical_with_and_without_overlap(layout, llama, stop_texts, kv_bytes_for):
    folder = llama[0]
    if layout.get("kv_cache_memory_bytes") == "16 blocks":
        layout = {**layout, "kv_cache_memory_bytes": kv_bytes_for(folder, 16, 4)}
    params = mixed_params(stop_texts)
    with make_llm(folder, False, **layout) as llm:
        expected = outputs_of(llm, params)
    with make_llm(folder, True, **layout) as llm:
        assert_same_outputs(outputs_of(llm, params), expected)
        stats = llm.engine.get_stats()
        assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
        llm.engine.block_manager.check_integrity()
        if "max_model_len" in layout:
            assert stats.num_preemptions > 0
    assert sum(o[0][2] == "stop" and isinstance(o[0][3], str) for o in expected) >= 3  # stop strings ended some


def test_greedy_with_overlap_matches_transformers(llama):
    folder, hf_model = llama
    with make_llm(folder, True) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0.0, max_tokens=10))
    assert [o.outputs[0].token_ids for o in outputs] == reference(hf_model, PROMPTS, 10)


def test_step_n_plus_1_is_queued_before_step_n_is_read(llama):
    with make_llm(llama[0], True) as llm:
        worker, log = llm.engine.executor.worker, []
        submit, collect, forward = worker.submit, worker.collect, worker._forward
        worker.submit = lambda output: log.append("submit") or submit(output)
        worker.collect = lambda step: log.append("collect") or collect(step)
        pending: list[int] = []
        worker._forward = lambda host, *rest: pending.append(len(host.pending_rows)) or forward(host, *rest)
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:6]], SamplingParams(temperature=0.0, max_tokens=8))
    depth, depths = 0, []
    for entry in log:
        depth += 1 if entry == "submit" else -1
        depths.append(depth)
    assert max(depths) == 2 and min(depths) == 0 and depths[-1] == 0
    assert log[:3] == ["submit", "submit", "collect"]  # the decode went out before the prefill's ids came back
    assert sum(pending) >= 6 * 6  # decode input ids taken on the device from the last step's samples


def test_aborts_mid_stream_leave_the_others_unchanged(llama):
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    with make_llm(llama[0], False) as llm:
        expected = [r.outputs[0].token_ids for r in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    with make_llm(llama[0], True) as llm:
        engine, tokens = llm.engine, {str(i): [] for i in range(len(PROMPTS))}
        for i, prompt in enumerate(PROMPTS):
            llm.add_request(str(i), {"prompt_token_ids": prompt}, params)
        num_steps = 0
        while llm.has_unfinished_requests():
            for delta in llm.step():
                tokens[delta.prompt_id].extend(delta.samples[0].new_token_ids)
            num_steps += 1
            if num_steps in (3, 6):  # mid-stream, with a step in flight
                for prompt_id in ("1", "4", "9") if num_steps == 3 else ("12", "20"):
                    llm.abort_request(prompt_id)
        engine.block_manager.check_integrity()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    aborted = {"1", "4", "9", "12", "20"}
    for i, want in enumerate(expected):
        got = tokens[str(i)]
        assert got == want if str(i) not in aborted else (got == want[: len(got)] and len(got) < len(want))


def test_a_prompt_id_is_free_again_only_once_its_aborted_outputs_are_drained(llama):
    """The aborted prompt's requests are still in a batch in flight: the id is refused until that batch is
    collected, and its next prompt gets none of its tokens."""
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True)
    with make_llm(llama[0], False) as llm:
        (expected,) = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params)
    with make_llm(llama[0], True) as llm:
        tokens: list[int] = []
        llm.add_request("a", {"prompt_token_ids": PROMPTS[0]}, params)
        llm.add_request("b", {"prompt_token_ids": PROMPTS[2]}, params)
        for _ in range(3):
            llm.step()
        llm.abort_request("a")
        with pytest.raises(ValueError, match="'a' is already in use"):
            llm.add_request("a", {"prompt_token_ids": PROMPTS[1]}, params)
        while llm.has_unfinished_requests():  # "b" runs on; "a"'s batch is collected
            llm.step()
        llm.add_request("a", {"prompt_token_ids": PROMPTS[1]}, params)
        while llm.has_unfinished_requests():
            for delta in llm.step():
                tokens.extend(delta.samples[0].new_token_ids)
    assert tokens == list(expected.outputs[0].token_ids)


def test_what_async_scheduling_cannot_honour_is_refused_by_name(llama):
    with make_llm(llama[0], True) as llm:
        for params, field in ((SamplingParams(prompt_logprobs=1), "prompt_logprobs"),
                              (SamplingParams(presence_penalty=0.5), "presence_penalty"),
                              (SamplingParams(repetition_penalty=1.2), "repetition_penalty"),
                              (SamplingParams(structured_outputs=StructuredOutputs("choice", ("a", "b"))),
                               "response_format")):
            with pytest.raises(InvalidPromptError, match="async_scheduling") as error:
                llm.generate({"prompt_token_ids": [3, 4]}, params)
            assert error.value.field == field
        assert not llm.engine.has_unfinished_requests()
    with make_llm(llama[0], False) as llm:  # the same requests run without it
        llm.generate({"prompt_token_ids": [3, 4]}, SamplingParams(prompt_logprobs=1, presence_penalty=0.5, max_tokens=2))
    for kwargs in ({"tensor_parallel_size": 2}, {"distributed_executor_backend": "mp"}):
        with pytest.raises(ValueError, match="async_scheduling.*tensor_parallel_size x pipeline_parallel_size"):
            make_llm(llama[0], True, **kwargs)


def test_the_server_engine_streams_the_same_with_overlap(llama):
    """AsyncEngine (the server's) with async_scheduling: concurrent streams carry the offline tokens
    and text, one token per delta; a consumer that leaves mid-stream frees its blocks."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:5]]
    with make_llm(llama[0], False) as llm:
        offline = llm.generate(prompts, params)

    async def stream(engine, prompt, prompt_id, leave_after=None):
        deltas = []
        async with aclosing(engine.generate(prompt, params, prompt_id)) as deltas_in:
            async for delta in deltas_in:
                deltas.append(delta)
                if len(deltas) == leave_after:
                    break
        return deltas

    async def main():
        engine = AsyncEngine(llama[0], device="cpu", kv_cache_memory_bytes=2**24, block_size=4, async_scheduling=True)
        try:
            streams = await asyncio.gather(*(stream(engine, p, f"p{i}") for i, p in enumerate(prompts)),
                                           stream(engine, prompts[0], "leaver", leave_after=2))
            for _ in range(50):  # the abort lands between steps
                if not engine.engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            pool = engine.engine.block_manager
            assert pool.num_free_blocks == pool.num_blocks
            return streams
        finally:
            await engine.shutdown()

    streams = asyncio.run(main())
    for deltas, expected in zip(streams, offline):
        samples = [d.samples[0] for d in deltas]
        assert [len(s.new_token_ids) for s in samples] == [1] * 8 and deltas[-1].finished
        assert [t for s in samples for t in s.new_token_ids] == expected.outputs[0].token_ids
        assert "".join(s.new_text for s in samples) == expected.outputs[0].text
    assert len(streams[-1]) == 2
