"""`shardserve models`: the catalog's models and those in the local Hugging Face cache, with the GPUs each
needs as shipped and with fp8 weights."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Console

from shardserve.launch.cli_support import Format, print_data, user_errors

# NOTE: the GPU counts are the planner's memory model on one node; `plan` says which layout and how fast
_GPU_HELP = "The GPU the counts are for, as --hardware names it (H100-80GB, A100-40GB, L4, ...)."


def _count(gpus: int | None, most: str) -> str:
    return str(gpus) if gpus is not None else most


def _tokens(num: int) -> str:
    return f"{num // 1024}K" if num % 1024 == 0 else f"{num:,}"


def _params(num: int | None) -> str:
    return "" if num is None else f"{num / 1e9:.1f}B" if num >= 0.9995e9 else f"{num / 1e6:.0f}M"


def models(
    wanted: Annotated[Optional[str], typer.Argument(
        metavar="[FILTER]", help="Only ids holding this text (case-insensitive), e.g. llama or fp8.")] = None,
    gpu: Annotated[str, typer.Option(help=_GPU_HELP)] = "H100-80GB",
    format: Annotated[Format, typer.Option("--format", help="table, json or yaml.")] = Format.table,
) -> None:
    """List the models `plan` and `launch` know without a download: the bundled catalog and the local
    Hugging Face cache, with architecture, parameters, context length, quantization, and the fewest GPUs
    of one node (1, 2, 4 or 8 of --gpu) that hold the weights and one request of the whole context, as
    shipped and with fp8 weights (--quantization fp8)."""
    from shardserve.planner.model_list import NODE_SIZES, list_models
    from shardserve.planner.errors import PlanError
    with user_errors():
        rows = list_models(wanted, gpu)
        if not rows:
            raise PlanError(f"no catalog or cached model id holds {wanted!r}; `shardserve models` lists them all")
    if format is not Format.table:
        print_data({"gpu": gpu, "models": [r.to_dict() for r in rows]}, format)
        return
    most = f">{NODE_SIZES[-1]}"
    if not Console().is_terminal:  # piped: whole ids, one row a line, for grep and cut
        _print_plain([_cells(r, most, lambda text: text) for r in rows])
        return
    from rich.table import Table
    table = Table(title=f"Fewest {gpu} on one node ({most}: more; fp8: with --quantization fp8)")
    table.add_column("id (* cached)", overflow="fold")
    for name in COLUMNS[1:]:
        table.add_column(name, no_wrap=name != "architecture", overflow="fold",
                         max_width=16 if name == "architecture" else None)
    for r in rows:
        table.add_row(*_cells(r, most, lambda text: f"[red]{text}[/]"))
    Console().print(table)


COLUMNS = ("id", "architecture", "params", "context", "quant", "GPUs", "fp8")


def _cells(r, most: str, red) -> tuple[str, ...]:
    """A model's row; `red` marks a problem (rich markup in the table, nothing when piped)."""
    marked = r.id + (" *" if r.source == "hf-cache" else "")
    if r.architecture is None or r.max_context_len is None:
        return (marked, red("unreadable:") + f" {r.problem}", "", "", "", "", "")
    fits = (red(r.problem), "") if r.problem else (
        _count(r.gpus, most), _count(r.gpus_fp8, most) if r.can_quantize_fp8 else "-")
    return (marked, r.architecture.removesuffix("ForCausalLM"), _params(r.num_params), _tokens(r.max_context_len),
            r.quantization or "", *fits)


def _print_plain(lines: list[tuple[str, ...]]) -> None:
    """The table as plain columns, nothing cut or folded (rich fits a table to 80 columns when piped)."""
    lines = [COLUMNS, *lines]
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS) - 1)]
    for line in lines:
        print("  ".join([cell.ljust(width) for cell, width in zip(line, widths)] + [line[-1]]).rstrip())
