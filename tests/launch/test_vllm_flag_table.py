"""A pasted `vllm serve` command line (issue 43): every vLLM flag is ours under the same name or has an answer
(renamed to ours, a note, a refusal saying what to use), list flags take several values as in vLLM, and a flag
neither has keeps click's error. The argv rewriting is called directly, and main() on command lines that stop
before anything runs (a refusal, a usage error): no process starts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import typer.main

from shardserve.launch import cli
from shardserve.launch.vllm_flags.argv import VllmFlagRefused, command_options, rewrite
from shardserve.launch.vllm_flags.entry import Answer, Takes
from shardserve.launch.vllm_flags.table import CURRENT, FLAGS, OLDER, SAME_NAME, VLLM_VERSION

VLLM_OPTION_STRINGS = 435  # `vllm serve`'s option strings in VLLM_VERSION, aliases and --no- forms included
FROM_VLLM = Path(__file__).parents[2] / "docs" / "server.md"


@pytest.fixture(scope="module")
def options() -> dict[str, dict[str, bool]]:
    commands = getattr(typer.main.get_command(cli.app), "commands")
    return {name: command_options(commands[name]) for name in ("launch", "plan")}


def test_every_vllm_flag_is_ours_or_has_an_answer(options):
    launch = options["launch"]
    current = [name for flag in CURRENT for name in flag.names]
    assert len(current) + len(SAME_NAME) == VLLM_OPTION_STRINGS, VLLM_VERSION
    assert [name for name in SAME_NAME if name not in launch] == []
    assert [name for name in FLAGS if name in launch] == []  # an answer never hides a flag of ours
    for flag in CURRENT + OLDER:
        assert isinstance(flag.answer, Answer) and isinstance(flag.takes, Takes) and flag.text, flag.name
        assert not flag.accepted or flag.answer is Answer.REFUSE, flag.name
        assert flag.answer is not Answer.RENAME or flag.text in launch, flag.name


def test_trust_remote_code_and_disable_log_requests_are_notes_and_go(options):
    done = rewrite(["MODEL", "--trust-remote-code", "--disable-log-requests", "--trust-remote-code"],
                   options["launch"])
    assert done.args == ["MODEL"]
    assert len(done.notices) == 2 and "--trust-remote-code changes nothing here" in done.notices[0]
    assert "--disable-log-requests" in done.notices[1]


def test_a_value_is_dropped_with_its_flag_and_a_value_we_have_is_a_note(options):
    done = rewrite(["--swap-space", "4", "MODEL", "--uvicorn-log-level=info", "--tokenizer-mode", "auto"],
                   options["launch"])
    assert done.args == ["MODEL"] and "--kv-offloading-size" in done.notices[0]
    with pytest.raises(VllmFlagRefused, match="--uvicorn-log-level debug is not taken here"):
        rewrite(["MODEL", "--uvicorn-log-level", "debug"], options["launch"])


def test_tokenizer_is_refused_by_main_saying_what_to_do(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["shardserve", "launch", "MODEL", "--tokenizer", "/other"])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    err = " ".join(capsys.readouterr().err.split())
    assert exit_.value.code == 1 and "Traceback" not in err
    assert "error: vLLM's --tokenizer is not taken here" in err and "the model folder's own" in err


def test_tokenizer_naming_the_model_itself_is_a_note_and_notes_come_before_a_refusal(options, monkeypatch, capsys):
    for args in (["--tokenizer", "org/m", "org/m"], ["--model", "org/m", "--tokenizer", "org/m"]):
        done = rewrite(args, options["launch"])
        assert "--tokenizer" not in done.args and "is the model's own" in done.notices[0]
    with pytest.raises(VllmFlagRefused, match="--tokenizer is not taken here"):
        rewrite(["org/m", "--tokenizer", "org/other"], options["launch"])
    monkeypatch.setattr(sys, "argv", ["shardserve", "launch", "MODEL", "--trust-remote-code", "--tokenizer", "/x"])
    with pytest.raises(SystemExit):
        cli.main()
    err = " ".join(capsys.readouterr().err.split())
    assert err.index("note: vLLM's --trust-remote-code") < err.index("error: vLLM's --tokenizer")


def test_a_flag_neither_has_keeps_clicks_error(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["shardserve", "plan", "--trust-remote-code", "--no-such-flag"])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and "No such option: --no-such-flag" in err
    assert "note: vLLM's --trust-remote-code changes nothing here" in err


def test_flags_we_have_pass_untouched(options):
    args = ["MODEL", "--max-model-len=4096", "-tp", "2", "--max-logprobs", "-1", "--chat-template", "--weird"]
    assert rewrite(args, options["launch"]).args == args
    assert rewrite(["--max_num_seqs", "8"], options["plan"]).args == ["--max-num-seqs", "8"]


def test_max_model_len_minus_one_is_auto_as_in_vllm(options):
    assert rewrite(["--max-model-len", "-1", "m"], options["launch"]).args == ["--max-model-len", "auto", "m"]
    assert rewrite(["--max-model-len=-1"], options["plan"]).args == ["--max-model-len", "auto"]


def test_lora_modules_take_several_values_as_in_vllm(options):
    launch = options["launch"]
    two = ["--lora-modules", "a=/x", "--lora-modules", "b=/y"]
    assert rewrite(["MODEL", "--lora-modules", "a=/x", "b=/y"], launch).args == ["MODEL", *two]
    assert rewrite(["--lora-modules", "a=/x", "b=/y", "MODEL", "--port", "1"], launch).args == [
        *two, "MODEL", "--port", "1"]
    json_form = '[{"name": "a", "path": "/x"}, {"name": "b", "path": "/y"}]'
    assert rewrite(["--lora-modules", json_form, "MODEL"], launch).args == [*two, "MODEL"]
    origins = rewrite(["--allowed-origins", '["https://a", "https://b"]'], launch).args
    assert origins == ["--allowed-origins", "https://a", "--allowed-origins", "https://b"]


def test_a_list_flag_leaves_model_its_place(options):
    launch = options["launch"]
    assert rewrite(["--allowed-media-domains", "a", "b", "MODEL"], launch).args == ["MODEL"]
    assert rewrite(["MODEL", "--allowed-media-domains", "a", "b"], launch).args == ["MODEL"]
    assert rewrite(["--api-key", "k", "MODEL"], launch).args == ["--api-key", "k", "MODEL"]
    with pytest.raises(VllmFlagRefused, match="--api-key with 2 values: several API keys; here one") as refused:
        rewrite(["MODEL", "--api-key", "k1", "k2"], launch)
    assert "k1" not in str(refused.value)  # no key is echoed


def test_vllm_names_of_our_flags_become_ours(options):
    args = ["-q", "awq", "--device-memory-utilization=0.8", "--disable-prefix-caching", "-ep", "--disable-lora"]
    assert rewrite(args, options["launch"]).args == [
        "--quantization", "awq", "--gpu-memory-utilization=0.8", "--no-enable-prefix-caching",
        "--enable-expert-parallel", "--no-enable-lora"]
    # plan has no --no-enable-chunked-prefill: vLLM's name is left for click to refuse
    assert rewrite(["--disable-chunked-prefill"], options["plan"]).args == ["--disable-chunked-prefill"]


def test_vllm_spellings_of_refused_flags_are_refused(options):
    for args in (["-O3"], ["-O", "3"], ["--compilation-config.mode", "3"], ["--hf_overrides", "{}"], ["--spec-tokens", "3"]):
        with pytest.raises(VllmFlagRefused, match="is not taken here"):
            rewrite(["MODEL", *args], options["launch"])
    assert rewrite(["MODEL", "--", "--tokenizer"], options["launch"]).args == ["MODEL", "--", "--tokenizer"]


def test_the_docs_answer_every_vllm_flag():
    section = FROM_VLLM.read_text().split("## From vLLM", 1)[1]
    names = [*SAME_NAME, *FLAGS, "-O"]
    assert [name for name in names if f"`{name}`" not in section and f"`{name} " not in section] == []


def test_the_table_matches_the_installed_vllm():
    """Where vLLM is installed (not in this project's environment): its `vllm serve` parser, flag by flag."""
    cli_args = pytest.importorskip("vllm.entrypoints.common.cli_args")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    actions = cli_args.make_arg_parser(FlexibleArgumentParser())._actions
    takes = {name: Takes.NOTHING if a.nargs == 0 else Takes.MANY if a.nargs == "+" else Takes.ONE
             for a in actions for name in a.option_strings}
    answered = {name for flag in CURRENT for name in flag.names}
    assert sorted(set(takes) - answered - set(SAME_NAME)) == [] and sorted(answered - set(takes)) == []
    assert [name for name in answered if FLAGS[name].takes is not takes[name]] == []
