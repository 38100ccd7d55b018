"""The server's OpenAI features beyond plain generation, against a real `shardserve launch`: token
routes, logit_bias, prompt logprobs, structured outputs and the tool refusals."""

import json
import re

import pytest

from tests.launch.conftest import AUTH, MODEL, http, post

pytestmark = pytest.mark.slow  # every test here starts a process


def test_tokenize_and_detokenize_use_the_served_tokenizer(server):
    from transformers import AutoTokenizer

    from shardserve.launch.demo import DEMO_MODEL_DIR
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    code, data = post(server, "/tokenize", {"model": MODEL, "prompt": "A list is"})
    assert code == 200 and data["tokens"] == tokenizer("A list is").input_ids
    assert data["count"] == len(data["tokens"]) and data["max_model_len"] == 1024
    messages = [{"role": "user", "content": "What is a list?"}]
    code, chat = post(server, "/tokenize", {"model": MODEL, "messages": messages})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert code == 200 and chat["tokens"] == tokenizer(text, add_special_tokens=False).input_ids
    code, back = post(server, "/detokenize", {"model": MODEL, "tokens": data["tokens"]})
    assert code == 200 and back["prompt"] == tokenizer.decode(data["tokens"])
    assert post(server, "/detokenize", {"model": MODEL, "tokens": [10**9]})[0] == 400
    assert post(server, "/tokenize", {"model": MODEL})[0] == 400
    assert post(server, "/tokenize", {"model": MODEL, "prompt": "x"}, headers={})[0] == 401


def test_logit_bias_through_the_api(client, server):
    forced = client.completions.create(model=MODEL, prompt="The list", max_tokens=4, temperature=1.0, seed=5,
                                       logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    plain = client.completions.create(model=MODEL, prompt="The list", max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    code, data = post(server, "/v1/completions", {"model": MODEL, "prompt": "The list", "max_tokens": 4,
                                                  "temperature": 0, "logprobs": 0, "logit_bias": {"42": 100}})
    assert code == 200 and forced.choices[0].text == data["choices"][0]["text"] != plain.choices[0].text
    code, data = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                  "logit_bias": {"99999999": 5}})
    assert code == 400 and data["error"]["param"] == "logit_bias"


def hf_prompt_logprobs(ids: list[int]) -> list[float]:
    """transformers' log-probability of each prompt token after the first, in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardserve.launch.demo import DEMO_MODEL_DIR
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [logprobs[i, ids[i + 1]].item() for i in range(len(ids) - 1)]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_scores_the_prompt_like_transformers(server, stream):
    """The loglikelihood request evaluation harnesses send: token ids, echo, logprobs 1, max_tokens 0."""
    ids = [17, 250, 1033, 88, 402, 9, 611, 73, 1200, 5]
    body = {"model": MODEL, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
    if stream:
        events = http(f"{server}/v1/completions", body | {"stream": True}, AUTH)[1]
        chunks = [json.loads(line[6:]) for line in events.splitlines() if line.startswith("data: {")]
        lp = {"token_logprobs": [x for c in chunks for x in c["choices"][0]["logprobs"]["token_logprobs"]]}
    else:
        code, data = post(server, "/v1/completions", body)
        assert code == 200 and data["choices"][0]["finish_reason"] == "length"
        lp = data["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(ids) and lp["top_logprobs"][0] is None and len(lp["top_logprobs"][1]) >= 1
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids)
    assert lp["token_logprobs"][1:] == pytest.approx(hf_prompt_logprobs(ids), abs=1e-3)


def test_prompt_logprobs_extra_and_a_completion_after_the_echo(server):
    ids = [17, 250, 1033, 88, 402]
    code, data = post(server, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 3, "temperature": 0,
                                                  "prompt_logprobs": 2, "echo": True, "logprobs": 0})
    choice = data["choices"][0]
    assert code == 200 and choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(ids)
    scored = choice["prompt_logprobs"][1]
    assert str(ids[1]) in scored and scored[str(ids[1])]["logprob"] == pytest.approx(hf_prompt_logprobs(ids)[0], abs=1e-3)
    assert len(choice["logprobs"]["tokens"]) == len(ids) + 3  # the echoed prompt, then the completion
    code, data = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 2, "prompt_logprobs": 0})
    assert code == 200 and data["prompt_logprobs"][0] is None  # at the top of a chat response, as vLLM's
    code, data = post(server, "/v1/completions", {"model": MODEL, "prompt": ids, "prompt_logprobs": 1, "stream": True})
    assert code == 400 and data["error"]["param"] == "prompt_logprobs"


PET = {"type": "object", "additionalProperties": False, "required": ["name", "age", "kind"],
       "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                                          "maximum": 30},
                      "kind": {"enum": ["cat", "dog", "fish"]}}}


def test_json_schema_outputs_always_parse_and_validate(client):
    import jsonschema
    form = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
    for seed in range(20):  # temperature 1: only the grammar keeps a tiny model's text valid
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A pet?"}],
                                               max_tokens=60, temperature=1.0, seed=seed, response_format=form)
        jsonschema.validate(json.loads(reply.choices[0].message.content), PET)
    obj = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=60,
                                         temperature=0, response_format={"type": "json_object"})
    choice = obj.choices[0]  # any object: it may run out of max_tokens, and then says so
    assert choice.message.content.startswith("{") and (
        choice.finish_reason == "length" or isinstance(json.loads(choice.message.content), dict))


def test_parse_with_a_pydantic_model_and_streaming_agree(client):
    from typing import Literal

    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        name: str = Field(max_length=8)
        kind: Literal["cat", "dog"]

    parsed = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "A pet?"}],
                                           max_tokens=40, temperature=0, response_format=Pet)
    pet = parsed.choices[0].message.parsed
    assert isinstance(pet, Pet)
    form = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET}}
    args = dict(model=MODEL, messages=[{"role": "user", "content": "A pet?"}], max_tokens=60, temperature=0,
                response_format=form)
    full = client.chat.completions.create(**args).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **args)
                       if c.choices)
    assert streamed == full and json.loads(full)["kind"] in ("cat", "dog", "fish")


def test_guided_extras_on_completions(server, client):
    choice = client.completions.create(model=MODEL, prompt="Yes or no:", max_tokens=5, temperature=1.0,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    regex = client.completions.create(model=MODEL, prompt="Code:", max_tokens=10, temperature=1.0,
                                      extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", regex.choices[0].text)
    for field, value in (("guided_regex", "([0-9"), ("guided_json", "{not json"),
                         ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}})):
        code, data = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, field: value})
        assert code == 400 and data["error"]["param"] == field, (field, data)
    code, data = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "guided_regex": "a",
                                                  "guided_choice": ["a"]})
    assert code == 400 and "one structured output" in data["error"]["message"]


def test_tools_the_server_cannot_honour_are_refused_by_name(server):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": tools}
    code, data = post(server, "/v1/chat/completions", base | {"tool_choice": "auto"})
    assert code == 400 and data["error"]["param"] == "tool_choice" and "--tool-call-parser" in data["error"]["message"]
    code, data = post(server, "/v1/chat/completions", base | {"tool_choice": "required"})
    assert code == 400 and data["error"]["param"] == "tools" and "does not render tools" in data["error"]["message"]
    code, data = post(server, "/v1/chat/completions", base | {"tool_choice": "none"})
    assert code == 200
