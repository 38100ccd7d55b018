"""Plans from service targets: the fewest GPUs that meet them, refusals that say what would, --recommend,
and the workload settings' round trip through plan, plan file, profile and launch."""

import math

import pytest

from shardserve.planner import InfeasibleError, PlanError, load_model, make_plan, parse_declared
from shardserve.planner.options import PlanOptions
from shardserve.planner.plan_file import PlanFile
from shardserve.planner.settings import SettingError

from tests.planner.factories import plan_for

LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"
LLAMA_70B = "meta-llama/Llama-3.1-70B-Instruct"
SERVICE = dict(input_len=2000, output_len=300, ttft_ms=500, tpot_ms=30)


def test_fewest_gpus_that_meet_the_targets():
    light = plan_for(LLAMA_8B, "8xH100-80GB", request_rate=10, **SERVICE)
    heavy = plan_for(LLAMA_8B, "8xH100-80GB", request_rate=40, **SERVICE)
    for plan in (light, heavy):
        e = plan.chosen.estimates
        assert e.ttft_ms <= 500 and e.tpot_ms <= 30 and not e.is_overloaded
        assert e.max_request_rate >= e.workload.request_rate
    assert light.chosen.layout.num_gpus < heavy.chosen.layout.num_gpus <= 8
    # one GPU fewer misses: the same shape with one replica less cannot hold the rate
    fewer = [c for c in heavy.search.candidates() if c.is_feasible
             and c.layout.num_gpus < heavy.chosen.layout.num_gpus]
    assert fewer and all(not c.estimates.meets(heavy.search.targets) for c in fewer)
    assert any(line.startswith("targets: TTFT <= 500 ms and TPOT <= 30 ms at p50") for line in heavy.rationale)
    assert heavy.record().estimates.workload.request_rate == 40


def test_a_tight_tpot_takes_tensor_parallel():
    loose = plan_for(LLAMA_70B, "8xH100-80GB", concurrency=16, tpot_ms=60, ttft_ms=2000)
    tight = plan_for(LLAMA_70B, "8xH100-80GB", concurrency=16, tpot_ms=20, ttft_ms=2000)
    assert tight.chosen.layout.tensor_parallel_size > loose.chosen.layout.tensor_parallel_size
    assert tight.chosen.estimates.tpot_ms <= 20


def test_refusal_names_the_nearest_miss_and_the_fixes():
    with pytest.raises(InfeasibleError) as e:
        plan_for(LLAMA_8B, "2xH100-80GB", request_rate=40, **SERVICE)
    text = str(e.value)
    assert text.startswith("no layout on 2xH100-80GB meets TTFT <= 500 ms and TPOT <= 30 ms (p50) at "
                           "2000 in / 300 out, 40 req/s: the nearest, tp=")
    assert "GPUs would meet them (" in text and "--recommend plans it" in text
    assert "--kv-cache-dtype fp8" not in text or "would meet them" in text


def test_refusal_when_nothing_meets_even_on_more_gpus():
    with pytest.raises(InfeasibleError, match=r"has TPOT [\d.]+ ms > 0.5 ms"):
        plan_for(LLAMA_8B, "8xH100-80GB", concurrency=4, tpot_ms=0.5)


def test_recommend_plans_the_fewest_gpus_of_the_type():
    plan = make_plan(load_model(LLAMA_70B), parse_declared("8xH100-80GB"),
                     PlanOptions(request_rate=20, **SERVICE), recommend=True)
    e, layout = plan.chosen.estimates, plan.chosen.layout
    assert e.meets(plan.search.targets) and plan.hardware.total_gpus >= layout.num_gpus
    assert plan.rationale[1].startswith(f"recommend: {plan.hardware.describe()}")
    # a smaller deployment of the winning shape misses
    smaller = [c for c in plan.search.candidates() if c.is_feasible and c.layout.num_gpus < layout.num_gpus]
    assert all(not c.estimates.meets(plan.search.targets) for c in smaller)
    with pytest.raises(PlanError, match="--recommend needs a load"):
        make_plan(load_model(LLAMA_8B), parse_declared("H100-80GB"), PlanOptions(concurrency=4), recommend=True)
    by_users = make_plan(load_model(LLAMA_70B), parse_declared("8xH100-80GB"),
                         PlanOptions(concurrency=64, tpot_ms=25), recommend=True)
    assert by_users.chosen.estimates.tpot_ms <= 25


def test_a_load_beyond_what_recommend_plans_says_how_many_gpus_it_takes():
    """300 req/s of 70B, 2,000 in / 30 out, within TTFT 500 ms / TPOT 30 ms: as many replicas of the shape that
    serves 20 req/s best as the rate each holds within the targets asks, past the 16 nodes --recommend plans."""
    hw, service = parse_declared("8xH100-80GB"), {**SERVICE, "output_len": 30}
    twenty = make_plan(load_model(LLAMA_70B), hw, PlanOptions(request_rate=20, **service), recommend=True)
    layout = twenty.chosen.layout
    replicas = math.ceil(300 / (twenty.chosen.estimates.max_request_rate / layout.data_parallel_size))
    said = (f"takes {replicas} replicas of tp {layout.tensor_parallel_size} x pp {layout.pipeline_parallel_size}: "
            f"{replicas * layout.gpus_per_replica:,} H100-80GB ({math.ceil(replicas * layout.gpus_per_replica / 8)} "
            "nodes of 8), more than the 16 nodes --recommend plans")
    with pytest.raises(InfeasibleError) as e:  # (exit 2, as every refusal)
        make_plan(load_model(LLAMA_70B), hw, PlanOptions(request_rate=300, **service), recommend=True)
    assert said in str(e.value)
    with pytest.raises(InfeasibleError) as e:  # the refusal on 8 GPUs says the same
        plan_for(LLAMA_70B, "8xH100-80GB", request_rate=300, **service)
    assert said in str(e.value)


def test_a_rate_beyond_the_api_process_is_refused_whatever_the_gpus():
    """One API process serves every replica: its CPU time a request (1.1 ms) and a streamed token (0.065 ms,
    planner/perf_tables.py) bound the deployment at 1000 / (1.1 + 300 x 0.065) = 48.5 req/s of 300 tokens, which
    no number of GPUs raises; below it, replicas do."""
    bound = 1000 / (1.1 + 300 * 0.065)
    said = f"the API process keeps up with {bound:.3g} req/s at 300 streamed tokens each"
    with pytest.raises(InfeasibleError) as e:
        make_plan(load_model(LLAMA_8B), parse_declared("8xH100-80GB"), PlanOptions(request_rate=60, **SERVICE),
                  recommend=True)
    assert said in str(e.value) and "so no number of GPUs serves more" in str(e.value)
    with pytest.raises(InfeasibleError) as e:
        plan_for(LLAMA_8B, "8xH100-80GB", request_rate=60, **SERVICE)
    assert "(the API process's bound)" in str(e.value) and said in str(e.value) and "GPUs would meet" not in str(e.value)
    over = plan_for(LLAMA_8B, "8xH100-80GB", request_rate=60, input_len=2000, output_len=300)  # no targets
    e = over.chosen.estimates
    assert e.is_overloaded and e.api_max_request_rate == pytest.approx(bound)
    assert e.output_tokens_per_s == pytest.approx(bound * 300) and e.max_request_rate == pytest.approx(bound)
    assert any("one API process serves every replica, so no number of them keeps up" in w for w in over.warnings)
    assert over.record().estimates.api_max_request_rate == pytest.approx(bound, abs=0.01)
    assert not plan_for(LLAMA_8B, "8xH100-80GB", request_rate=40, input_len=2000, output_len=300
                        ).chosen.estimates.is_overloaded


def test_recommend_names_no_more_nodes_than_the_chosen_layout_fills():
    """The count of GPUs tries each shape at its default step budget and expert placement; the search
    then tries others, and DeepSeek-V3's chosen layout (expert parallel) needs 16 H200s, not 40."""
    plan = make_plan(load_model("deepseek-ai/DeepSeek-V3"), parse_declared("H200"), PlanOptions(
        request_rate=10, input_len=1000, output_len=300, ttft_ms=2000, tpot_ms=60), recommend=True)
    layout = plan.chosen.layout
    assert plan.hardware.describe() == "2x8xH200" and layout.num_gpus == 16 and plan.chosen.expert_parallel
    assert not any("left idle" in w for w in plan.warnings)
    assert plan.rationale[1].startswith("recommend: 2x8xH200 is the least H200 hardware that meets the targets")


@pytest.mark.parametrize("options, message", [
    (dict(concurrency=4, request_rate=2), "concurrency and request_rate both given"),
    (dict(input_len=7000, output_len=2000, max_model_len=8192), "is beyond max_model_len 8192"),
    (dict(input_len=100, prefix_len=100), "prefix_len 100 must be below input_len 100"),
    (dict(ttft_ms=200), "latency targets need the load they hold at"),
])
def test_bad_workloads_are_refused_by_name(options, message):
    with pytest.raises((PlanError, SettingError), match=message):
        plan_for(LLAMA_8B, "H100-80GB", **options)


def test_without_targets_the_objective_is_said_and_full_batches_used():
    plan = plan_for(LLAMA_8B, "H100-80GB")
    w = plan.chosen.estimates.workload
    assert (w.input_len, w.output_len) == (1024, 256) and w.concurrency > 1
    assert any(line.startswith("objective: the most output tokens/s for 1024 in / 256 out") for line in plan.rationale)
    small = plan_for("Qwen/Qwen3-0.6B", "H100-80GB", max_model_len=512)
    assert (small.chosen.estimates.workload.input_len, small.chosen.estimates.workload.output_len) == (384, 128)


def test_the_service_settings_round_trip_through_the_plan_file():
    plan = plan_for(LLAMA_8B, "8xH100-80GB", request_rate=12, prefix_len=200, target_percentile=90, **SERVICE)
    record = PlanFile.from_dict(plan.to_dict(), "plan.yaml")
    s = record.service
    assert (s.input_len, s.output_len, s.prefix_len, s.request_rate, s.ttft_ms, s.tpot_ms,
            s.target_percentile) == (2000, 300, 200, 12.0, 500.0, 30.0, 90)
    assert record.estimates.workload.percentile == 90
    bad = plan.to_dict()
    bad["service"]["target_percentile"] = 42
    with pytest.raises(PlanError, match="service.target_percentile: target_percentile=42 must be one of"):
        PlanFile.from_dict(bad, "plan.yaml")


def test_a_rate_beyond_the_layout_is_overloaded_not_served():
    """Without targets the plan is made but says the load outruns it: TTFT unbounded (null in the plan
    file), the tokens/s its full batches serve, and how many replicas would keep up (and fewer would not)."""
    work = dict(input_len=2000, output_len=300)
    plan = plan_for(LLAMA_8B, "H100-80GB", request_rate=40, **work)
    e = plan.chosen.estimates
    full = plan_for(LLAMA_8B, "H100-80GB", concurrency=512, **work).chosen.estimates  # queued, never overloaded
    assert e.is_overloaded and e.ttft_ms == math.inf and e.output_tokens_per_s < 40 * 300
    assert e.output_tokens_per_s == pytest.approx(full.output_tokens_per_s, rel=1e-3)
    assert e.tpot_ms == pytest.approx(full.tpot_ms, rel=1e-3)
    record = PlanFile.from_dict(plan.to_dict(), "plan.yaml")
    assert record.estimates.ttft_ms is None and record.estimates.output_tokens_per_s < 40 * 300
    replicas = math.ceil(40 / (e.output_tokens_per_s / 300))
    said = [w for w in plan.warnings if w.startswith(f"overloaded: serves at most {e.output_tokens_per_s / 300:.3g} "
                                                     "of the 40 req/s asked for")]
    assert len(said) == 1 and f"{replicas} replicas of tp 1 x pp 1 ({replicas} GPUs) would keep up" in said[0]
    assert not plan_for(LLAMA_8B, f"{replicas}xH100-80GB", request_rate=40, **work).chosen.estimates.is_overloaded
    assert plan_for(LLAMA_8B, f"{replicas - 1}xH100-80GB", request_rate=40, **work).chosen.estimates.is_overloaded


def test_the_nearest_miss_of_overloaded_layouts_serves_the_most():
    """Every layout on 8 H100s is overloaded at 20 req/s of 70B: the refusal names the one that serves the
    most, with what it serves, not one that happens to use the fewest GPUs."""
    search_plan = plan_for(LLAMA_70B, "8xH100-80GB", request_rate=20, input_len=2000, output_len=300)
    most = max((c for c in search_plan.search.candidates() if c.is_feasible),
               key=lambda c: c.estimates.output_tokens_per_s)
    with pytest.raises(InfeasibleError) as e:
        plan_for(LLAMA_70B, "8xH100-80GB", request_rate=20, **SERVICE)
    assert f"the nearest, {most.layout}, has " in str(e.value)
    assert "overloaded: serves at most" in str(e.value) and "TTFT grows without bound" in str(e.value)


def test_an_equal_layout_lost_on_headroom_says_so():
    """At a rate both keep up with, tp 8 x 4 and tp 4 x 8 serve the same tokens/s on 32 H100s: the plan
    takes the one that holds the higher rate within the targets, and the other's reason says so."""
    plan = plan_for(LLAMA_70B, "4x8xH100-80GB", request_rate=20, **SERVICE)
    other = [a for a in plan.alternatives if a["why_not"].startswith("meets the targets on as many GPUs")]
    assert other and all(f"(the plan {plan.chosen.estimates.max_request_rate:,.2f})" in a["why_not"] for a in other)


def test_launch_reads_the_service_settings_back():
    from shardserve.launch.launcher import plan_settings

    plan = plan_for(LLAMA_8B, "8xH100-80GB", concurrency=32, tpot_ms=25)
    settings = plan_settings(plan.record())
    assert settings["concurrency"] == 32 and settings["tpot_ms"] == 25 and settings["input_len"] == 1024


def test_a_tpot_target_under_a_closed_loop_caps_the_batch():
    """512 users on one H100: no layout meets TPOT 12 ms with 256 running, a cap of 32 does (the rest
    queue); the plan records the cap and sizes its KV cache for it."""
    plan = plan_for(LLAMA_8B, "H100-80GB", concurrency=512, tpot_ms=12, ttft_ms=60000)
    settings, e = plan.chosen.settings, plan.chosen.estimates
    assert settings.max_num_seqs < 256 and e.tpot_ms <= 12
    assert plan.record().runtime.max_num_seqs == settings.max_num_seqs
    assert any(line.startswith(f"max_num_seqs {settings.max_num_seqs} (not 256)") for line in plan.rationale)
    full = plan_for(LLAMA_8B, "H100-80GB", max_num_seqs=settings.max_num_seqs)
    assert plan.record().memory.kv_cache_tokens == full.record().memory.kv_cache_tokens
    uncapped = plan_for(LLAMA_8B, "H100-80GB", concurrency=512, ttft_ms=60000)
    assert uncapped.chosen.settings.max_num_seqs == 256


@pytest.mark.parametrize("model, hardware, options", [
    (LLAMA_8B, "H100-80GB", {}),
    (LLAMA_70B, "8xH100-80GB", dict(request_rate=4, **SERVICE)),
    ("Qwen/Qwen3-30B-A3B", "4xA10G", dict(concurrency=32)),
    ("Qwen/Qwen2.5-14B-Instruct", "3xL4", dict(kv_cache_dtype="fp8")),
    (LLAMA_8B, "H100-80GB", dict(concurrency=512, tpot_ms=12, ttft_ms=60000)),
    (LLAMA_8B, "H100-80GB", dict(request_rate=100, input_len=2000, output_len=300)),  # overloaded
])
def test_the_plan_file_alone_predicts_what_the_plan_did(model, hardware, options):
    """plan = launch: launch re-makes the speed model from the plan file (and the model) alone."""
    from shardserve.planner.replay import predict
    from shardserve.planner.workload import Workload

    plan = plan_for(model, hardware, **options)
    record = PlanFile.from_dict(plan.to_dict(), "plan.yaml")
    w = record.estimates.workload
    again = predict(record, plan.model, Workload(w.input_len, w.output_len, w.prefix_len, w.concurrency,
                                                 w.request_rate, w.percentile))
    e = plan.chosen.estimates
    for name in ("ttft_ms", "tpot_ms", "output_tokens_per_s", "max_request_rate", "decode_tokens_per_s_batch1"):
        assert getattr(again, name) == pytest.approx(getattr(e, name), rel=1e-3), name


def test_the_step_budget_is_searched_when_the_targets_need_it():
    """70B on two H100s has little room for KV: a 2,048-token step budget leaves enough for 26 requests
    to run at once within TTFT 1 s; vLLM's 8,192 queues some of them past it."""
    kw = dict(input_len=1000, output_len=200, concurrency=26, max_model_len=4096)
    plan = plan_for(LLAMA_70B, "2xH100-80GB", ttft_ms=1000, **kw)
    assert plan.chosen.settings.max_num_batched_tokens < 8192 and plan.chosen.estimates.ttft_ms <= 1000
    assert plan.record().runtime.max_num_batched_tokens == plan.chosen.settings.max_num_batched_tokens
    assert any(line.startswith(f"max_num_batched_tokens {plan.chosen.settings.max_num_batched_tokens} (not 8192)")
               for line in plan.rationale)
    assert plan_for(LLAMA_70B, "2xH100-80GB", **kw).chosen.settings.max_num_batched_tokens == 8192  # no targets
    with pytest.raises(InfeasibleError, match="TTFT"):  # pinned, it is not searched
        plan_for(LLAMA_70B, "2xH100-80GB", ttft_ms=1000, max_num_batched_tokens=8192, **kw)
