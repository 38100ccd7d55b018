"""The layouts a trace is replayed on (plan --trace): the chooser's first few, one candidate per layout, and the
chooser taking one again on the replayed numbers (planner/plan.py: Plan.contenders, replayed_choice)."""

from __future__ import annotations

import dataclasses

from shardserve.planner.plan import MAX_CONTENDERS, replayed_choice
from tests.planner.factories import plan_for

TARGETED = dict(request_rate=30.0, input_len=256, output_len=200, ttft_ms=200.0, tpot_ms=15.0)


def test_with_targets_the_contenders_meet_them_on_fewest_gpus_first():
    plan = plan_for("meta-llama/Llama-3.1-8B-Instruct", "8xH100-80GB", **TARGETED)
    contenders = plan.contenders()
    assert contenders[0] is plan and len(contenders) == MAX_CONTENDERS
    layouts = [(c.chosen.layout, c.chosen.expert_parallel) for c in contenders]
    assert len(set(layouts)) == len(layouts)  # one candidate per layout
    gpus = [c.chosen.layout.num_gpus for c in contenders]
    assert gpus == sorted(gpus)
    assert all(c.chosen.estimates.meets(plan.search.targets) for c in contenders)
    assert all(c.rationale and c.record().parallel.tensor_parallel_size for c in contenders)  # each a whole plan


def test_without_targets_the_contenders_keep_every_gpu_busy():
    plan = plan_for("meta-llama/Llama-3.1-70B-Instruct", "8xH100-80GB", request_rate=8.0)
    contenders = plan.contenders()
    assert len(contenders) > 1 and {c.chosen.layout.num_gpus for c in contenders} == {8}
    single = plan_for("meta-llama/Llama-3.1-8B-Instruct", "H100-80GB", request_rate=8.0)
    assert single.contenders() == [single]  # one GPU: no other layout to replay


def _replayed(contender, **numbers):
    return dataclasses.replace(contender.chosen.estimates, **numbers)


def test_the_replay_decides_the_targets_at_the_percentile_first():
    plan = plan_for("meta-llama/Llama-3.1-8B-Instruct", "8xH100-80GB", **TARGETED)
    first, second, *rest = plan.contenders()
    missing = _replayed(first, ttft_ms=450.0)  # the means met TTFT 200 ms; the trace's p50 does not
    estimates = [missing, _replayed(second)] + [_replayed(c) for c in rest]
    assert replayed_choice([first, second, *rest], estimates) is second
    assert replayed_choice([first, second], [missing, _replayed(second, tpot_ms=30.0)]) is None  # none meets
    assert replayed_choice([first, second], [_replayed(first), _replayed(second)]) is first


def test_without_targets_the_most_replayed_tokens_win():
    plan = plan_for("meta-llama/Llama-3.1-70B-Instruct", "8xH100-80GB", request_rate=8.0)
    first, second = plan.contenders()[:2]
    estimates = [_replayed(first, output_tokens_per_s=1000.0),
                 _replayed(second, output_tokens_per_s=2000.0)]  # beyond PREFERENCE_MARGIN of the first
    assert replayed_choice([first, second], estimates) is second
    slower = [_replayed(first, output_tokens_per_s=1000.0), _replayed(second, output_tokens_per_s=950.0)]
    assert replayed_choice([first, second], slower) is first
