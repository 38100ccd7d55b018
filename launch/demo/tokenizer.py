"""Trains the demo model's byte-level BPE tokenizer and gives it a chat template."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (BOS, EOS, PAD, *ROLE_TOKENS)

# Every turn is "<|role|>\n{content}<|end_of_text|>", so one stop token ends both a
# plain completion and an assistant turn:
#   <|begin_of_text|><|system|>\n...<|end_of_text|><|user|>\n...<|end_of_text|><|assistant|>\n
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('roles are system, user and assistant') }}"
    "{%- endif %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] | trim + eos_token }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int,
                    max_model_len: int) -> PreTrainedTokenizerFast:
    """A GPT-2 style byte-level BPE: any UTF-8 text encodes, and decoding gives it back exactly."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1",
                                      special_tokens=[(BOS, bos_id)]),
    ])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS), chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False, model_max_length=max_model_len)
