"""The speed model's parts against hand-computed cases: tables, the roofline, batching, queueing."""

import math

import pytest

from shardserve.planner.calibration import calibration_path, write_calibration
from shardserve.planner import load_model
from shardserve.planner.hardware import GpuSpec
from shardserve.planner.operators import Chunk, Operators
from shardserve.planner.perf_tables import Database, Table, load_database, roofline_fit
from shardserve.planner.serving import Replica
from shardserve.planner.workload import Targets, Workload

GEMM = Table(("m", "n", "k"), ((1, 4), (8,), (8,)), (1.0, 4.0))
A10G = GpuSpec.from_catalog("A10G")


def test_table_points_interpolation_and_extrapolation():
    assert GEMM.lookup(m=1, n=8, k=8) == pytest.approx(1.0)
    assert GEMM.lookup(m=4, n=8, k=8) == pytest.approx(4.0)
    assert GEMM.lookup(m=2, n=8, k=8) == pytest.approx(2.0)  # halfway on log axes: the geometric mean
    assert GEMM.lookup(m=16, n=8, k=8) == pytest.approx(16.0)  # past the grid: linear in m
    assert GEMM.lookup(m=8, n=16, k=32) == pytest.approx(8.0 * 2 * 4)
    assert GEMM.lookup(m=0.5, n=8, k=8) == pytest.approx(1.0)  # below it: the launch floor


def test_table_answers_none_where_nothing_near_was_measured():
    holes = Table(("m", "n", "k"), ((1, 4), (8,), (8,)), (None, 4.0))
    assert holes.lookup(m=1, n=8, k=8) is None
    assert holes.lookup(m=3.9, n=8, k=8) == pytest.approx(4.0)  # the measured corner dominates


def test_shipped_tables_cover_the_measured_gpus():
    h100 = load_database("H100-80GB")
    assert {"gemm.bfloat16", "gemm.fp8", "prefill_attention.bfloat16", "decode_attention.bfloat16",
            "allreduce"} <= set(h100.tables)
    assert "aiconfigurator-core" in h100.sources[0] and "Apache-2.0" in h100.sources[0]
    # a big bf16 GEMM runs at a plausible share of the H100's 989 TFLOP/s
    ms = h100.lookup("gemm.bfloat16", m=8192, n=8192, k=8192)
    assert 0.5 < 2 * 8192**3 / (ms * 1e-3) / 989e12 < 1.0
    assert not load_database("A10G").is_measured


def test_roofline_where_no_table_answers():
    fit = roofline_fit()
    ops = Operators(A10G, Database("A10G", ()), A10G.link_bytes_per_s)
    # batch-1 decode GEMM: memory-bound on the weights
    weights = 4096 * 4096 * 2
    memory_ms = (weights + (4096 + 4096) * 2) / (A10G.hbm_bytes_per_s * fit["gemm_memory"]) * 1e3
    assert ops.gemm(1, 4096, 4096, "bfloat16", 16) == pytest.approx(memory_ms + fit["floor_ms"])
    # a large GEMM: compute-bound
    compute_ms = 2 * 8192**3 / (A10G.bf16_flops * fit["gemm_compute"]) * 1e3
    assert ops.gemm(8192, 8192, 8192, "bfloat16", 16) == pytest.approx(compute_ms + fit["floor_ms"])
    # int4 weights read a quarter of the bytes at small m
    assert ops.gemm(1, 4096, 4096, "bfloat16", 4) < 0.5 * ops.gemm(1, 4096, 4096, "bfloat16", 16)
    ring = 2 * 1 / 2 * 2**20 / (A10G.link_bytes_per_s * fit["allreduce_link"]) * 1e3
    assert ops.allreduce(2**20, 2) == pytest.approx(fit["allreduce_floor_ms"] + ring)
    assert ops.allreduce(2**20, 1) == 0.0


def test_prefill_chunk_does_its_share_of_the_causal_work():
    ops = Operators(A10G, Database("A10G", ()), A10G.link_bytes_per_s)
    whole = ops.prefill_attention(4096, 4096, 32, 128, "bfloat16") - roofline_fit()["floor_ms"]
    second_half = ops.prefill_attention(2048, 4096, 32, 128, "bfloat16") - roofline_fit()["floor_ms"]
    assert second_half == pytest.approx(whole * 0.75)  # (4096^2 - 2048^2) / 4096^2


def _replica(per_token_ms=0.01, base_ms=10.0, **kw) -> Replica:
    """A replica whose step costs base_ms plus per_token_ms for each token it computes."""
    def cycle(b, chunks, context, drafts=0):
        return base_ms + per_token_ms * (b + drafts + sum(c.tokens for c in chunks))
    return Replica(cycle, kw.get("max_num_seqs", 256), kw.get("max_num_batched_tokens", 8192),
                   kw.get("kv_cache_tokens", 10**6), kw.get("request_ms", 0.0),
                   scheduler_steps=kw.get("scheduler_steps", 1), mixes_prefill=kw.get("mixes_prefill", True))


def test_closed_loop_by_hand():
    r = _replica()
    w = Workload(1000, 100, concurrency=50)
    s = r.closed_loop(w)
    # per step: 50 decodes and 50 / 100 new prompts of 1000 tokens -> 10 + 0.01 * (50 + 500)
    assert s.tpot_ms == pytest.approx(10 + 0.01 * 550)
    assert s.output_tokens_per_s == pytest.approx(50 / s.tpot_ms * 1e3)
    # the first token: the prompt's own step (50 decodes beside its 1000 tokens), no wait in a closed loop
    assert s.ttft_ms == pytest.approx(10 + 0.01 * 1050)


def test_prompts_in_steps_of_their_own_by_hand():
    """An engine that does not mix (SGLang's default): a prompt's step runs alone (one decode token)
    while the decodes wait, and prompts arriving in the same cycle share one step."""
    r = _replica(mixes_prefill=False, max_num_seqs=512)
    s = r.closed_loop(Workload(1000, 100, concurrency=50))  # half a prompt per cycle: a step each
    prompt_step = 10 + 0.01 * (1 + 1000)
    assert s.tpot_ms == pytest.approx(10 + 0.01 * 50 + 0.5 * prompt_step)
    assert s.ttft_ms == pytest.approx(prompt_step)
    s = r.closed_loop(Workload(1000, 100, concurrency=400))  # 4 prompts per cycle share one step
    shared = 10 + 0.01 * (1 + 4000)
    assert s.tpot_ms == pytest.approx(10 + 0.01 * 400 + shared)
    assert s.ttft_ms == pytest.approx(shared)
    mixed = _replica(max_num_seqs=512).closed_loop(Workload(1000, 100, concurrency=50))
    assert mixed.tpot_ms < r.closed_loop(Workload(1000, 100, concurrency=50)).tpot_ms
    s = r.open_loop(Workload(500, 200, request_rate=20))  # 20/s x a 15.01 ms step of its own each
    decode = 10 + 0.01 * math.ceil(s.batch)
    assert s.tpot_ms == pytest.approx(decode / (1 - 20 / 1e3 * (10 + 0.01 * 501)), rel=1e-3)


def test_closed_loop_queues_past_max_num_seqs_and_the_kv_cache():
    w = Workload(1000, 100, concurrency=100)
    s = _replica(max_num_seqs=50).closed_loop(w)
    alone = _replica(max_num_seqs=50).closed_loop(Workload(1000, 100, concurrency=50))
    assert s.tpot_ms == pytest.approx(alone.tpot_ms)
    # 50 wait for a whole request lifetime of the 50 running
    assert s.ttft_ms == pytest.approx(alone.ttft_ms * 2 + 99 * alone.tpot_ms)
    assert _replica(kv_cache_tokens=1050 * 10).max_running(w) == pytest.approx(10)


def test_open_loop_is_littles_law():
    r = _replica(request_ms=5.0)
    s = r.open_loop(Workload(500, 200, request_rate=20))
    assert not s.is_overloaded
    assert s.batch == pytest.approx(20 / 1e3 * (s.ttft_ms + 199 * s.tpot_ms), rel=1e-2)
    assert s.output_tokens_per_s == pytest.approx(20 * 200)
    assert s.ttft_ms > 5.0 + 10 + 0.01 * 500  # the server, the prompt's own step and a wait for a step


def test_open_loop_overload_and_the_highest_rate():
    r = _replica(max_num_seqs=64)
    w = Workload(500, 200)
    assert r.open_loop(w.with_rate(1000)).is_overloaded
    meets = Targets(tpot_ms=14.0)
    best = r.max_request_rate(w, lambda s: not meets.misses(s.ttft_ms, s.tpot_ms))
    assert best > 0
    assert r.open_loop(w.with_rate(best * 0.98)).tpot_ms <= 14.0
    assert r.open_loop(w.with_rate(best * 1.05)).tpot_ms > 14.0 or r.open_loop(w.with_rate(best * 1.05)).is_overloaded


def test_an_overloaded_replica_serves_its_full_batch_by_hand():
    """1,000 req/s of 500 in / 200 out outrun a replica of 64: it runs full, a prompt admitted as a
    request finishes, and serves what that batch does while its queue, and TTFT, grow without bound."""
    r = _replica(max_num_seqs=64)
    s = r.open_loop(Workload(500, 200, request_rate=1000))
    step = 10 + 0.01 * (64 + 64 / 200 * 500)  # 64 decodes and 64 / 200 prompts of 500 tokens a step
    assert s.is_overloaded and s.ttft_ms == math.inf and s.batch == 64
    assert s.tpot_ms == pytest.approx(step)
    assert s.output_tokens_per_s == pytest.approx(64 / step * 1e3)  # 5,229 of the 200,000 asked for
    # below the highest rate it holds it serves what is asked; above it, what its full batch does
    top = r.max_request_rate(Workload(500, 200), lambda s: True)
    under, over = (r.open_loop(Workload(500, 200, request_rate=top * f)) for f in (0.99, 1.2))
    assert not under.is_overloaded and under.output_tokens_per_s == pytest.approx(top * 0.99 * 200)
    assert over.is_overloaded and over.output_tokens_per_s == pytest.approx(s.output_tokens_per_s)
    assert over.output_tokens_per_s < top * 1.2 * 200


def test_open_loop_by_hand():
    """Prompts arriving at `rate` take rate x (their prefill's extra step time) of every second:
    a decode step stretches to decode / (1 - that share)."""
    r = _replica()
    s = r.open_loop(Workload(500, 200, request_rate=20))
    decode = 10 + 0.01 * math.ceil(s.batch)
    assert s.tpot_ms == pytest.approx(decode / (1 - 20 / 1e3 * 0.01 * 500), rel=1e-3)


def test_a_run_of_decode_steps_between_schedules_delays_the_first_token():
    """Scheduling once every 10 decode steps (vLLM 0.6's multi-step): a prompt step's share of the
    time is rate x its length; the rest is runs of 10 decode steps, L long. The median arrival waits
    past the prompt steps, where the fraction still waiting is (1 - share) (1 - x / L) = 0.5."""
    s = _replica(scheduler_steps=10).open_loop(Workload(500, 200, request_rate=20))
    b = math.ceil(s.batch)
    prompt_step, run = 10 + 0.01 * (b + 500), 10 * (10 + 0.01 * b)
    share = 20 / 1e3 * prompt_step
    assert s.ttft_ms == pytest.approx(prompt_step + run * (1 - 0.5 / (1 - share)), rel=1e-3)
    every_step = _replica().open_loop(Workload(500, 200, request_rate=20))
    assert s.ttft_ms - every_step.ttft_ms > 20  # a run of 10 steps, not one, to wait for


def test_prefill_time_bounds_the_rate():
    """5,000-token prompts take 50 ms of prefill each: 25 a second need 1.25 s of every second, an
    overload although each fits the step budget."""
    r = _replica()
    assert r.open_loop(Workload(5000, 20, request_rate=25)).is_overloaded
    assert not r.open_loop(Workload(5000, 20, request_rate=10)).is_overloaded
    assert r.max_request_rate(Workload(5000, 20), lambda s: True) < 1e3 / 50


def test_the_wait_for_the_step_in_progress():
    from shardserve.planner.serving import _residual_wait
    assert _residual_wait(0.5, [(0.5, 10.0)]) == 0.0  # half the arrivals find the replica idle
    assert _residual_wait(0.9, [(0.5, 10.0)]) == pytest.approx(8.0)  # 0.5 * (1 - x / 10) = 0.1
    # a rare long step (a prompt's) sets the tail: 2% of the time in 100 ms steps, the rest in 10 ms ones
    assert _residual_wait(0.99, [(0.02, 100.0), (0.98, 10.0)]) == pytest.approx(50.0, rel=1e-3)


def test_percentiles_follow_md1_queueing():
    """At p50 a lightly loaded prefill queue adds nothing; p99 waits past the mean."""
    r = _replica(max_num_batched_tokens=2048)
    p50 = r.open_loop(Workload(1500, 50, request_rate=20, percentile=50))
    p99 = r.open_loop(Workload(1500, 50, request_rate=20, percentile=99))
    assert p99.ttft_ms > p50.ttft_ms
    assert p99.tpot_ms == pytest.approx(p50.tpot_ms, rel=1e-2)  # the same steps; a longer TTFT runs a few more


def test_chunks_cover_the_uncached_prompt():
    r = _replica(max_num_batched_tokens=1000)
    chunks = r._chunks(200, Workload(3000, 10, prefix_len=500))
    assert [c.tokens for c in chunks] == [800, 800, 800, 100]
    assert chunks[-1] == Chunk(100, 3000) and chunks[0].end == 1300


def test_targets_wording():
    t = Targets(ttft_ms=500, tpot_ms=30)
    assert t.misses(620, 20) == ["TTFT 620 ms > 500 ms"]
    assert t.shortfall(620, 15) == pytest.approx(1.24)
    assert math.isclose(Targets().shortfall(1e9, 1e9), 1.0)


def test_shipped_data_is_in_the_calibration_format():
    """One format for shipped measurements and `shardserve calibrate`'s (planner/calibration.py)."""
    from shardserve.planner.calibration import CalibrationError, check_calibration
    from shardserve.planner.perf_tables import PERFDATA, _shipped

    names = [p.name.removesuffix(".json.gz") for p in PERFDATA.glob("*.json.gz")]
    assert {"h100-80gb", "h200", "b200", "a100-80gb", "l40s"} <= set(names)
    for name in names:
        check_calibration(_shipped(name), name)
    with pytest.raises(CalibrationError, match="unknown table"):
        check_calibration({"gpu": "X", "source": "s", "tables": {"moe.bfloat16@2048": {}}}, "f")


def test_a_measured_moe_shape_takes_the_fused_layer_time():
    """Qwen3-30B-A3B's shape was measured on the H100 as vLLM's fused MoE layer; a shape that was not
    falls back to grouped GEMMs."""
    from dataclasses import replace

    from shardserve.planner.model_source import load_model
    from shardserve.planner.operators import StageShape, _moe_mlp_ms

    spec = load_model("Qwen/Qwen3-30B-A3B").spec
    h100 = load_database("H100-80GB")
    ops = Operators(GpuSpec.from_catalog("H100-80GB"), h100, 450e9)
    shape = StageShape(spec, 2, False, 1, 1, 0, False, False, "bfloat16", 16, 2, "bfloat16", 2, 16)
    table = h100.tables["moe.bfloat16@2048x768x8x128"]
    assert _moe_mlp_ms(ops, shape, 64) == pytest.approx(table.lookup(tp=2, ep=1, num_tokens=64))
    odd = replace(spec, moe_intermediate_size=640)  # no such shape was measured
    assert _moe_mlp_ms(ops, replace(shape, spec=odd), 64) > 0


def test_an_eager_step_waits_for_its_host_to_issue_every_layer(monkeypatch, tmp_path):
    """Without CUDA graphs (--enforce-eager, LoRA, a step carrying a prompt) a GPU step takes the longer
    of its kernels and the host's issue of them, layer by layer; a CPU's one thread does both in turn."""
    from shardserve.planner.perf_tables import DEFAULT_HOST
    from tests.planner.factories import plan_for

    llama, work = "meta-llama/Llama-3.1-8B-Instruct", {"input_len": 1024, "output_len": 256}
    graphs, eager = (plan_for(llama, "H100-80GB", concurrency=1, enforce_eager=flag, **work).chosen.estimates
                     for flag in (False, True))
    issue_ms = 32 * DEFAULT_HOST.eager_layer_ms + DEFAULT_HOST.ms(1)  # 32 layers; above the 8B's ~6 ms of kernels
    assert graphs.decode_tokens_per_s_batch1 > 1e3 / issue_ms
    assert eager.decode_tokens_per_s_batch1 == pytest.approx(1e3 / issue_ms, rel=1e-3)
    lora = plan_for(llama, "H100-80GB", concurrency=1, enable_lora=True, **work).chosen.estimates
    assert lora.decode_tokens_per_s_batch1 <= eager.decode_tokens_per_s_batch1  # LoRA steps run eagerly too
    # with graphs too, a step that carries a prompt runs eagerly (the runtime graphs decode-only steps)
    from shardserve.planner.replay import replica_of
    replica = replica_of(plan_for(llama, "H100-80GB", concurrency=1, **work).record(), load_model(llama))
    assert replica.cycle_ms(1, (Chunk(8, 8),), 8) == pytest.approx(issue_ms, rel=1e-3)
    full = [plan_for(llama, "H100-80GB", concurrency=256, enforce_eager=flag, **work).chosen.estimates
            for flag in (False, True)]
    assert full[1].output_tokens_per_s == pytest.approx(full[0].output_tokens_per_s)  # the kernels take longer
    # a CPU: the layers' dispatch adds to the tables' operators (a calibration says how much)
    demo = {"max_model_len": 1024, "kv_cache_memory_bytes": 1 << 28, "concurrency": 1, "input_len": 128,
            "output_len": 64}
    step_ms = []
    for eager_layer_ms in (0.0, 1.5):
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / str(eager_layer_ms)))
        gemm = {"axes": [["m", [1, 256]], ["n", [256]], ["k", [256]]], "ms": [0.05, 0.5]}
        write_calibration({"gpu": "CPU", "source": "test", "tables": {"gemm.float32": gemm}, "host": {
            "step_ms": 0.5, "per_request_ms": 0.0, "eager_layer_ms": eager_layer_ms}}, calibration_path("CPU"))
        step_ms.append(1e3 / plan_for("shardserve-demo", "cpu", **demo).chosen.estimates.decode_tokens_per_s_batch1)
    assert step_ms[1] - step_ms[0] == pytest.approx(4 * 1.5, rel=1e-3)  # the demo model's 4 layers


def test_a_calibrated_api_process_sets_the_deployments_bound(monkeypatch, tmp_path):
    """The API process's CPU time a request and a streamed token, as `calibrate` measured them, bound every
    replica's requests together: 1000 / (2 + 100 x 0.1) = 83.3 req/s of 100 tokens; unmeasured, the defaults."""
    from tests.planner.factories import plan_for

    demo = {"max_model_len": 1024, "kv_cache_memory_bytes": 1 << 28, "input_len": 128, "output_len": 100}
    default = plan_for("shardserve-demo", "cpu", concurrency=1, **demo).chosen.estimates
    assert default.api_max_request_rate == pytest.approx(1000 / (1.1 + 100 * 0.065))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    gemm = {"axes": [["m", [1, 256]], ["n", [256]], ["k", [256]]], "ms": [0.0001, 0.001]}  # GPUs far faster
    write_calibration({"gpu": "CPU", "source": "test", "tables": {"gemm.float32": gemm}, "host": {
        "step_ms": 0.01, "per_request_ms": 0.0, "eager_layer_ms": 0.0, "api_request_ms": 2.0, "api_token_ms": 0.1}},
        calibration_path("CPU"))
    e = plan_for("shardserve-demo", "cpu", concurrency=64, **demo).chosen.estimates
    assert e.api_max_request_rate == pytest.approx(1000 / 12) and e.is_api_bound
    assert e.output_tokens_per_s == pytest.approx(1000 / 12 * 100)
    fast = plan_for("shardserve-demo", "cpu", request_rate=50, **demo).chosen.estimates
    assert not fast.is_overloaded and fast.max_request_rate <= 1000 / 12
    slow = plan_for("shardserve-demo", "cpu", request_rate=90, **demo)
    assert slow.chosen.estimates.is_overloaded and slow.chosen.estimates.ttft_ms == math.inf
    assert any("one API process serves every replica" in w for w in slow.warnings)
