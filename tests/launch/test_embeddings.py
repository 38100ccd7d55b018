"""POST /v1/embeddings on a real `shardserve launch --runner pooling` over a tiny Qwen3-Embedding-style
checkpoint made here: the openai client's embeddings equal transformers' (last token, normalized, as the
checkpoint's sentence-transformers files say), in both encodings; each runner refuses the other's requests
by the flag that would serve them."""

from __future__ import annotations

import base64
import os
import subprocess

import numpy as np
import openai
import pytest
import torch

from tests.launch.conftest import API_KEY, AUTH, MODEL, http, metric, post, start_server, stop_server
from tests.runtime.runtime_checkpoints import pooled_reference, save_sentence_transformers_model

pytestmark = pytest.mark.slow  # every test here starts a process

NAME = "tiny-embed"
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paged attention stores keys and values.", "fox"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("embedding_model"))
    save_sentence_transformers_model(path, "lasttoken", with_normalize=True)
    return path


@pytest.fixture(scope="module")
def pooling_process(folder):
    """The server's process (its log is read) and URL; stopped at the end, which must be clean."""
    proc, url = start_server("--model", folder, "--runner", "pooling", "--served-model-name", NAME,
                             "--api-key", API_KEY, "--max-num-batched-tokens", "16", "--max-num-seqs", "4",
                             "--block-size", "4")
    yield proc, url
    code, out = stop_server(proc)
    assert code == 0, out


@pytest.fixture(scope="module")
def pooling_server(pooling_process):
    return pooling_process[1]


@pytest.fixture(scope="module")
def pooling_client(pooling_server):
    return openai.OpenAI(base_url=f"{pooling_server}/v1", api_key=API_KEY, max_retries=0)


def token_ids(folder: str, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return [tokenizer(text).input_ids for text in texts]


def test_the_openai_client_gets_transformers_embeddings(pooling_client, pooling_server, folder):
    before = metric(pooling_server, "vllm:prompt_tokens_total")
    response = pooling_client.embeddings.create(model=NAME, input=TEXTS)  # the client asks for base64
    prompts = token_ids(folder, TEXTS)
    assert response.model == NAME and [d.index for d in response.data] == [0, 1, 2]
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, prompts))
    got = torch.tensor([d.embedding for d in response.data])
    torch.testing.assert_close(got, pooled_reference(folder, prompts, "LAST"), atol=2e-5, rtol=1e-4)
    assert metric(pooling_server, "vllm:prompt_tokens_total") - before == sum(map(len, prompts))


def test_token_ids_and_both_encodings(pooling_server, folder):
    prompts = [[5, 6, 7, 8, 9] * 5, [11]]  # 25 tokens: prefilled in chunks of 16
    reference = pooled_reference(folder, prompts, "LAST")
    code, body = post(pooling_server, "/v1/embeddings", {"model": NAME, "input": prompts, "encoding_format": "float"})
    assert code == 200, body
    assert body["object"] == "list" and body["usage"] == {"prompt_tokens": 26, "total_tokens": 26}
    assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", 0), ("embedding", 1)]
    torch.testing.assert_close(torch.tensor([d["embedding"] for d in body["data"]]), reference, atol=2e-5, rtol=1e-4)
    code, body = post(pooling_server, "/v1/embeddings", {"input": prompts[0], "encoding_format": "base64"})
    decoded = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    torch.testing.assert_close(torch.from_numpy(decoded.copy()), reference[0], atol=2e-5, rtol=1e-4)
    code, body = post(pooling_server, "/v1/embeddings", {"input": prompts, "normalize": False})  # vLLM's extra
    torch.testing.assert_close(torch.tensor([d["embedding"] for d in body["data"]]),
                               pooled_reference(folder, prompts, "LAST", normalize=False), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("body, status, param", [
    ({"input": "fox", "dimensions": 8}, 400, "dimensions"),
    ({"input": "fox", "model": "other"}, 404, "model"),
    ({"input": []}, 400, "input"),
    ({"input": [[]]}, 400, "input"),
    ({"input": [999999]}, 400, "input"),
    ({"input": "fox", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "fox", "truncate_dims": 3}, 400, "truncate_dims"),
])
def test_bad_requests_are_refused_by_field(pooling_server, body, status, param):
    code, answer = post(pooling_server, "/v1/embeddings", body)
    assert code == status and answer["error"]["param"] == param, answer


def test_the_pooling_server_refuses_generation_and_wants_a_key(pooling_server, pooling_client):
    with pytest.raises(openai.BadRequestError, match="--runner generate"):
        pooling_client.completions.create(model=NAME, prompt="The quick", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="--runner generate"):
        pooling_client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}])
    assert http(f"{pooling_server}/v1/embeddings", {"input": "fox"})[0] == 401


def test_a_generating_server_refuses_embeddings_by_the_flag(client):
    with pytest.raises(openai.BadRequestError, match="--runner pooling") as error:
        client.embeddings.create(model=MODEL, input="The quick")
    assert error.value.body["param"] == "model"


def test_embeddings_go_through_the_server_s_body_limit(pooling_server):
    code, _ = http(f"{pooling_server}/v1/embeddings", {"input": "x" * (17 << 20)}, AUTH)
    assert code == 413


def test_the_start_up_log_offers_an_embeddings_curl_that_works(pooling_process):
    proc, url = pooling_process  # the log line is written before the server answers its health check
    pasted = next(line.strip() for line in iter(proc.stdout.readline, "") if line.lstrip().startswith("curl "))
    port = url.rsplit(":", 1)[1]
    assert pasted.startswith(f"curl http://localhost:{port}/v1/embeddings") and '"input": "The function"' in pasted
    done = subprocess.run(["bash", "-c", pasted + " -sS"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SHARDSERVE_API_KEY": API_KEY})
    assert done.returncode == 0 and '"object":"embedding"' in done.stdout.replace(" ", ""), done.stdout + done.stderr
