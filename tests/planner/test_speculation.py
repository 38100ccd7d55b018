"""Speculative decoding in the plan: the tokens a verify step yields, the steady-state model's TPOT and throughput,
the same layout without it, the refusals the engine makes, the replay of a trace, and the exports."""

import json

import pytest
from typer.testing import CliRunner

from factories import plan_for
from shardserve.launch.cli import app
from shardserve.launch.engine_export import export_plan
from shardserve.planner import PlanError, PlanOptions
from shardserve.planner.operators import Chunk
from shardserve.planner.serving import Replica
from shardserve.planner.speculative import DEFAULT_ACCEPTANCE, acceptance_for, tokens_per_step
from shardserve.planner.trace import TraceRequest
from shardserve.planner.workload import Workload
from shardserve.runtime.core.replay import EngineShape, replay
from shardserve.runtime.core.scheduler_config import SchedulerConfig
from shardserve.planner.speculative import SpeculativeConfig

LLAMA, H100 = "meta-llama/Llama-3.1-8B-Instruct", "1xH100-80GB"
NGRAM3 = '{"method": "ngram", "num_speculative_tokens": 3}'


def test_a_verify_step_yields_the_geometric_sum():
    assert tokens_per_step(0, 0.7) == 1.0
    assert tokens_per_step(3, 0.5) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    # the stated default reproduces the measurement it is taken from: 5,376 tokens in 1,814 forwards at 5 drafts
    assert tokens_per_step(5, DEFAULT_ACCEPTANCE["ngram"]) == pytest.approx(5376 / 1814, abs=0.03)


def _replica(num_drafts=0, tokens=1.0) -> Replica:
    """A step costs 10 ms plus 0.5 ms per token it computes (drafts included)."""
    def cycle(b, chunks, context, drafts=0):
        return 10.0 + 0.5 * (b + drafts + sum(c.tokens for c in chunks))
    return Replica(cycle, 256, 8192, 10**6, num_drafts=num_drafts, tokens_per_step=tokens)


def test_tpot_is_the_verify_step_over_the_tokens_it_yields():
    w = Workload(100, 200, 0, 1.0, None, 50)
    plain, spec = _replica().speed(w), _replica(3, 2.5).speed(w)
    prefill = 10.0 + 0.5 * 101  # the prompt's step beside the one request decoding
    plain_cycle, verify = 10.5 + (prefill - 10.5) / 200, 12.0 + (prefill + 1.5 - 12.0) * 2.5 / 200
    assert plain.tpot_ms == pytest.approx(plain_cycle)
    assert spec.tpot_ms == pytest.approx(verify / 2.5)
    assert spec.output_tokens_per_s == pytest.approx(1e3 / spec.tpot_ms)


def test_drafts_take_room_from_the_step_budget():
    """A verify step's drafts are tokens of the step: a prompt beside 8 requests drafting 3 gets the rest."""
    replica = _replica(3, 2.0)
    assert [c.tokens for c in replica._chunks(8, Workload(8192, 10, 0, 1.0, None, 50))][0] == 8192 - 8 * 4
    assert replica._chunks(8, Workload(8192, 10, 0, 1.0, None, 50))[0] == Chunk(8160, 8160)


def test_the_plan_shows_the_layout_without_speculation_as_a_plan_without_it_is():
    spec = plan_for(LLAMA, H100, concurrency=4.0, enforce_eager=True, speculative_config=NGRAM3)
    plain = plan_for(LLAMA, H100, concurrency=4.0, enforce_eager=True)
    assert spec.chosen.layout == plain.chosen.layout
    section = spec.record().estimates.speculation
    assert section is not None and section.tokens_per_step == round(tokens_per_step(3, 0.7), 2)
    assert section.without.tpot_ms == round(plain.chosen.estimates.tpot_ms, 2)
    assert section.without.output_tokens_per_s == round(plain.chosen.estimates.output_tokens_per_s, 1)
    # eager steps either way: the verify step costs about a plain step, and yields 2.53 tokens
    assert spec.chosen.estimates.tpot_ms < 0.6 * plain.chosen.estimates.tpot_ms
    assert not any("speculative_config makes this plan slower" in w for w in spec.warnings)


def test_the_plan_says_when_speculation_slows_it():
    """With CUDA graphs a decode step is graph-replayed while a verify step is issued kernel by kernel: at n-gram's
    default acceptance the plan is slower with it, and says what to do."""
    plan = plan_for(LLAMA, H100, concurrency=1.0, speculative_config=NGRAM3)
    section = plan.record().estimates.speculation
    assert section is not None and plan.chosen.estimates.tpot_ms > section.without.tpot_ms
    warning = next(w for w in plan.warnings if "speculative_config makes this plan slower" in w)
    assert "without CUDA graphs" in warning and "drop --speculative-config" in warning
    # a high measured acceptance can pay for the eager step
    assert plan_for(LLAMA, H100, concurrency=1.0, speculative_config=NGRAM3,
                    draft_acceptance_rate=0.99).chosen.estimates.tpot_ms < section.without.tpot_ms


def test_what_the_engine_refuses_the_plan_refuses():
    with pytest.raises(PlanError, match="draft_acceptance_rate prices speculative decoding"):
        plan_for(LLAMA, H100, draft_acceptance_rate=0.5)
    with pytest.raises(PlanError, match="method 'medusa' .* not served yet"):
        plan_for(LLAMA, H100, speculative_config='{"method": "medusa", "num_speculative_tokens": 1}')
    with pytest.raises(PlanError, match="method eagle3 needs model"):
        plan_for(LLAMA, H100, speculative_config='{"method": "eagle3", "num_speculative_tokens": 3}')
    with pytest.raises(PlanError, match="the EAGLE-3 head /no/head: not a folder with config.json"):
        plan_for(LLAMA, H100, speculative_config='{"method": "eagle3", "model": "/no/head", "num_speculative_tokens": 3}',
                 draft_acceptance_rate=0.6)
    with pytest.raises(ValueError, match="draft_acceptance_rate"):
        PlanOptions(draft_acceptance_rate=1.0)


def test_pipeline_stages_verify_the_drafts_of_their_micro_batches():
    """pp 2: each micro-batch verifies its requests' drafts on every stage and hands them on."""
    spec = plan_for(LLAMA, "2xH100-80GB", pipeline_parallel_size=2, concurrency=8.0, enforce_eager=True,
                    speculative_config=NGRAM3)
    assert spec.chosen.layout.pipeline_parallel_size == 2
    section = spec.record().estimates.speculation
    assert section is not None and spec.chosen.estimates.tpot_ms < section.without.tpot_ms


def test_the_cli_refuses_an_acceptance_without_speculation_in_one_line():
    result = CliRunner().invoke(app, ["plan", LLAMA, "--hardware", H100, "--draft-acceptance-rate", "0.5"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "speculative_config is not set" in result.output


def _served_steps(acceptance: float, spec: SpeculativeConfig | None) -> list[float]:
    one_ms_a_step = Replica(lambda b, chunks, context, drafts=0: 1.0, 4, 256, 4096)
    shape = EngineShape(SchedulerConfig(4, 256, speculative=spec), 256, 16, True, 2048,
                        draft_acceptance_rate=acceptance)
    (served,) = replay((TraceRequest(0.0, 64, 600),), one_ms_a_step, shape)
    return served.token_times


def test_a_replayed_trace_drafts_and_accepts_at_the_rate():
    """The replay runs the engine's scheduler with its n-gram drafts; each draft is kept at the rate: a request of
    600 tokens takes about 600 / (1 + a + ... + a^k) steps of 1 ms."""
    spec = SpeculativeConfig.parse(NGRAM3)
    plain = _served_steps(0.0, None)
    assert len(plain) == 600 and plain[-1] == pytest.approx(0.600)  # the prompt's step samples the first
    times = _served_steps(0.7, spec)
    assert len(times) == 600
    steps = (times[-1] - times[0]) * 1000
    assert steps == pytest.approx(600 / tokens_per_step(3, 0.7), rel=0.08)
    assert (_served_steps(0.0, spec)[-1] - times[0]) * 1000 == pytest.approx(599)  # none kept: a step a token


def test_plan_trace_replays_with_speculation(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": i * 0.05, "input_len": 200, "output_len": 100}) + "\n"
                             for i in range(100)))
    runs = {}
    for name, extra in (("plain", []), ("spec", ["--speculative-config", NGRAM3])):
        result = CliRunner().invoke(app, ["plan", LLAMA, "--hardware", H100, "--enforce-eager", "--trace",
                                          str(trace), "--format", "json", *extra])
        assert result.exit_code == 0, result.output
        runs[name] = json.loads(result.output)["estimates"]
    spec, plain = runs["spec"]["percentiles"]["tpot_ms"]["p50"], runs["plain"]["percentiles"]["tpot_ms"]["p50"]
    assert spec < 0.7 * plain
    assert runs["spec"]["speculation"]["without"]["tpot_ms"] > spec


def test_exports_carry_speculation():
    record = plan_for(LLAMA, H100, concurrency=4.0, speculative_config=NGRAM3, draft_acceptance_rate=0.6).record()
    vllm = export_plan(record, "vllm")
    flags = dict(vllm.flags)
    assert SpeculativeConfig.parse(flags["--speculative-config"]) == SpeculativeConfig.parse(NGRAM3)
    assert any("draft_acceptance_rate 0.6" in note for note in vllm.notes)
    sglang = dict(export_plan(record, "sglang").flags)
    assert sglang["--speculative-algorithm"] == "NGRAM" and sglang["--speculative-num-draft-tokens"] == "3"
    assert not [u for u in vllm.unsupported if "speculative" in u or "draft_acceptance" in u]


QWEN, QWEN_DRAFT = "Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B"
DRAFT3 = json.dumps({"method": "draft_model", "model": QWEN_DRAFT, "num_speculative_tokens": 3})


def test_a_draft_model_takes_memory_beside_the_model_and_its_forwards_beside_each_step():
    spec = plan_for(QWEN, H100, concurrency=1.0, speculative_config=DRAFT3, draft_acceptance_rate=0.8)
    plain = plan_for(QWEN, H100, concurrency=1.0)
    draft = spec.search.draft
    assert draft is not None and draft.info.spec.id == QWEN_DRAFT
    (stage,), (plain_stage,) = spec.chosen.memory.stages, plain.chosen.memory.stages
    assert stage.weights_bytes == plain_stage.weights_bytes + draft.weights_bytes(1, "bfloat16")
    assert stage.kv_bytes_per_token == plain_stage.kv_bytes_per_token + 28 * 2 * 8 * 128 * 2  # 28 layers of 8 heads
    section = spec.record().estimates.speculation
    assert section.without.tpot_ms == round(plain.chosen.estimates.tpot_ms, 2)  # without: no draft either
    line = next(r for r in spec.rationale if r.startswith("speculative decoding"))
    assert f"the draft model {QWEN_DRAFT} takes 1.1 GiB a GPU" in line
    # the draft runs eagerly, a forward a draft: slower than the model's graphs at this rate, and said
    assert any(f"the draft model {QWEN_DRAFT} runs eagerly" in w for w in spec.warnings)


def test_a_draft_model_is_refused_as_the_engine_refuses_it():
    with pytest.raises(PlanError, match="method draft_model's acceptance depends on the pair of models"):
        plan_for(QWEN, H100, speculative_config=DRAFT3)
    with pytest.raises(PlanError, match="cannot draft here: its vocabulary has 151936 tokens, the model's 128256"):
        plan_for(LLAMA, H100, speculative_config=DRAFT3, draft_acceptance_rate=0.5)
    with pytest.raises(PlanError, match="pipeline_parallel_size above 1 is not served with it"):
        plan_for(QWEN, "2xH100-80GB", pipeline_parallel_size=2, speculative_config=DRAFT3, draft_acceptance_rate=0.5)
    with pytest.raises(PlanError, match="method draft_model with kv_offloading_size"):
        plan_for(QWEN, H100, speculative_config=DRAFT3, draft_acceptance_rate=0.5, kv_offloading_size=4.0)
    with pytest.raises(PlanError, match="the draft model no/such-model"):
        plan_for(QWEN, H100, speculative_config=DRAFT3.replace(QWEN_DRAFT, "no/such-model"), draft_acceptance_rate=0.5)


def test_exports_carry_a_draft_model():
    record = plan_for(QWEN, H100, concurrency=4.0, speculative_config=DRAFT3, draft_acceptance_rate=0.6).record()
    assert SpeculativeConfig.parse(dict(export_plan(record, "vllm").flags)["--speculative-config"]).model == QWEN_DRAFT
    sglang = dict(export_plan(record, "sglang").flags)
    assert (sglang["--speculative-algorithm"], sglang["--speculative-draft-model-path"],
            sglang["--speculative-num-steps"], sglang["--speculative-num-draft-tokens"]) == (
        "STANDALONE", QWEN_DRAFT, "3", "4")


def test_deepseeks_own_mtp_layer_is_priced_as_one_more_sparse_layer():
    """DeepSeek-V3 on 8 H200s: the MTP layer's weights (a sparse layer, its head; the embedding shared) and its MLA
    cache beside the model's 61 layers, every step eager (it reads the model's final hidden states), SGLang's EAGLE
    algorithm for the export; a model without such a layer is refused by name."""
    mtp = '{"method": "mtp", "num_speculative_tokens": 1}'
    plain = plan_for("deepseek-ai/DeepSeek-V3", "8xH200", concurrency=8.0)
    spec = plan_for("deepseek-ai/DeepSeek-V3", "8xH200", concurrency=8.0, speculative_config=mtp,
                    draft_acceptance_rate=0.8)
    assert spec.search.draft is not None
    (stage, *_), (plain_stage, *_) = spec.chosen.memory.stages, plain.chosen.memory.stages
    assert stage.kv_bytes_per_token == plain_stage.kv_bytes_per_token * 62 // 61  # one more MLA layer's latent
    extra = (stage.weights_bytes - plain_stage.weights_bytes) / 2**30
    assert 1.0 < extra < 3.0  # 256 experts of 2048 (fp8) and the 129,280-row head, over 8 ranks
    line = next(r for r in spec.rationale if r.startswith("speculative decoding"))
    assert "the MTP layer of deepseek-ai/DeepSeek-V3 takes 1.8 GiB a GPU and 1,152 KV bytes a token" in line
    # at one request the eager steps cost more than the drafts win back, and the plan says why
    alone = plan_for("deepseek-ai/DeepSeek-V3", "8xH200", concurrency=1.0, speculative_config=mtp,
                     draft_acceptance_rate=0.8)
    assert any("every step runs without CUDA graphs, as the MTP layer of deepseek-ai/DeepSeek-V3 reads" in w
               for w in alone.warnings)
    sglang = dict(export_plan(spec.record(), "sglang").flags)
    assert (sglang["--speculative-algorithm"], sglang["--speculative-num-steps"]) == ("EAGLE", "1")
    assert "--speculative-draft-model-path" not in sglang
    with pytest.raises(PlanError, match="method mtp drafts with the model's own multi-token-prediction layers"):
        plan_for(LLAMA, H100, speculative_config=mtp, draft_acceptance_rate=0.8)
    # Qwen3.5's: its gated full-attention layer and fc (the embedding and LM head the model's), and k + 2 states
    qwen = plan_for("Qwen/Qwen3.5-9B", H100, concurrency=8.0, speculative_config=mtp, draft_acceptance_rate=0.8,
                    max_model_len=32768, max_num_seqs=64)
    line = next(r for r in qwen.rationale if r.startswith("speculative decoding"))
    assert "the MTP layer of Qwen/Qwen3.5-9B takes 480.6 MiB a GPU and 4,096 KV bytes a token" in line


def test_a_hybrid_model_keeps_a_state_per_verified_token():
    """Qwen3.5's linear-attention layers keep the state after each of a verify step's k + 1 tokens beside their own
    (the next step keeps the one the kept drafts reach): k + 2 states a request, out of the KV cache's memory."""
    plain = plan_for("Qwen/Qwen3.5-9B", H100, max_num_seqs=64)
    spec = plan_for("Qwen/Qwen3.5-9B", H100, max_num_seqs=64, speculative_config=NGRAM3)
    (stage, *_), (plain_stage, *_) = spec.chosen.memory.stages, plain.chosen.memory.stages
    assert stage.recurrent_state_bytes == 5 * plain_stage.recurrent_state_bytes > 0
    assert spec.record().memory.num_blocks < plain.record().memory.num_blocks


def test_a_trace_that_recorded_speculation_gives_its_acceptance_rate(tmp_path):
    """launch --record-trace writes each request's verify steps, drafts and drafts kept: a plan with
    speculative_config and no --draft-acceptance-rate runs at the rate they mean (3 drafts a step, 1.5 kept: a + a^2
    + a^3 = 1.5), a rate given wins, and counts that cannot be are refused naming the line and field."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": i * 0.05, "input_len": 200, "output_len": 100, "num_drafts": 40,
                                         "num_draft_tokens": 120, "num_accepted_tokens": 60}) + "\n"
                             for i in range(50)))
    common = ["plan", LLAMA, "--hardware", H100, "--trace", str(trace), "--format", "json", "--speculative-config",
              NGRAM3]
    for extra, rate in (([], acceptance_for(2.5, 3)), (["--draft-acceptance-rate", "0.3"], 0.3)):
        result = CliRunner().invoke(app, [*common, *extra])
        assert result.exit_code == 0, result.output
        plan = json.loads(result.output)
        assert plan["service"]["draft_acceptance_rate"] == pytest.approx(rate, abs=1e-3)
        assert any("measured in the trace (2,000 verify steps" in line for line in plan["rationale"]) == (not extra)
    trace.write_text(json.dumps({"arrival_s": 0, "input_len": 9, "output_len": 9, "num_drafts": 2,
                                 "num_draft_tokens": 6, "num_accepted_tokens": 7}) + "\n")
    result = CliRunner().invoke(app, common)
    assert result.exit_code != 0 and "line 1: num_accepted_tokens 7 must be at most num_draft_tokens 6" in result.output
