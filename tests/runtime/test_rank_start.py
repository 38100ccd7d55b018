"""mp ranks start from a module, never from the caller's main: a tensor-parallel LLM made by a script
on standard input, or by a file with no main guard, gives the same greedy tokens as one rank; a rank
ignores Ctrl-C and reports its failure's traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from shardserve.runtime import LLM, EngineDeadError, SamplingParams
from test_parallel_generate import MAX_TOKENS, PROMPTS, rank_pids
from test_runtime_matches_transformers import token_outputs

TIMEOUT_SECONDS = 300

SCRIPT = textwrap.dedent("""
    import json
    from shardserve.runtime import LLM, SamplingParams
    print("script ran", flush=True)
    llm = LLM({folder!r}, device="cpu", kv_cache_memory_bytes={kv_bytes}, block_size=4, tensor_parallel_size=2,
              distributed_executor_backend="mp")
    outputs = llm.generate([{{"prompt_token_ids": p}} for p in {prompts!r}],
                           SamplingParams(temperature=0.0, max_tokens={max_tokens}))
    print(json.dumps([o.outputs[0].token_ids for o in outputs]))
    llm.shutdown()
""")


@pytest.fixture(scope="module")
def engine_script(checkpoint_factory, kv_bytes_for):
    """(script text, the single-rank greedy tokens it must print)."""
    folder, _ = checkpoint_factory("llama3")
    kv_bytes = kv_bytes_for(folder, 64, 4)
    with LLM(folder, device="cpu", kv_cache_memory_bytes=kv_bytes, block_size=4) as llm:
        expected = token_outputs(llm, PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return SCRIPT.format(folder=folder, kv_bytes=kv_bytes, prompts=PROMPTS, max_tokens=MAX_TOKENS), expected


def script_env() -> dict[str, str]:
    """This process's import path, so the script and its ranks import the same shardserve."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}


def check_run(result: subprocess.CompletedProcess, expected: list[list[int]]) -> None:
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines.count("script ran") == 1, result.stdout  # no rank ran the caller's main again
    assert json.loads(lines[-1]) == expected


@pytest.mark.slow
def test_tensor_parallel_from_standard_input(engine_script):
    script, expected = engine_script
    result = subprocess.run([sys.executable, "-"], input=script, env=script_env(), capture_output=True, text=True,
                            timeout=TIMEOUT_SECONDS)
    check_run(result, expected)


@pytest.mark.slow
def test_tensor_parallel_from_a_file_without_main_guard(engine_script, tmp_path):
    script, expected = engine_script
    path = tmp_path / "no_guard.py"
    path.write_text(script)
    result = subprocess.run([sys.executable, str(path)], env=script_env(), capture_output=True, text=True,
                            timeout=TIMEOUT_SECONDS)
    check_run(result, expected)


@pytest.mark.slow
def test_rank_ignores_sigint_and_reports_its_failure(checkpoint_factory):
    folder, _ = checkpoint_factory("llama3")
    with LLM(folder, device="cpu", kv_cache_memory_bytes=2**22, tensor_parallel_size=2,
             distributed_executor_backend="mp") as llm:
        executor = llm.engine.executor
        pids = [handle.process.pid for handle in executor.handles]
        assert sorted(rank_pids()) == sorted(pids)
        for pid in pids:
            os.kill(pid, signal.SIGINT)
        time.sleep(0.5)
        executor.check_health()
        with pytest.raises(EngineDeadError, match=r"(?s)rank \d failed:\nTraceback.*TypeError"):
            executor.initialize_kv_cache("many")
    assert rank_pids() == []
