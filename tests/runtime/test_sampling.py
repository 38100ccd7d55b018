"""Every sampling parameter, on a real tiny model, with checks that fail if the parameter is ignored."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from shardserve.runtime import LLM, SamplingParams

PROMPTS = [[5 + i, 40 + 3 * i, 77, 120 + i, 9] * (1 + i % 3) for i in range(6)]


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory("llama3")


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint[0], device="cpu", kv_cache_memory_bytes=2**24, block_size=4)


def run(llm, params, prompts=PROMPTS):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def tokens(outputs, index=0):
    return [o.outputs[index].token_ids for o in outputs]


def hf_greedy(hf_model, prompt, max_new_tokens, **kwargs):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=2, eos_token_id=None, **kwargs)
    return out[0, len(prompt):].tolist()


def test_seeded_sampling_is_reproducible_across_batches(llm):
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    alone = tokens(run(llm, params, PROMPTS[:1]))[0]
    batched = tokens(run(llm, [params] + [SamplingParams(temperature=0.7, max_tokens=5)] * 5))[0]
    assert alone == batched
    other = tokens(run(llm, SamplingParams(temperature=1.0, max_tokens=12, seed=99, ignore_eos=True), PROMPTS[:1]))[0]
    assert other != alone


def test_unseeded_sampling_follows_the_engine_seed(checkpoint):
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    first = tokens(run(LLM(checkpoint[0], device="cpu", kv_cache_memory_bytes=2**24, seed=3), params))
    again = tokens(run(LLM(checkpoint[0], device="cpu", kv_cache_memory_bytes=2**24, seed=3), params))
    other = tokens(run(LLM(checkpoint[0], device="cpu", kv_cache_memory_bytes=2**24, seed=4), params))
    assert first == again and first != other


def test_n_samples_differ_and_are_indexed(llm):
    (output,) = run(llm, SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=5, ignore_eos=True), PROMPTS[:1])
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in output.outputs}) == 3
    llm.engine.block_manager.check_integrity()


def test_filters_that_leave_one_token_are_greedy(llm):
    greedy = tokens(run(llm, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)))
    for params in (SamplingParams(temperature=1.0, top_k=1, max_tokens=8, ignore_eos=True, seed=1),
                   SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=8, ignore_eos=True, seed=1),
                   SamplingParams(temperature=1.0, min_p=1.0, max_tokens=8, ignore_eos=True, seed=1),
                   SamplingParams(temperature=1e-4, max_tokens=8, ignore_eos=True, seed=1)):
        assert tokens(run(llm, params)) == greedy, params


def sampled_probabilities(llm, **kwargs):
    """For many random draws: (probability of the sampled token, sorted probabilities of the top 20)."""
    params = SamplingParams(temperature=1.0, max_tokens=6, logprobs=20, ignore_eos=True, n=6, seed=11, **kwargs)
    draws = []
    for output in run(llm, params):
        for completion in output.outputs:
            for token, entries in zip(completion.token_ids, completion.logprobs):
                top = sorted((math.exp(e.logprob) for e in entries.values()), reverse=True)
                draws.append((math.exp(entries[token].logprob), entries[token].rank, top))
    return draws


def test_top_k_top_p_min_p_restrict_the_draws(llm):
    unrestricted = sampled_probabilities(llm)
    assert max(rank for _, rank, _ in unrestricted) > 3, "control: plain sampling must reach rank > 3"
    assert all(rank <= 3 for _, rank, _ in sampled_probabilities(llm, top_k=3))
    for p, rank, top in sampled_probabilities(llm, top_p=0.3):
        assert sum(top[: rank - 1]) < 0.3 + 1e-6  # everything better than the draw fits under top_p
    for p, _, top in sampled_probabilities(llm, min_p=0.2):
        assert p >= 0.2 * top[0] - 1e-6
    assert any(p < 0.2 * top[0] for p, _, top in unrestricted), "control: plain sampling breaks min_p"


def test_higher_temperature_spreads_the_draws(llm):
    def mean_rank(temperature):
        params = SamplingParams(temperature=temperature, max_tokens=8, logprobs=0, ignore_eos=True, n=4, seed=2)
        ranks = [e[t].rank for o in run(llm, params) for c in o.outputs for t, e in zip(c.token_ids, c.logprobs)]
        return sum(ranks) / len(ranks)

    assert mean_rank(3.0) > mean_rank(0.3) + 1


def test_repetition_penalty_matches_transformers(llm, checkpoint):
    hf_model = checkpoint[1]
    outputs = run(llm, SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.8, ignore_eos=True))
    plain = tokens(run(llm, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)))
    expected = [hf_greedy(hf_model, p, 10, repetition_penalty=1.8) for p in PROMPTS]
    assert tokens(outputs) == expected
    assert tokens(outputs) != plain


class OpenAIPenalties(LogitsProcessor):
    """Reference presence/frequency penalties over generated tokens, inside transformers' loop."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        generated = input_ids[:, self.prompt_len:]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 0.7), (-0.5, 0.4)])
def test_presence_and_frequency_penalties_match_reference(llm, checkpoint, presence, frequency):
    hf_model = checkpoint[1]
    params = SamplingParams(temperature=0.0, max_tokens=12, presence_penalty=presence,
                            frequency_penalty=frequency, ignore_eos=True)
    expected = [hf_greedy(hf_model, p, 12, logits_processor=LogitsProcessorList(
        [OpenAIPenalties(len(p), presence, frequency)])) for p in PROMPTS]
    assert tokens(run(llm, params)) == expected
    plain = tokens(run(llm, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)))
    assert expected != plain, "control: the penalties must change something"


def test_max_tokens_and_length_finish(llm):
    for output in run(llm, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)):
        assert len(output.outputs[0].token_ids) == 3 and output.outputs[0].finish_reason == "length"


def test_stop_token_ids(llm):
    greedy = tokens(run(llm, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), PROMPTS[:1]))[0]
    stop = greedy[3]
    (output,) = run(llm, SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop]), PROMPTS[:1])
    completion = output.outputs[0]
    assert completion.token_ids == greedy[: greedy.index(stop) + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop


def test_stop_strings_cut_the_text(llm):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    full = run(llm, params, PROMPTS[:2])
    for prompt, reference in zip(PROMPTS[:2], full):
        text = reference.outputs[0].text
        starts = [i for i in range(2, len(text) - 1) if "\ufffd" not in text[i:i + 2]]
        assert starts, f"no clean two-character window in {text!r}"
        stop = text[starts[0]: starts[0] + 2]
        cut = text[: text.find(stop)]
        (out,) = run(llm, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]), [prompt])
        assert out.outputs[0].text == cut and out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].stop_reason == stop
        (kept,) = run(llm, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=stop,
                                          include_stop_str_in_output=True), [prompt])
        assert kept.outputs[0].text == cut + stop


@pytest.fixture(scope="module")
def eos_checkpoint(checkpoint, tmp_path_factory):
    """The same weights with EOS set to the token greedy decoding emits fourth for PROMPTS[0]."""
    llm = LLM(checkpoint[0], device="cpu", kv_cache_memory_bytes=2**24)
    greedy = tokens(run(llm, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), PROMPTS[:1]))[0]
    folder = str(tmp_path_factory.mktemp("eos"))
    for name in os.listdir(checkpoint[0]):
        shutil.copy(os.path.join(checkpoint[0], name), folder)
    eos = greedy[3]
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos}, f)
    return folder, greedy, eos


def test_eos_stops_unless_ignored(eos_checkpoint):
    folder, greedy, eos = eos_checkpoint
    llm = LLM(folder, device="cpu", kv_cache_memory_bytes=2**24)
    (stopped,) = run(llm, SamplingParams(temperature=0.0, max_tokens=8), PROMPTS[:1])
    assert stopped.outputs[0].token_ids == greedy[: greedy.index(eos) + 1]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason is None
    (ignored,) = run(llm, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), PROMPTS[:1])
    assert ignored.outputs[0].token_ids == greedy


def test_min_tokens_masks_eos(eos_checkpoint):
    folder, greedy, eos = eos_checkpoint
    llm = LLM(folder, device="cpu", kv_cache_memory_bytes=2**24)
    min_tokens = greedy.index(eos) + 2
    (output,) = run(llm, SamplingParams(temperature=0.0, max_tokens=8, min_tokens=min_tokens), PROMPTS[:1])
    assert eos not in output.outputs[0].token_ids[:min_tokens]
    assert len(output.outputs[0].token_ids) >= min_tokens


def test_logprobs_have_ranks_and_top_k(llm):
    (output,) = run(llm, SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True), PROMPTS[:1])
    completion = output.outputs[0]
    assert len(completion.logprobs) == 5
    for token, entries in zip(completion.token_ids, completion.logprobs):
        assert entries[token].rank == 1  # greedy takes the most likely token
        assert len(entries) == 3
        values = sorted((e.logprob for e in entries.values()), reverse=True)
        assert all(v <= 0 for v in values) and sorted({e.rank for e in entries.values()}) == [1, 2, 3]


def test_invalid_parameters_are_refused_with_the_field_name():
    for kwargs, field in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -5}, "top_k"),
                          ({"n": 0}, "n"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
                          ({"temperature": float("inf")}, "temperature"),
                          ({"repetition_penalty": float("inf")}, "repetition_penalty"),
                          ({"repetition_penalty": float("nan")}, "repetition_penalty"),
                          ({"logit_bias": {5: float("nan")}}, "logit_bias"),
                          ({"stop_token_ids": [-1]}, "stop_token_ids")]:
        with pytest.raises(ValueError, match=field) as caught:
            SamplingParams(**kwargs)
        assert caught.value.field == field  # the server's 400 names it
    assert SamplingParams(top_k=-1).top_k is None  # vLLM's "disabled" spelling is accepted


def test_seeded_sampling_survives_preemption(checkpoint, kv_bytes_for):
    """Draws depend on (seed, output index) only, so recomputing a preempted request changes nothing."""
    params = [SamplingParams(temperature=1.0, max_tokens=10, seed=100 + i, ignore_eos=True) for i in range(6)]
    roomy = LLM(checkpoint[0], device="cpu", kv_cache_memory_bytes=2**24, block_size=4)
    tight = LLM(checkpoint[0], device="cpu", block_size=4, max_model_len=32,
                kv_cache_memory_bytes=kv_bytes_for(checkpoint[0], 12, 4))
    expected = tokens(run(roomy, params))
    assert tokens(run(tight, params)) == expected
    assert tight.engine.scheduler.num_preemptions > 0


def test_streamed_text_never_shows_a_stop_string_that_gets_cut(llm):
    full = run(llm, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), PROMPTS[:1])[0].outputs[0]
    text = full.text
    clean = [i for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 3]]
    stop = text[clean[0]: clean[0] + 3]
    llm.add_request("stream", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=stop))
    seen, text_so_far = [], ""
    while llm.has_unfinished_requests():
        for delta in llm.step():
            text_so_far += delta.samples[0].new_text
            seen.append(text_so_far)
    final = text[: text.find(stop)]
    assert seen[-1] == final
    assert all(final.startswith(partial) for partial in seen)  # text only ever grows toward the final one


def test_logit_bias_bans_and_forces_tokens(llm):
    greedy = tokens(run(llm, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)))
    banned = {t for row in greedy for t in row}
    avoided = tokens(run(llm, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                             logit_bias={t: -100 for t in banned})))
    assert all(t not in banned for row in avoided for t in row)
    forced = tokens(run(llm, SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True,
                                            logit_bias={"42": 250.0})))  # clamped to 100: still forced
    assert all(row == [42] * 6 for row in forced)
    mixed = run(llm, [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logit_bias={42: 100})]
                + [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)] * 5)
    assert tokens(mixed)[0] == [42] * 3 and tokens(mixed)[1:] == [row[:3] for row in greedy[1:]]  # per row
    with pytest.raises(ValueError, match="logit_bias token ids must lie in"):
        run(llm, SamplingParams(max_tokens=2, logit_bias={10**6: 1.0}))
