"""A rank dying mid-generation, or the engine process dying, leaves no hang and no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from shardserve.runtime import LLM, EngineDeadError, SamplingParams

from tests.processes import is_running, wait_gone

DEADLINE_SECONDS = 5.0


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp, victim", [(2, 1, 1), (1, 2, 0)], ids=["tp2-kill-rank1", "pp2-kill-first-stage"])
def test_rank_killed_mid_generation(tp, pp, victim, checkpoint_factory):
    folder, _ = checkpoint_factory("llama3")
    llm = LLM(folder, device="cpu", kv_cache_memory_bytes=2**22, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              distributed_executor_backend="mp")
    pids = [h.process.pid for h in llm.engine.executor.handles]
    for i in range(4):
        llm.engine.add_request(str(i), [5 + i] * 9, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    llm.engine.step()
    os.kill(pids[victim], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match=rf"ranks \[{victim}\] exited"):
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    assert time.monotonic() - started < DEADLINE_SECONDS
    assert wait_gone(pids, DEADLINE_SECONDS) == []
    with pytest.raises(EngineDeadError):
        llm.engine.step()
    llm.shutdown()


ENGINE_SCRIPT = textwrap.dedent("""
    import sys, time
    from shardserve.runtime import LLM
    if __name__ == "__main__":
        llm = LLM(sys.argv[1], device="cpu", kv_cache_memory_bytes=2**22, tensor_parallel_size=2,
                  distributed_executor_backend="mp")
        print(" ".join(str(h.process.pid) for h in llm.engine.executor.handles), flush=True)
        time.sleep(600)
""")


@pytest.mark.slow
def test_engine_process_killed_takes_its_ranks_along(checkpoint_factory, tmp_path):
    folder, _ = checkpoint_factory("llama3")
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    engine = subprocess.Popen([sys.executable, str(script), folder], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in engine.stdout.readline().split()]
        assert len(pids) == 2 and all(is_running(p) for p in pids)
        engine.kill()
        engine.wait()
        assert wait_gone(pids, DEADLINE_SECONDS) == []
    finally:
        engine.kill()
