"""The `shardserve` command line: plan now; launch, profiles, cluster and doctor to come."""

from __future__ import annotations

import enum
import json
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
    model: Annotated[str, typer.Option("--model", "-m", help="Hugging Face folder, an id in "
                                       "the local HF cache, or a catalog id.")],
    hardware: Annotated[Optional[str], typer.Option(
        help="Declared hardware: [NODESx]GPUSxNAME (8xH100-80GB, 2x8xH100, 3xL4), 'cpu', or "
             "a YAML file. Default: detect local GPUs (NVML), or the Ray cluster.")] = None,
    ray_address: Annotated[Optional[str], typer.Option(
        envvar="RAY_ADDRESS", help="Read nodes and GPUs from this Ray cluster.")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(help="Default: the model's.")] = None,
    dtype: Annotated[str, typer.Option(help="auto: bf16 where the GPU has it, else fp16.")]
    = "auto",
    kv_cache_dtype: Annotated[str, typer.Option(help="auto or fp8.")] = "auto",
    gpu_memory_utilization: Annotated[float, typer.Option()] = 0.9,
    block_size: Annotated[int, typer.Option()] = 16,
    max_num_seqs: Annotated[int, typer.Option()] = 256,
    max_num_batched_tokens: Annotated[Optional[int], typer.Option()] = None,
    tensor_parallel_size: Annotated[Optional[int], typer.Option(
        "--tensor-parallel-size", "-tp", help="Pin tensor parallel.")] = None,
    pipeline_parallel_size: Annotated[Optional[int], typer.Option(
        "--pipeline-parallel-size", "-pp", help="Pin pipeline parallel.")] = None,
    data_parallel_size: Annotated[Optional[int], typer.Option(
        "--data-parallel-size", "-dp", help="Pin the number of replicas.")] = None,
    distributed_executor_backend: Annotated[Optional[Backend], typer.Option(
        help="mp (local processes) or ray. Default: the planner's rule.")] = None,
    target_concurrency: Annotated[int, typer.Option(
        help="KV room for this many requests of max_model_len.")] = 1,
    output: Annotated[Optional[Path], typer.Option("--output", "-o",
                                                   help="Write the plan YAML here.")] = None,
    format: Annotated[Format, typer.Option("--format", help="table, json or yaml on stdout.")]
    = Format.table,
) -> None:
    """Choose tensor/pipeline/replica sizes, predict memory, KV cache and speed, and say why."""
    from shardserve.planner import PlanError, PlanOptions, load_model, make_plan
    from shardserve.launch.plan_view import render_plan, resolve_hardware, write_plan

    options = PlanOptions(
        max_model_len=max_model_len, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
        gpu_memory_utilization=gpu_memory_utilization, block_size=block_size,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size, data_parallel_size=data_parallel_size,
        distributed_executor_backend=(distributed_executor_backend.value
                                      if distributed_executor_backend else None),
        target_concurrency=target_concurrency)
    try:
        result = make_plan(load_model(model), resolve_hardware(hardware, ray_address), options)
        data = result.to_dict()
        if output is not None:
            write_plan(data, output)
    except PlanError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False)
        raise typer.Exit(e.exit_code) from None
    if format is Format.json:
        print(json.dumps(data, indent=2))
    elif format is Format.yaml:
        import yaml
        print(yaml.safe_dump(data, sort_keys=False), end="")
    else:
        render_plan(data, Console())
        if output is not None:
            Console().print(f"plan written to [bold]{output}[/]")


def main() -> None:
    app(prog_name="shardserve")
