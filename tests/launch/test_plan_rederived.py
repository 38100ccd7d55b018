"""Launching a plan whose layout or settings were edited by hand (or overridden by flags) plans it again with
the layout pinned as written, and the self-check gets the fresh predictions, said in one log line; an unedited
plan is served as written, and a layout that does not plan is refused naming the file."""

from __future__ import annotations

import logging

import pytest
import yaml

from shardserve.launch.launcher import settle
from shardserve.planner import PlanError, PlanOptions, load_model, make_plan, parse_declared
from shardserve.planner.plan_file import PlanFile

POOL = 1 << 24  # 16 MiB of KV cache per rank
SETTINGS = {"model": "shardserve-demo", "hardware": "2xcpu", "pipeline_parallel_size": 2, "max_model_len": 256,
            "max_num_seqs": 8, "kv_cache_memory_bytes": POOL}


@pytest.fixture(scope="module")
def plan_dict() -> dict:
    _, plan = settle(None, None, dict(SETTINGS), None)
    assert plan.inputs_digest == plan.digest()
    return plan.to_dict()


def launch_edited(tmp_path, plan: dict, caplog, flags: dict | None = None) -> tuple[PlanFile, list[str]]:
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shardserve.launch.server.plan_check"):
        _, served = settle(str(path), None, flags or {}, None)
    return served, [r.getMessage() for r in caplog.records if r.name == "shardserve.launch.server.plan_check"]


def edited(plan_dict: dict, **parallel) -> dict:
    plan = yaml.safe_load(yaml.safe_dump(plan_dict))
    plan["parallel"].update(parallel)
    return plan


def planned(**options):
    """What `plan` predicts for the demo on 2 CPU ranks with these pins."""
    split = options.pop("layer_split", None)
    merged = {k: v for k, v in SETTINGS.items() if k not in ("model", "hardware")} | options
    return make_plan(load_model("shardserve-demo"), parse_declared("2xcpu"), PlanOptions(**merged),
                     layer_split=split).record()


def test_an_unedited_plan_is_served_as_written(tmp_path, plan_dict, caplog):
    served, said = launch_edited(tmp_path, plan_dict, caplog)
    assert served.to_dict() == plan_dict and said == []


def test_an_edited_layout_gets_its_own_predictions(tmp_path, plan_dict, caplog):
    served, said = launch_edited(tmp_path, edited(plan_dict, pipeline_parallel_size=1, data_parallel_size=2,
                                                  layer_split=[4]), caplog)
    fresh = planned(pipeline_parallel_size=1, data_parallel_size=2)
    assert served.parallel == fresh.parallel and served.memory == fresh.memory
    assert served.estimates == fresh.estimates != PlanFile.from_dict(plan_dict, "p").estimates
    assert len(said) == 1 and "edited.yaml: planned again with the layout as written (tp=1 pp=1 dp=2" in said[0]
    assert f"KV cache {plan_dict['memory']['kv_cache_tokens']} -> {fresh.memory.kv_cache_tokens} tokens" in said[0]


def test_an_edited_layer_split_is_kept_and_sized(tmp_path, plan_dict, caplog):
    split = [1, 3] if plan_dict["parallel"]["layer_split"] != [1, 3] else [3, 1]
    served, said = launch_edited(tmp_path, edited(plan_dict, layer_split=split), caplog)
    assert list(served.parallel.layer_split) == split
    assert served.memory == planned(layer_split=tuple(split)).memory != PlanFile.from_dict(plan_dict, "p").memory
    assert len(said) == 1 and f"layer_split {split}" in said[0]


def test_flags_over_a_plan_are_planned_for(tmp_path, plan_dict, caplog):
    served, said = launch_edited(tmp_path, plan_dict, caplog, {"max_num_seqs": 2})
    assert served.runtime.max_num_seqs == 2 and served.estimates == planned(max_num_seqs=2).estimates
    assert len(said) == 1


def test_an_edited_layout_that_does_not_plan_is_refused_naming_the_file(tmp_path, plan_dict, caplog):
    with pytest.raises(PlanError, match=r"edited.yaml: its layout and settings as launch runs them do not plan: "
                                        r"layer_split \[1, 1\] must give each stage"):
        launch_edited(tmp_path, edited(plan_dict, layer_split=[1, 1]), caplog)


def test_a_plan_from_before_digests_is_served_as_written_and_says_so(tmp_path, plan_dict, caplog):
    old = edited(plan_dict, pipeline_parallel_size=1, data_parallel_size=2, layer_split=[4])
    del old["inputs_digest"]
    served, said = launch_edited(tmp_path, old, caplog)
    assert served.inputs_digest is None and served.memory == PlanFile.from_dict(plan_dict, "p").memory
    assert len(said) == 1 and "used as written" in said[0]


def test_a_plan_made_with_max_model_len_auto_is_planned_again_when_edited(tmp_path, caplog):
    """auto: the traffic's default lengths fit the length the KV cache holds, as a given max_model_len's do, so
    an edited layout plans again on the plan's own settings; lengths given beyond it are refused by `plan`."""
    auto = {"model": "shardserve-demo", "hardware": "2xcpu", "max_model_len": "auto", "kv_cache_memory_bytes": 1 << 22,
            "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1}
    config, plan = settle(None, None, dict(auto), None)
    service, max_model_len = plan.service, plan.runtime.max_model_len
    assert config.max_model_len == max_model_len == 1024 < 2048  # what 4 MiB of KV cache holds on one rank
    assert (service.input_len, service.output_len) == (768, 256)  # 1024 + 256 without the fix
    assert plan.estimates.workload.input_len == 768
    served, said = launch_edited(tmp_path, edited(plan.to_dict(), data_parallel_size=2), caplog)
    assert served.parallel.data_parallel_size == 2 and served.runtime.max_model_len == max_model_len
    assert served.service == service and len(said) == 1
    with pytest.raises(PlanError, match="max_model_len auto is 1024 on tp=1 pp=1 dp=1 .*: input_len 1024 \\+ "
                                        "output_len 256 = 1280 tokens is beyond max_model_len 1024"):
        settle(None, None, auto | {"input_len": 1024, "output_len": 256}, None)


def test_a_shorter_max_model_len_over_a_plan_fits_the_plans_traffic_to_it(tmp_path, plan_dict, caplog):
    """The plan's traffic (its defaults for 256 tokens) is beyond --max-model-len 128: the defaults for 128."""
    served, said = launch_edited(tmp_path, plan_dict, caplog, {"max_model_len": 128})
    assert served.runtime.max_model_len == 128
    assert (served.service.input_len, served.service.output_len) == (96, 32) == (
        planned(max_model_len=128).service.input_len, planned(max_model_len=128).service.output_len)
    assert "its traffic of 192 prompt + 64 output tokens is beyond max_model_len 128" in said[0]
    with pytest.raises(PlanError, match="input_len 100 \\+ output_len 64 = 164 tokens is beyond max_model_len 128"):
        launch_edited(tmp_path, plan_dict, caplog, {"max_model_len": 128, "input_len": 100})  # a flag's: kept
