"""Structured outputs (xgrammar): every sample obeys its grammar at temperature 1, also when batched
with free samples, preempted and recomputed, or sampled on a tensor- or pipeline-parallel engine."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from shardserve.launch.demo import DEMO_MODEL_DIR
from shardserve.runtime import LLM, SamplingParams
from shardserve.runtime.core.structured_output import StructuredOutputs

DEMO = str(DEMO_MODEL_DIR)
PET = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
       "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "maximum": 99}}}


def constrained(kind, spec, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=48, structured_outputs=StructuredOutputs(kind, spec), **kwargs)


def test_each_kind_of_grammar_is_obeyed_beside_free_samples():
    llm = LLM(DEMO, kv_cache_memory_bytes=1 << 25)
    params = [constrained("json", PET, seed=i) for i in range(6)] + [SamplingParams(max_tokens=8, seed=1)] + \
        [constrained("choice", ["left", "right"], seed=2), constrained("regex", r"[0-9]{2}:[0-9]{2}", seed=3)]
    outputs = [o.outputs[0].text for o in llm.generate([f"Item {i}" for i in range(len(params))], params)]
    for text in outputs[:6]:
        jsonschema.validate(json.loads(text), PET)
    assert outputs[7] in ("left", "right") and re.fullmatch(r"[0-9]{2}:[0-9]{2}", outputs[8])
    with pytest.raises(ValueError, match="regex structured output is invalid"):
        llm.generate("x", constrained("regex", "([0-9"))


def test_a_grammar_starting_after_given_tokens_leaves_the_output_free_until_them():
    """A reasoning model's grammar applies after its "</think>": here, after the token greedy decoding
    samples third, so the first three tokens are the free run's and the rest obey the choice."""
    llm = LLM(DEMO, kv_cache_memory_bytes=1 << 25)
    free = llm.generate("The list", SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].token_ids
    end = free[2]
    assert end not in free[:2], "control: the marker token comes first at the third place"
    choice = StructuredOutputs("choice", ("left", "right"), starts_after=(end,))
    out = llm.generate("The list", SamplingParams(temperature=0, max_tokens=16, structured_outputs=choice))[0]
    assert list(out.outputs[0].token_ids[:3]) == list(free[:3])
    tail = llm.get_tokenizer().decode(out.outputs[0].token_ids[3:], skip_special_tokens=True)
    assert tail in ("left", "right"), tail
    with pytest.raises(ValueError, match="starts_after"):
        StructuredOutputs("choice", ("a",), starts_after=())


def test_a_preempted_sample_resumes_inside_its_grammar():
    """A pool of 5 blocks of 16 for 6 samples of ~30 tokens each forces preemption and recompute:
    each matcher lives with its request in the engine, so a recomputed sample resumes where it was."""
    per_block = LLM(DEMO, kv_cache_memory_bytes=1 << 22, max_model_len=80).kv_cache_info.bytes_per_block
    llm = LLM(DEMO, kv_cache_memory_bytes=5 * per_block, block_size=16, max_model_len=80)
    outputs = llm.generate([f"Pet {i}" for i in range(6)], [constrained("json", PET, seed=i) for i in range(6)])
    assert llm.engine.scheduler.num_preemptions > 0, "control: the pool was small enough to preempt"
    for output in outputs:
        jsonschema.validate(json.loads(output.outputs[0].text), PET)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_a_parallel_engine_samples_inside_the_grammar(layout):
    """The engine's bitmask reaches the sampling rank; with pipeline stages, two batches are in flight."""
    with LLM(DEMO, **layout, kv_cache_memory_bytes=1 << 24) as llm:
        outputs = llm.generate(["A", "B", "C"], [constrained("json", PET, seed=i) for i in range(3)])
    for output in outputs:
        jsonschema.validate(json.loads(output.outputs[0].text), PET)
