"""Incremental detokenization never splits a character; chat applies the template; text matches decode."""

from __future__ import annotations

import pytest

from shardserve.runtime import LLM, SamplingParams
from shardserve.runtime.detokenizer import IncrementalDetokenizer, StreamDetokenizer, make_detokenizer, special_token_ids

TEXT = "naïve café — 日本語のテキスト 🙂🚀 and plain words"


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory("qwen2")


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint[0], device="cpu", kv_cache_memory_bytes=2**24)


def window_detokenizer(tokenizer, skip_special_tokens=True, dropped=frozenset()):
    return IncrementalDetokenizer(tokenizer, skip_special_tokens, dropped)


DETOKENIZERS = [window_detokenizer, make_detokenizer]  # the fallback, and the Rust stream for fast tokenizers


def test_a_fast_tokenizer_gets_the_stream_decoder(llm):
    assert isinstance(make_detokenizer(llm.get_tokenizer()), StreamDetokenizer)


@pytest.mark.parametrize("make", DETOKENIZERS)
def test_streamed_text_never_splits_a_character(llm, make):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids), "control: some tokens are partial characters"
    detokenizer = make(tokenizer)
    pieces = [detokenizer.push(t) for t in ids] + [detokenizer.flush()]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == TEXT
    assert "" in pieces[:-1]  # some tokens were held back until their character completed


@pytest.mark.parametrize("make", DETOKENIZERS)
def test_special_tokens_are_skipped_unless_asked(llm, make):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer("plain words", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    for skip, expected in ((True, "plain words"), (False, "plain words</s>")):
        detokenizer = make(tokenizer, skip_special_tokens=skip)
        assert "".join(detokenizer.push(t) for t in ids) + detokenizer.flush() == expected


def test_kept_special_tokens_stay_in_the_text_that_skips_the_others(llm):
    tokenizer = llm.get_tokenizer()
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    ids = [bos] + tokenizer("plain words", add_special_tokens=False).input_ids + [eos]
    for make in (window_detokenizer, make_detokenizer):
        detokenizer = make(tokenizer, False, special_token_ids(tokenizer) - {eos})
        assert "".join(detokenizer.push(t) for t in ids) + detokenizer.flush() == "plain words</s>"
    forced = {"temperature": 0.0, "max_tokens": 3, "ignore_eos": True, "logit_bias": {bos: 100.0}}
    kept, skipped = llm.generate(["The quick brown"] * 2, [SamplingParams(**forced, kept_special_token_ids=(bos,)),
                                                           SamplingParams(**forced)])
    assert (kept.outputs[0].text, skipped.outputs[0].text) == ("<s>" * 3, "")


@pytest.mark.parametrize("make", DETOKENIZERS)
def test_ids_outside_the_vocabulary_are_dropped_without_stalling(llm, make):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer("plain words", add_special_tokens=False).input_ids
    detokenizer = make(tokenizer)
    pieces = [detokenizer.push(t) for t in ids[:1] + [len(tokenizer) + 5] + ids[1:]] + [detokenizer.flush()]
    assert "".join(pieces) == "plain words"


def test_output_text_equals_decode_of_output_tokens(llm):
    outputs = llm.generate(["The quick brown", "日本語", "café"], SamplingParams(temperature=0.0, max_tokens=16))
    tokenizer = llm.get_tokenizer()
    for output in outputs:
        completion = output.outputs[0]
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert outputs[1].prompt == "日本語" and outputs[1].prompt_token_ids == tokenizer("日本語").input_ids


def test_chat_applies_the_template(llm):
    messages = [{"role": "user", "content": "Über den Wolken?"}]
    (chat,) = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=6))
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("assistant:") and chat.prompt == text
    assert chat.prompt_token_ids == tokenizer(text, add_special_tokens=False).input_ids
    (plain,) = llm.generate({"prompt_token_ids": chat.prompt_token_ids}, SamplingParams(temperature=0.0, max_tokens=6))
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
    two = llm.chat([messages, [{"role": "user", "content": "café"}]], SamplingParams(max_tokens=2))
    assert len(two) == 2


def test_a_chat_template_given_inline_or_as_a_file_replaces_the_tokenizers(checkpoint, tmp_path):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    for value in (template, str(path)):
        llm = LLM(checkpoint[0], device="cpu", kv_cache_memory_bytes=2**22, chat_template=value)
        (out,) = llm.chat([{"role": "user", "content": "café"}], SamplingParams(max_tokens=1))
        assert out.prompt == "[user] café\n"
    with pytest.raises(ValueError, match="neither a Jinja template nor a file"):
        LLM(checkpoint[0], device="cpu", kv_cache_memory_bytes=2**22, chat_template=str(tmp_path / "missing.jinja"))
