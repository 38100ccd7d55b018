"""Prompts are checked once, by the input processor; outputs flow as deltas that cost no more per step as text grows."""

from __future__ import annotations

import pytest

from shardserve.runtime import LLM, InvalidPromptError, ProcessedPrompt, SamplingParams
from shardserve.runtime.core.messages import RequestUpdate
from shardserve.runtime.output_processor import OutputProcessor

NUM_LONG_TOKENS = 2000


@pytest.fixture(scope="module")
def llm(checkpoint_factory):
    return LLM(checkpoint_factory("qwen2")[0], device="cpu", max_model_len=32, kv_cache_memory_bytes=2**22)


@pytest.mark.parametrize("prompt, params, field, message", [
    ([], SamplingParams(), "prompt", "empty"),
    ([5, 320], SamplingParams(), "prompt", r"\[0, 320\)"),
    (["5"], SamplingParams(), "prompt", r"\[0, 320\)"),
    ({"text": "hi"}, SamplingParams(), "prompt", "a prompt is"),
    ([5] * 30, SamplingParams(max_tokens=3), "max_tokens", "max_model_len=32"),
    ([5] * 32, SamplingParams(max_tokens=None), "prompt", "no room to generate"),
    ([5] * 3, SamplingParams(stop_token_ids=[320]), "stop_token_ids", r"\[0, 320\)"),
    ([5] * 3, SamplingParams(max_tokens=None, min_tokens=40), "min_tokens", "max_model_len=32"),
])
def test_the_input_processor_names_what_to_change(llm, prompt, params, field, message):
    with pytest.raises(InvalidPromptError, match=message) as caught:
        llm.engine.input_processor.process(prompt, params)
    assert caught.value.field == field
    with pytest.raises(ValueError, match=message):  # LLM.generate goes through the same processor
        llm.generate(prompt if isinstance(prompt, dict) else {"prompt_token_ids": prompt}, params)
    assert not llm.engine.has_unfinished_requests()


def test_prompt_forms_agree_and_the_engine_trusts_a_processed_prompt(llm, monkeypatch):
    processor, params = llm.engine.input_processor, SamplingParams(temperature=0.0, max_tokens=3)
    text = processor.process("café", params)
    assert text == processor.process({"prompt": "café"}, params)
    assert processor.process(list(text.prompt_token_ids), params) == ProcessedPrompt(None, text.prompt_token_ids)
    chat = processor.process_chat([{"role": "user", "content": "hi"}], params)
    assert chat.prompt.endswith("assistant:") and chat.prompt_token_ids.count(0) == 1  # the template's <s> only

    def refuse(*args):
        raise AssertionError("a processed prompt was checked again")

    monkeypatch.setattr(processor, "process", refuse)
    llm.add_request("trusted", text, params)
    deltas = []
    while llm.has_unfinished_requests():
        deltas += llm.step()
    assert [len(d.samples[0].new_token_ids) for d in deltas] == [1, 1, 1] and deltas[-1].finished


def test_prompts_without_a_tokenizer_need_token_ids(checkpoint_factory):
    folder, _ = checkpoint_factory("opt", with_tokenizer=False)
    processor = LLM(folder, device="cpu", kv_cache_memory_bytes=2**22, skip_tokenizer_init=True).engine.input_processor
    for call, field in [(lambda: processor.process("text", SamplingParams()), "prompt"),
                        (lambda: processor.process([3, 4], SamplingParams(stop="x")), "stop"),
                        (lambda: processor.process_chat([{"role": "user", "content": "hi"}], SamplingParams()),
                         "prompt")]:
        with pytest.raises(InvalidPromptError) as caught:
            call()
        assert caught.value.field == field


def test_complete_outputs_are_the_deltas_put_together(llm):
    params = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=6, logprobs=1, ignore_eos=True)
    (output,) = llm.generate("The quick", params)
    llm.add_request("streamed", "The quick", params)
    deltas = []
    while llm.has_unfinished_requests():
        deltas += llm.step()
    assert [d.finished for d in deltas][-1] and not any(d.finished for d in deltas[:-1])
    for completion in output.outputs:
        samples = [s for d in deltas for s in d.samples if s.sample_index == completion.index]
        assert completion.token_ids == [t for s in samples for t in s.new_token_ids]
        assert completion.text == "".join(s.new_text for s in samples)
        assert completion.finish_reason == samples[-1].finish_reason == "length"
        assert completion.cumulative_logprob == pytest.approx(
            sum(entries[t].logprob for t, entries in zip(completion.token_ids, completion.logprobs)))


@pytest.mark.parametrize("include_stop", [False, True])
def test_stop_strings_across_deltas_hold_back_only_what_may_be_cut(llm, include_stop):
    tokenizer = llm.get_tokenizer()
    token_ids = tokenizer("The quick brown fox jumps", add_special_tokens=False).input_ids
    processor = OutputProcessor(tokenizer)
    processor.add_prompt("p", SamplingParams(stop=["brown f", "zebra"], include_stop_str_in_output=include_stop))
    pieces, stopped_at = [], None
    for step, token in enumerate(token_ids):
        deltas, stopped = processor.process([RequestUpdate("p", (token,), (), None)])
        if not deltas:
            break
        (sample,) = deltas[0].samples
        pieces.append(sample.new_text)
        if stopped:
            stopped_at = step
            assert stopped == ["p"] and deltas[0].finished
            assert (sample.finish_reason, sample.stop_reason) == ("stop", "brown f")
    expected = "The quick brown f" if include_stop else "The quick "
    assert "".join(pieces) == expected and stopped_at is not None and stopped_at < len(token_ids) - 1
    assert all(len(p) <= 8 for p in pieces)  # never more than the held "brown " plus one token


def test_streaming_2000_tokens_costs_no_more_per_step_at_the_end(checkpoint_factory, kv_bytes_for):
    """Counts the tokens the detokenizer (and logprob text) decode in each step and the size of what
    each step returns: the last 100 steps may not cost more than the first 100 (a cumulative
    snapshot or a full decode per step would cost ~20x more there)."""
    num_positions = NUM_LONG_TOKENS + 48
    folder, _ = checkpoint_factory("qwen2", num_layers=1, max_position_embeddings=num_positions)
    llm = LLM(folder, device="cpu", block_size=16, kv_cache_memory_bytes=kv_bytes_for(folder, num_positions // 16, 16))
    tokenizer = llm.get_tokenizer()
    num_decoded, decode = [0], tokenizer.decode

    def counting_decode(ids, *args, **kwargs):
        num_decoded[0] += len(ids)
        return decode(ids, *args, **kwargs)

    tokenizer.decode = counting_decode
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=NUM_LONG_TOKENS, ignore_eos=True,
                            stop="no such text!", logprobs=1)
    llm.add_request("long", "The quick brown", params)
    steps, token_ids, text = [], [], []  # steps: (tokens decoded, tokens + characters returned)
    while llm.has_unfinished_requests():
        before = num_decoded[0]
        samples = [s for delta in llm.step() for s in delta.samples]
        token_ids += [t for s in samples for t in s.new_token_ids]
        text += [s.new_text for s in samples]
        steps.append((num_decoded[0] - before, sum(len(s.new_token_ids) + len(s.new_text) for s in samples)))
    del tokenizer.decode
    assert len(steps) == len(token_ids) == NUM_LONG_TOKENS  # one token per step, none repeated
    assert "".join(text) == tokenizer.decode(token_ids, skip_special_tokens=True)
    for column in (0, 1):
        first, last = (sum(step[column] for step in part) for part in (steps[:100], steps[-100:]))
        assert 0 < last <= 2 * first, (column, first, last)
