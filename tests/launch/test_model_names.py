"""Model names as vLLM users give them (issue 43): `plan MODEL` as `launch MODEL` takes it, bare Hub ids (gpt2),
a short name that says which catalog id it became, an uncached id offline that says so; and the plan's first
screen: the answer first, the checkpoint's own format, refusals as data, flags named as typed."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from shardserve.launch.cli import app


def plan(*args: str, env: dict | None = None):
    return CliRunner().invoke(app, ["plan", *args], env=env)


def test_plan_takes_the_model_as_its_first_argument():
    result = plan("meta-llama/Llama-3.1-8B-Instruct", "--hardware", "H100-80GB", "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["model"]["id"] == "meta-llama/Llama-3.1-8B-Instruct"
    result = plan("meta-llama/Llama-3.1-8B-Instruct", "--model", "meta-llama/Llama-3.1-70B", "--hardware", "H100-80GB")
    assert result.exit_code == 1 and "two models" in result.output and "give one of them" in result.output


def test_a_short_name_plans_and_says_what_it_became():
    result = plan("llama-3.1-70b", "--hardware", "8xH100-80GB", "--format", "json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.output)
    assert record["model"]["id"] == "meta-llama/Llama-3.1-70B"
    assert any("is the catalog's meta-llama/Llama-3.1-70B (also in the catalog: meta-llama/Llama-3.1-70B-Instruct"
               in w for w in record["warnings"])


def test_a_bare_hub_id_offline_and_uncached_says_so(tmp_path):
    """`launch gpt3` was refused as "not a Hub id (org/name)"; bare ids are the Hub's oldest (gpt2), and vLLM
    takes them."""
    result = plan("gpt3", "--hardware", "cpu", env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)})
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    assert "not in the Hugging Face cache" in text and "HF_HUB_OFFLINE forbids asking the Hub" in text
    assert "org/name" not in text and "Traceback" not in text


def test_the_plans_header_gives_the_checkpoints_own_format_and_a_small_models_size():
    """It said "381.9 GiB in bfloat16" of the FP8 405B (the compute dtype), and "0.00B params" of the demo."""
    result = plan("meta-llama/Llama-3.1-405B-Instruct-FP8", "--hardware", "8xH100-80GB")
    assert result.exit_code == 0, result.output
    assert "405.85B params, 381.9 GiB as fp8 weights" in " ".join(result.output.split())
    result = plan("shardserve-demo", "--hardware", "cpu")
    header = " ".join(result.output.split())
    assert "3.4M params" in header and "MiB in float32" in header, header[:200]


def test_a_refused_plan_in_json_is_json_on_stdout():
    result = plan("meta-llama/Llama-3.1-405B-Instruct", "--hardware", "1xL4", "--format", "json")
    assert result.exit_code == 2
    refusal = json.loads(result.stdout)["error"]
    assert refusal["infeasible"] and refusal["exit_code"] == 2 and "does not fit on 1xL4" in refusal["message"]


def test_the_plan_answers_in_its_first_lines_and_leads_its_layouts_table():
    """The answer came after ~69 lines of detail; the chosen layout was not in the table of layouts."""
    result = plan("meta-llama/Llama-3.1-70B-Instruct", "--hardware", "8xH100-80GB", "--request-rate", "5",
                  "--format", "json")
    record = json.loads(result.output)
    est = record["estimates"]
    text = " ".join(plan("meta-llama/Llama-3.1-70B-Instruct", "--hardware", "8xH100-80GB", "--request-rate",
                         "5").output.split())
    first = text[:400]
    assert f"Plan: tp 8 x pp 1 x dp 1 on 8 H100-80GB: TTFT p50 {est['ttft_ms']:,.0f} ms, TPOT p50 " \
           f"{est['tpot_ms']:,.1f} ms, {est['output_tokens_per_s']:,.0f} output tok/s" in first, first
    assert "│ 8 │ 1 │ 1 │" in text.split("The plan and the other layouts")[1].split("the plan")[0]


def test_a_bad_flag_value_is_named_as_typed():
    """It was "options: input_len: ...": the internal name of the record, and the key, not the flag."""
    result = plan("meta-llama/Llama-3.1-8B-Instruct", "--hardware", "H100-80GB", "--input-len", "0")
    message = " ".join(result.output.split())
    assert result.exit_code == 1 and message.startswith("error: --input-len: "), message
    assert "options" not in message and "input_len" not in message


def test_the_shell_completes_commands_and_flags():
    """`shardserve --install-completion` (bash, zsh, fish): the shell asks the CLI, which answers from its own
    commands and the settings' flags."""
    def complete(words: str) -> list[str]:
        env = {"_SHARDSERVE_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(len(words.split()) - 1)}
        result = CliRunner().invoke(app, [], env=env, prog_name="shardserve")
        return result.output.split()
    assert complete("shardserve pl") == ["plan"]
    assert "--max-model-len" in complete("shardserve launch --max-mo")
