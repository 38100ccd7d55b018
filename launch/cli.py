"""The `shardserve` command line: plan now; launch, profiles, cluster and doctor to come."""

from __future__ import annotations

import contextlib
import enum
import json
import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from shardserve.launch import __version__

app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode="rich",
                  help="Plan and launch multi-GPU LLM serving.")
err = Console(stderr=True)


class Format(str, enum.Enum):
    table = "table"
    json = "json"
    yaml = "yaml"


class Backend(str, enum.Enum):
    mp = "mp"
    ray = "ray"


def _version(value: bool) -> None:
    if value:
        print(f"shardserve {__version__}")
        raise typer.Exit()


@app.callback()
def root(version: Annotated[bool, typer.Option("--version", callback=_version,
                                               is_eager=True, help="Print the version.")]
         = False) -> None:
    """Plan and launch multi-GPU LLM serving."""


@app.command()
def plan(
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Hugging Face folder, "
                     "an id in the local HF cache, or a catalog id.")] = None,
    profile: Annotated[Optional[str], typer.Option(
        help="A profile name (shardserve profiles list) or YAML file; flags override it.")]
    = None,
    hardware: Annotated[Optional[str], typer.Option(
        help="Declared hardware: [NODESx]GPUSxNAME (8xH100-80GB, 2x8xH100, 3xL4), 'cpu', or "
             "a YAML file. Default: detect local GPUs (NVML), or the Ray cluster.")] = None,
    ray_address: Annotated[Optional[str], typer.Option(
        envvar="RAY_ADDRESS", help="Read nodes and GPUs from this Ray cluster.")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(help="Default: the model's.")] = None,
    dtype: Annotated[Optional[str], typer.Option(
        help="auto (default): bf16 where the GPU has it, else fp16.")] = None,
    kv_cache_dtype: Annotated[Optional[str], typer.Option(help="auto or fp8.")] = None,
    gpu_memory_utilization: Annotated[Optional[float], typer.Option(help="Default 0.9.")]
    = None,
    block_size: Annotated[Optional[int], typer.Option(help="Default 16.")] = None,
    max_num_seqs: Annotated[Optional[int], typer.Option(help="Default 256.")] = None,
    max_num_batched_tokens: Annotated[Optional[int], typer.Option(help="Default 8192.")]
    = None,
    tensor_parallel_size: Annotated[Optional[int], typer.Option(
        "--tensor-parallel-size", "-tp", help="Pin tensor parallel.")] = None,
    pipeline_parallel_size: Annotated[Optional[int], typer.Option(
        "--pipeline-parallel-size", "-pp", help="Pin pipeline parallel.")] = None,
    data_parallel_size: Annotated[Optional[int], typer.Option(
        "--data-parallel-size", "-dp", help="Pin the number of replicas.")] = None,
    distributed_executor_backend: Annotated[Optional[Backend], typer.Option(
        help="mp (local processes) or ray. Default: the planner's rule.")] = None,
    target_concurrency: Annotated[Optional[int], typer.Option(
        help="KV room for this many requests of max_model_len (default 1).")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o",
                                                   help="Write the plan YAML here.")] = None,
    format: Annotated[Format, typer.Option("--format", help="table, json or yaml on stdout.")]
    = Format.table,
) -> None:
    """Choose tensor/pipeline/replica sizes, predict memory, KV cache and speed, and say why."""
    flags = {k: v for k, v in locals().items() if k not in ("profile", "ray_address", "output",
                                                             "format")}
    if distributed_executor_backend is not None:
        flags["distributed_executor_backend"] = distributed_executor_backend.value
    with _user_errors():
        from shardserve.launch.plan_view import make_plan_from, render_plan, write_plan
        result = make_plan_from(flags, profile, ray_address)
        data = result.to_dict()
        if output is not None:
            write_plan(data, output)
    if format is Format.json:
        print(json.dumps(data, indent=2))
    elif format is Format.yaml:
        import yaml
        print(yaml.safe_dump(data, sort_keys=False), end="")
    else:
        render_plan(data, Console())
        if output is not None:
            Console().print(f"plan written to [bold]{output}[/]")


@app.command()
def launch(
    plan_file: Annotated[Optional[Path], typer.Argument(
        metavar="[PLAN.yaml]", help="A plan from `shardserve plan -o`. Without one, plan now.")]
    = None,
    profile: Annotated[Optional[str], typer.Option(help="A profile name or YAML file.")] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Model folder or id "
                     "(default: the bundled demo model).")] = None,
    set_: Annotated[Optional[list[str]], typer.Option(
        "--set", help="key=value for any setting, e.g. --set max_num_seqs=64.")] = None,
    tensor_parallel_size: Annotated[Optional[int], typer.Option(
        "--tensor-parallel-size", "-tp")] = None,
    pipeline_parallel_size: Annotated[Optional[int], typer.Option(
        "--pipeline-parallel-size", "-pp")] = None,
    distributed_executor_backend: Annotated[Optional[Backend], typer.Option()] = None,
    ray_address: Annotated[Optional[str], typer.Option(envvar="RAY_ADDRESS")] = None,
    max_model_len: Annotated[Optional[int], typer.Option()] = None,
    dtype: Annotated[Optional[str], typer.Option()] = None,
    host: Annotated[Optional[str], typer.Option(help="Default 127.0.0.1 (this machine only).")]
    = None,
    port: Annotated[Optional[int], typer.Option(help="Default 8000.")] = None,
    api_key: Annotated[Optional[str], typer.Option(
        help="Require 'Authorization: Bearer KEY' (or set SHARDSERVE_API_KEY).")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(
        help="The model name clients use (default: --model).")] = None,
) -> None:
    """Serve a plan, a profile or a model over an OpenAI-compatible API."""
    import logging

    from shardserve.launch.deploy_config import parse_set
    from shardserve.launch.launcher import api_key_from_env, serve, settle

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s", datefmt="%H:%M:%S")
    flags = {"model": model, "tensor_parallel_size": tensor_parallel_size,
             "pipeline_parallel_size": pipeline_parallel_size,
             "distributed_executor_backend": (distributed_executor_backend.value
                                              if distributed_executor_backend else None),
             "max_model_len": max_model_len, "dtype": dtype, "host": host, "port": port,
             "served_model_name": served_model_name}
    if ray_address:
        os.environ["RAY_ADDRESS"] = ray_address  # the runtime's Ray executor joins it
    with _user_errors():
        flags.update(parse_set(set_ or []))
        config, plan = settle(str(plan_file) if plan_file else None, profile, flags,
                              ray_address)
    try:
        code = serve(config, plan, config.host or "127.0.0.1",
                     8000 if config.port is None else config.port, api_key_from_env(api_key),
                     config.served_model_name)
    except ValueError as e:  # the runtime refusing a setting (max_model_len too long, ...)
        err.print(f"[bold red]error:[/] {e}", highlight=False)
        raise typer.Exit(1) from None
    raise typer.Exit(code)


@app.command()
def doctor(
    plan_file: Annotated[Optional[Path], typer.Option(
        "--plan", help="Check this machine against a plan from `shardserve plan -o`.")] = None,
    format: Annotated[Format, typer.Option("--format", help="table or json.")] = Format.table,
) -> None:
    """Check GPUs, NVLink, /dev/shm, network interfaces, versions and the model files."""
    from shardserve.launch.doctor import run_checks
    from shardserve.launch.launcher import plan_file_values

    with _user_errors():
        plan = plan_file_values(str(plan_file))[1] if plan_file else None
        checks = run_checks(plan)
    if format is Format.json:
        print(json.dumps({"checks": [c.to_dict() for c in checks]}, indent=2))
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
    table = Table("name", "description", "file")
    with _user_errors():
        for name, path in list_profiles().items():
            table.add_row(name, load_profile(str(path)).description or "", str(path))
    Console().print(table)


@profiles_app.command("show")
def profiles_show(name: Annotated[str, typer.Argument(help="Profile name or YAML file.")]
                  ) -> None:
    """Print a profile after checking every key."""
    import yaml

    from shardserve.launch.profiles import find_profile, load_profile
    with _user_errors():
        path = find_profile(name)
        values = load_profile(name).set_values()
    print(f"# {path}")
    print(yaml.safe_dump(values, sort_keys=False), end="")


@contextlib.contextmanager
def _user_errors():
    """Bad input becomes one red line on stderr and the planner's exit code, no traceback."""
    from shardserve.planner import PlanError
    try:
        yield
    except PlanError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False)
        raise typer.Exit(e.exit_code) from None


def main() -> None:
    app(prog_name="shardserve")
