"""The `shardserve` command line: plan, launch, doctor, profiles, cluster and calibrate."""

from __future__ import annotations

import enum
import json
import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from shardserve.launch import __version__
from shardserve.launch.cli_options import launch_command_settings, plan_command_settings, setting_options
from shardserve.launch.cluster.cli import cluster_app
from shardserve.launch.deploy.cli import deploy
from shardserve.launch.cli_models import models
from shardserve.launch.cli_support import Format, err, print_data, refusal_as_data, user_errors

# NOTE: click's plain help, not typer's rich panels: those cut option names at 80 columns
app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,  # (--install-completion: bash, zsh, fish)
                  help="Plan and launch multi-GPU LLM serving.")


class PlanFormat(str, enum.Enum):
    """`plan` also prints the equivalent serve command of another engine."""
    table = "table"
    json = "json"
    yaml = "yaml"
    vllm = "vllm"
    sglang = "sglang"


def _version(value: bool) -> None:
    if value:
        print(f"shardserve {__version__}")
        raise typer.Exit()


@app.callback()
def root(version: Annotated[bool, typer.Option("--version", callback=_version,
                                               is_eager=True, help="Print the version.")]
         = False) -> None:
    """Plan and launch multi-GPU LLM serving."""


@app.command(short_help="Choose the layout, predict memory and speed, say why.")
@setting_options(plan_command_settings())
def plan(
    target: Annotated[Optional[str], typer.Argument(
        metavar="MODEL", help="The model, as `launch MODEL` takes it (the same as --model: a folder, a Hub id, "
        "or a catalog id).")] = None,
    profile: Annotated[Optional[str], typer.Option(
        help="A profile name (shardserve profiles list) or YAML file; flags override it.")]
    = None,
    ray_address: Annotated[Optional[str], typer.Option(
        envvar="RAY_ADDRESS", help="Read nodes and GPUs from this Ray cluster ('auto': the one this host "
                                   "joined through `shardserve cluster up/join`).")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o",
                                                   help="Write the plan YAML here.")] = None,
    plot: Annotated[Optional[Path], typer.Option(
        "--plot", help="Draw the plan here (PNG or SVG by the suffix): every layout's tok/s per GPU against per "
        "user with the Pareto front, the plan's marked and the TPOT target drawn; with --trace, the latency "
        "percentiles. Needs matplotlib: pip install 'shardserve[plot]'.")] = None,
    format: Annotated[PlanFormat, typer.Option("--format", help="table, json or yaml on stdout; vllm or "
                                           "sglang: that engine's equivalent serve command.")]
    = PlanFormat.table,
    trace: Annotated[Optional[Path], typer.Option(
        "--trace", help="Plan for this recorded traffic: JSON lines or CSV, one request a line (arrival_s, "
        "input_len, output_len; optionally prefix_id and prefix_len). The layouts are ranked on its means; the "
        "best few (up to 4) replay the trace through the engine's scheduler, and the plan takes the one that "
        "does best there (targets at --target-percentile met, then the fewest GPUs, the most output tok/s), with "
        "its percentiles of TTFT, TPOT, ITL and end-to-end time.")] = None,
    traffic: Annotated[Optional[str], typer.Option(
        "--traffic", help="Plan for a named traffic instead of a trace (sharegpt: ShareGPT's lengths as vLLM's "
        "and SGLang's benchmarks sample them): 1,000 requests at --request-rate (Poisson); with --concurrency N, "
        "N in flight, the next sent as one finishes (a closed loop, as vLLM's bench serve --max-concurrency); "
        "neither: all 1,000 at once. Replayed as --trace replays a file.")] = None,
    recommend: Annotated[bool, typer.Option(
        "--recommend", help="Plan on the fewest GPUs of the --hardware GPU type (its GPUs per node) that "
        "serve --request-rate or --concurrency within --ttft-ms/--tpot-ms.")] = False,
    **settings,
) -> None:
    """Choose tensor/pipeline/replica sizes, predict memory, KV cache and speed, and say why."""
    with user_errors(), refusal_as_data(format.value if format in (PlanFormat.json, PlanFormat.yaml) else None):
        from shardserve.launch.plan_view import make_plan_from, one_model, write_plan
        if ray_address:
            from shardserve.launch.cluster.ray_cluster import resolve_address, use_cluster_auth
            ray_address = resolve_address(ray_address)
            use_cluster_auth()
        settings["model"] = one_model(target, settings.get("model"))
        record = make_plan_from(settings, profile, ray_address, recommend, trace, traffic)
        if output is not None:
            write_plan(record, output)
        if plot is not None:
            from shardserve.launch.plan_plot import write_plot
            write_plot(record, plot)
    _print_plan(record, format, output)


def _print_plan(record, format: PlanFormat, output: Path | None) -> None:
    if format is PlanFormat.json:
        print(json.dumps(record.to_dict(), indent=2))
    elif format is PlanFormat.yaml:
        import yaml
        print(yaml.safe_dump(record.to_dict(), sort_keys=False), end="")
    elif format in (PlanFormat.vllm, PlanFormat.sglang):
        from shardserve.launch.engine_export import export_plan
        print(export_plan(record, format.value).render())
    else:
        from shardserve.launch.plan_view import render_plan
        render_plan(record, Console())
        if output is not None:
            Console().print(f"plan written to [bold]{output}[/]")


@app.command(short_help="Serve a model, a plan or a profile (OpenAI API).")
@setting_options(launch_command_settings())
def launch(
    target: Annotated[Optional[str], typer.Argument(
        metavar="MODEL|PLAN.yaml", help="A model, as `vllm serve MODEL` (the same as --model: a folder, a Hub "
        "id (org/name, or a bare name such as gpt2), downloaded when the cache lacks it, or a catalog id); or a plan from `shardserve plan -o`. "
        "Without either, plan now for --model or --profile; with none of them, serve the demo (--profile demo).")]
    = None,
    profile: Annotated[Optional[str], typer.Option(help="A profile name or YAML file.")] = None,
    set_: Annotated[Optional[list[str]], typer.Option(
        "--set", help="key=value for any setting, e.g. --set max_num_seqs=64.")] = None,
    ray_address: Annotated[Optional[str], typer.Option(
        envvar="RAY_ADDRESS", help="Run ranks on this Ray cluster ('auto': the one this host "
                                   "joined).")] = None,
    api_key: Annotated[Optional[str], typer.Option(
        help="Require 'Authorization: Bearer KEY' (or set SHARDSERVE_API_KEY).")] = None,
    env: Annotated[Optional[list[str]], typer.Option(
        "--env", help="NAME=VALUE set for the engine and every rank, on every node; "
                      "NCCL_*, GLOO_*, CUDA_*, TORCH_*, HF_* travel without it.")] = None,
    restart: Annotated[int, typer.Option(
        "--restart", min=0, help="When a rank or node is lost, start the whole gang again up "
                                 "to this many times (default 0: exit 1).")] = 0,
    **settings,
) -> None:
    """Serve a model, a plan or a profile over an OpenAI-compatible API."""
    import logging

    from shardserve.launch.deploy_config import parse_env, parse_set
    from shardserve.launch.launcher import (api_key_from_env, bind_port, exit_now, fetch_weights, launch_target, serve,
                                            setting, settle)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s", datefmt="%H:%M:%S")
    for client in ("httpx", "httpx2"):  # huggingface_hub's HTTP clients: a line per request at INFO
        logging.getLogger(client).setLevel(logging.WARNING)
    flags = dict(settings)
    with user_errors():
        if ray_address:  # 'auto' refused by name when this host joined no cluster
            from shardserve.launch.cluster.ray_cluster import resolve_address, use_cluster_auth
            ray_address = resolve_address(ray_address)
            os.environ["RAY_ADDRESS"] = ray_address  # the runtime's Ray executor joins it
            use_cluster_auth()
        typed = frozenset(name for name, value in flags.items() if value is not None)
        flags.update(parse_set(set_ or []))
        flags["env"] = parse_env(env or []) or None
        plan_file, flags["model"] = launch_target(target, flags.get("model"))
        config, plan = settle(plan_file, profile, flags, ray_address, typed)
        key = api_key_from_env(api_key)
        listener = bind_port(setting(config, "host"), setting(config, "port"))  # before anything loads
        config = fetch_weights(config)  # a Hub id's weights, downloaded once the plan is settled
    try:
        with user_errors():
            code = serve(config, plan, listener, key, config.served_model_name, restart)
    except ValueError as e:  # the runtime refusing a setting (max_model_len too long, ...)
        err.print(f"[bold red]error:[/] {e}", highlight=False)
        raise typer.Exit(1) from None
    exit_now(code)


@app.command(short_help="Check this machine, a plan, or a Ray cluster.")
def doctor(
    plan_file: Annotated[Optional[Path], typer.Option(
        "--plan", help="Check this machine against a plan from `shardserve plan -o`.")] = None,
    format: Annotated[Format, typer.Option("--format", help="table, json or yaml.")]
    = Format.table,
    ray_address: Annotated[Optional[str], typer.Option(
        envvar="RAY_ADDRESS", help="Check every node of this Ray cluster (default: the "
                                   "cluster this host joined, if any).")] = None,
) -> None:
    """Check GPUs, NVLink, /dev/shm, NCCL's transport, interfaces, versions, the model files,
    and on a Ray cluster every node's IP, versions, variables and model files."""
    from shardserve.launch.cluster.ray_cluster import (read_record, resolve_address, state_dir,
                                           use_cluster_auth)
    from shardserve.launch.cluster.doctor import run_checks
    from shardserve.launch.launcher import read_plan_file

    with user_errors():
        plan = read_plan_file(str(plan_file)) if plan_file else None
        record = read_record(state_dir())
        address = resolve_address(ray_address) or (record.address if record else None)
        if address:
            use_cluster_auth()
        checks = run_checks(plan, cluster_address=address)
    if format is not Format.table:
        print_data({"checks": [c.to_dict() for c in checks]}, format)
    else:
        from rich.table import Table
        colors = {"pass": "green", "warn": "yellow", "fail": "red", "skip": "dim"}
        table = Table("check", "status", "detail", "fix")
        for c in checks:
            table.add_row(c.name, f"[{colors[c.status]}]{c.status}[/]", c.detail, c.fix or "")
        Console().print(table)
    if any(c.status == "fail" for c in checks):
        raise typer.Exit(1)


profiles_app = typer.Typer(no_args_is_help=True, help="The YAML profiles in profiles/.")
app.add_typer(profiles_app, name="profiles")


@profiles_app.command("list")
def profiles_list() -> None:
    """List the profiles and what each is for."""
    from rich.table import Table

    from shardserve.launch.profiles import list_profiles, load_profile
    from shardserve.planner import PlanError
    table = Table("name")
    table.add_column("description", overflow="fold")  # a broken profile's error names its file
    broken = False
    with user_errors():
        profiles = list_profiles()
    for name, path in profiles.items():
        try:
            about = load_profile(str(path)).description or ""
        except PlanError as e:
            about, broken = f"[red]broken:[/] {e}", True
        table.add_row(name, about)
    Console().print(table)
    for name, path in profiles.items():  # outside the table, where no width cuts a path
        print(f"{name}: {path}")
    if broken:
        raise typer.Exit(1)


@profiles_app.command("show")
def profiles_show(name: Annotated[str, typer.Argument(help="Profile name or YAML file.")]
                  ) -> None:
    """Print a profile after checking every key."""
    import yaml

    from shardserve.launch.profiles import find_profile, load_profile
    with user_errors():
        path = find_profile(name)
        values = load_profile(name).set_values()
    print(f"# {path}")
    print(yaml.safe_dump(values, sort_keys=False), end="")


app.add_typer(cluster_app, name="cluster")
app.command(short_help="List the known models and the GPUs each needs.")(models)
app.command(short_help="Write Kubernetes, LeaderWorkerSet, KubeRay or Slurm files that run a plan.")(deploy)


@app.command(short_help="Time this runtime's operators for `plan` on this GPU.")
def calibrate(
    device: Annotated[str, typer.Option(help="auto, cpu or cuda (auto: cuda when torch sees a GPU).")]
    = "auto",
    dtype: Annotated[Optional[str], typer.Option(
        help="bfloat16, float16 or float32 (default: bfloat16 on a GPU, float32 on a CPU).")] = None,
    sizes: Annotated[Optional[str], typer.Option(
        help="small: tiny shapes, seconds (default on a CPU); full: the planner's grids, minutes "
             "(default on a GPU).")] = None,
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", help="Write here (default: <gpu>.json in $XDG_CACHE_HOME/shardserve/calibration, "
                               "the file `plan` reads).")] = None,
    tensor_parallel_size: Annotated[Optional[int], typer.Option(
        min=1, help="Also time the all-reduce over 2..N local ranks (default: the visible GPUs up to 8; "
                    "1 on a CPU, gloo ranks when given).")] = None,
) -> None:
    """Time GEMMs, attention, the all-reduce and the host's step as this runtime runs them, and
    write the calibration file that `shardserve plan` reads for this GPU from then on."""
    from shardserve.launch.calibrate import calibrate as run_calibration
    from shardserve.launch.calibrate import settle as settle_calibration

    with user_errors():
        setup = settle_calibration(device, dtype, sizes, output, tensor_parallel_size)
        run_calibration(setup, Console())


def main() -> None:
    # NOTE: click exits 2 on a usage error; here 2 means "does not fit", so bad input exits 1
    # (typer carries its own click: its UsageError is reached through the public BadParameter)
    typer.BadParameter.__base__.exit_code = 1  # type: ignore[union-attr]  # the base: click's UsageError
    import sys

    from shardserve.launch.vllm_flags.argv import answer_vllm_flags
    sys.argv[1:] = answer_vllm_flags(app, sys.argv[1:])  # a pasted `vllm serve` line: each vLLM flag answered
    app(prog_name="shardserve")
