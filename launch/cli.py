"""The `shardserve` command line: plan, launch, doctor, profiles, cluster and calibrate."""

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
from shardserve.launch.cli_options import launch_command_settings, plan_command_settings, setting_options

# NOTE: click's plain help, not typer's rich panels: those cut option names at 80 columns
app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                  help="Plan and launch multi-GPU LLM serving.")
err = Console(stderr=True, soft_wrap=True)  # an error line is never broken mid-path


class Format(str, enum.Enum):
    table = "table"
    json = "json"
    yaml = "yaml"


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
    profile: Annotated[Optional[str], typer.Option(
        help="A profile name (shardserve profiles list) or YAML file; flags override it.")]
    = None,
    ray_address: Annotated[Optional[str], typer.Option(
        envvar="RAY_ADDRESS", help="Read nodes and GPUs from this Ray cluster.")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o",
                                                   help="Write the plan YAML here.")] = None,
    format: Annotated[PlanFormat, typer.Option("--format", help="table, json or yaml on stdout; vllm or "
                                           "sglang: that engine's equivalent serve command.")]
    = PlanFormat.table,
    recommend: Annotated[bool, typer.Option(
        "--recommend", help="Plan on the fewest GPUs of the --hardware GPU type (its GPUs per node) that "
        "serve --request-rate or --concurrency within --ttft-ms/--tpot-ms.")] = False,
    **settings,
) -> None:
    """Choose tensor/pipeline/replica sizes, predict memory, KV cache and speed, and say why."""
    with _user_errors():
        from shardserve.launch.plan_view import make_plan_from, render_plan, write_plan
        if ray_address:
            from shardserve.launch.cluster import resolve_address, use_cluster_auth
            ray_address = resolve_address(ray_address)
            use_cluster_auth()
        record = make_plan_from(settings, profile, ray_address, recommend).record()
        if output is not None:
            write_plan(record, output)
    if format is PlanFormat.json:
        print(json.dumps(record.to_dict(), indent=2))
    elif format is PlanFormat.yaml:
        import yaml
        print(yaml.safe_dump(record.to_dict(), sort_keys=False), end="")
    elif format in (PlanFormat.vllm, PlanFormat.sglang):
        from shardserve.launch.engine_export import export_plan
        print(export_plan(record, format.value).render())
    else:
        render_plan(record, Console())
        if output is not None:
            Console().print(f"plan written to [bold]{output}[/]")


@app.command(short_help="Serve a plan, a profile or a model (OpenAI API).")
@setting_options(launch_command_settings())
def launch(
    plan_file: Annotated[Optional[Path], typer.Argument(
        metavar="PLAN.yaml", help="A plan from `shardserve plan -o`. Without one, plan now; "
        "with no --model or --profile either, serve the demo (--profile demo).")]
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
    """Serve a plan, a profile or a model over an OpenAI-compatible API."""
    import logging

    from shardserve.launch.deploy_config import parse_env, parse_set
    from shardserve.launch.launcher import api_key_from_env, bind_port, exit_now, serve, setting, settle

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s", datefmt="%H:%M:%S")
    flags = dict(settings)
    if ray_address:
        from shardserve.launch.cluster import resolve_address, use_cluster_auth
        ray_address = resolve_address(ray_address)
        os.environ["RAY_ADDRESS"] = ray_address  # the runtime's Ray executor joins it
        use_cluster_auth()
    with _user_errors():
        flags.update(parse_set(set_ or []))
        flags["env"] = parse_env(env or []) or None
        config, plan = settle(str(plan_file) if plan_file else None, profile, flags,
                              ray_address)
        key = api_key_from_env(api_key)
        listener = bind_port(setting(config, "host"), setting(config, "port"))  # before anything loads
    try:
        with _user_errors():
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
    from shardserve.launch.cluster import (read_record, resolve_address, state_dir,
                                           use_cluster_auth)
    from shardserve.launch.doctor import run_checks
    from shardserve.launch.launcher import read_plan_file

    with _user_errors():
        plan = read_plan_file(str(plan_file)) if plan_file else None
        record = read_record(state_dir())
        address = resolve_address(ray_address) or (record.address if record else None)
        if address:
            use_cluster_auth()
        checks = run_checks(plan, cluster_address=address)
    if format is not Format.table:
        _print_data({"checks": [c.to_dict() for c in checks]}, format)
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
    with _user_errors():
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
    with _user_errors():
        path = find_profile(name)
        values = load_profile(name).set_values()
    print(f"# {path}")
    print(yaml.safe_dump(values, sort_keys=False), end="")


cluster_app = typer.Typer(no_args_is_help=True, help="Start, join, inspect and stop the Ray "
                          "cluster that multi-node launches run on.")
app.add_typer(cluster_app, name="cluster")
_StateDir = Annotated[Optional[str], typer.Option(
    "--state-dir", envvar="SHARDSERVE_CLUSTER_DIR",
    help="Where this host keeps its node record and token (default ~/.shardserve/cluster).")]
_NodeIp = Annotated[Optional[str], typer.Option(
    help="This host's address (default: the interface that routes to the head).")]
_NumGpus = Annotated[Optional[int], typer.Option(help="GPUs to offer (default: all Ray finds).")]
_NumCpus = Annotated[Optional[int], typer.Option(help="CPUs to offer (default: all).")]
_TokenFile = Annotated[Optional[str], typer.Option(
    help="The cluster's token (default: RAY_AUTH_TOKEN; a new head makes one).")]


@cluster_app.command("up")
def cluster_up(
    head: Annotated[bool, typer.Option("--head", help="Start the head node (required).")] = False,
    node_ip: _NodeIp = None,
    port: Annotated[int, typer.Option(help="The head's port (0: any free port).")] = 6379,
    num_gpus: _NumGpus = None, num_cpus: _NumCpus = None, token_file: _TokenFile = None,
    state_dir: _StateDir = None,
) -> None:
    """Start this host as the cluster's head; returns once it is registered."""
    from shardserve.launch import cluster
    with _user_errors():
        if not head:
            raise cluster.ClusterError("`cluster up` starts a head: pass --head (workers use "
                                       "`shardserve cluster join HEAD_IP:PORT`)")
        folder = cluster.state_dir(state_dir)
        address = cluster.choose_node_ip(None, node_ip)
        record = cluster.start_node(folder, None, address, port, num_gpus, num_cpus, token_file)
    out = Console()
    out.print(f"head node up at [bold]{record.address}[/]")
    _print_node_choice(out, record, address.reason)
    out.print(f"token: {cluster.token_path(folder)} (copy it to each worker, then run there)\n"
              f"  shardserve cluster join {record.address} --token-file auth_token")
    out.print("launch with: shardserve launch --ray-address "
              f"{record.address} ...   (status: shardserve cluster status)")
    err.print("[yellow]warning:[/] traffic between the nodes (Ray, NCCL, gloo) is not "
              "encrypted; token authentication keeps strangers out of Ray but the network "
              "must stay private (no public IPs, a firewall in front)", highlight=False)


@cluster_app.command("join")
def cluster_join(
    head_address: Annotated[str, typer.Argument(metavar="HEAD_IP:PORT")],
    node_ip: _NodeIp = None, num_gpus: _NumGpus = None, num_cpus: _NumCpus = None,
    token_file: _TokenFile = None, state_dir: _StateDir = None,
) -> None:
    """Join this host to the cluster whose head is at HEAD_IP:PORT; returns once registered."""
    from shardserve.launch import cluster
    with _user_errors():
        host, sep, port_text = head_address.rpartition(":")
        if not sep or not host or not port_text.isdigit():
            raise cluster.ClusterError(f"{head_address!r} is not HEAD_IP:PORT (e.g. "
                                       "10.0.0.1:6379, as `cluster up` printed)")
        folder = cluster.state_dir(state_dir)
        address = cluster.choose_node_ip(host, node_ip)
        record = cluster.start_node(folder, (host, int(port_text)), address, 0, num_gpus,
                                    num_cpus, token_file)
    out = Console()
    out.print(f"joined the cluster at [bold]{record.address}[/] as {record.node_ip}")
    _print_node_choice(out, record, address.reason)


def _print_node_choice(out: Console, record, reason: str) -> None:
    out.print(f"node IP {record.node_ip} on {record.interface} ({reason}); the node's ranks "
              f"get NCCL_SOCKET_IFNAME={record.interface} GLOO_SOCKET_IFNAME={record.interface}")
    out.print(f"{len(record.pids)} Ray processes recorded; stop them with `shardserve cluster "
              "down` (not `ray stop`, which ends every Ray process on the host)")


@cluster_app.command("status")
def cluster_status(
    address: Annotated[Optional[str], typer.Option(
        "--ray-address", "--address", envvar="RAY_ADDRESS",
        help="HEAD_IP:PORT (default: the cluster this host joined).")] = None,
    format: Annotated[Format, typer.Option("--format", help="table, json or yaml.")]
    = Format.table,
    state_dir: _StateDir = None,
) -> None:
    """List every node: IP, GPUs, CPUs, liveness, versions, and what differs between nodes."""
    from shardserve.launch import cluster
    from shardserve.launch.ray_nodes import list_nodes, node_problems
    with _user_errors():
        folder = cluster.state_dir(state_dir)
        record = cluster.read_record(folder)
        os.environ.update(cluster.auth_env(folder))
        nodes = list_nodes(None, address or (record.address if record else None))
    reference = next((n["facts"] for n in nodes if n["head"] and "facts" in n), None)
    problems = node_problems(nodes, reference) if reference else {}
    rows = [{"ip": n["ip"], "alive": n["alive"], "head": n["head"], "gpus": n["gpus"],
             "cpus": n["cpus"], "versions": n.get("facts", {}).get("versions"),
             "problems": problems.get(n["ip"], [])} for n in nodes]
    if format is not Format.table:
        _print_data({"nodes": rows}, format)
    else:
        from rich.table import Table
        table = Table("ip", "role", "alive", "gpus", "cpus", "versions", "problems")
        for r in rows:
            versions = ", ".join(f"{k} {v}" for k, v in (r["versions"] or {}).items())
            table.add_row(r["ip"], "head" if r["head"] else "worker",
                          "[green]yes[/]" if r["alive"] else "[red]no[/]", str(r["gpus"]),
                          str(r["cpus"]), versions, "; ".join(r["problems"]))
        Console().print(table)
    if any(not r["alive"] or r["problems"] for r in rows):
        raise typer.Exit(1)


@cluster_app.command("down")
def cluster_down(state_dir: _StateDir = None) -> None:
    """Stop the Ray node this host started (only its recorded processes)."""
    from shardserve.launch import cluster
    with _user_errors():
        record = cluster.stop_node(cluster.state_dir(state_dir))
    if record is None:
        Console().print("no Ray node started by shardserve on this host; nothing to stop")
    else:
        Console().print(f"stopped the {record.role} node {record.node_ip} "
                        f"(cluster {record.address})")


@app.command(short_help="Time this runtime's operators here; `plan` uses them for this GPU.")
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

    with _user_errors():
        setup = settle_calibration(device, dtype, sizes, output, tensor_parallel_size)
        run_calibration(setup, Console())


def _print_data(data: dict, format: Format) -> None:
    if format is Format.json:
        print(json.dumps(data, indent=2))
    else:
        import yaml
        print(yaml.safe_dump(data, sort_keys=False), end="")


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
    # NOTE: click exits 2 on a usage error; here 2 means "does not fit", so bad input exits 1
    # (typer carries its own click: its UsageError is reached through the public BadParameter)
    typer.BadParameter.__base__.exit_code = 1  # type: ignore[union-attr]  # the base: click's UsageError
    app(prog_name="shardserve")
