"""`shardserve cluster`: start, join, inspect and stop the Ray cluster multi-node launches run on."""

from __future__ import annotations

import os
from typing import Annotated, Optional

import typer
from rich.console import Console

from shardserve.launch.cli_support import Format, err, print_data, user_errors

cluster_app = typer.Typer(no_args_is_help=True, help="Start, join, inspect and stop the Ray "
                          "cluster that multi-node launches run on.",
                          short_help="Start, join, inspect and stop the Ray cluster.")
_StateDir = Annotated[Optional[str], typer.Option(
    "--state-dir", envvar="SHARDSERVE_CLUSTER_DIR",
    help="Where this host keeps its node record and token (default ~/.shardserve/cluster).")]
_NodeIp = Annotated[Optional[str], typer.Option(
    help="This host's address (default: the interface that routes to the head).")]
_NumGpus = Annotated[Optional[int], typer.Option(help="GPUs to offer (default: all Ray finds).")]
_NumCpus = Annotated[Optional[int], typer.Option(help="CPUs to offer (default: all).")]
_TokenFile = Annotated[Optional[str], typer.Option(
    help="The cluster's token (default: RAY_AUTH_TOKEN; a new head makes one).")]


@cluster_app.command("up", short_help="Start this host as the cluster's head.")
def cluster_up(
    head: Annotated[bool, typer.Option("--head", help="Start the head node (required).")] = False,
    node_ip: _NodeIp = None,
    port: Annotated[int, typer.Option(min=0, max=65535, help="The head's port (0: any free port); not in Ray's "
                                      "worker-port range 10002-19999 nor 8265, 10001, 52365.")] = 6379,
    num_gpus: _NumGpus = None, num_cpus: _NumCpus = None, token_file: _TokenFile = None,
    state_dir: _StateDir = None,
) -> None:
    """Start this host as the cluster's head; returns once it is registered."""
    from shardserve.launch.cluster import ray_cluster as cluster
    with user_errors():
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


@cluster_app.command("join", short_help="Join this host to the cluster at HEAD_IP:PORT.")
def cluster_join(
    head_address: Annotated[str, typer.Argument(metavar="HEAD_IP:PORT")],
    node_ip: _NodeIp = None, num_gpus: _NumGpus = None, num_cpus: _NumCpus = None,
    token_file: _TokenFile = None, state_dir: _StateDir = None,
) -> None:
    """Join this host to the cluster whose head is at HEAD_IP:PORT; returns once registered."""
    from shardserve.launch.cluster import ray_cluster as cluster
    with user_errors():
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


@cluster_app.command("status", short_help="List the nodes: IP, GPUs, CPUs, liveness, versions.")
def cluster_status(
    address: Annotated[Optional[str], typer.Option(
        "--ray-address", "--address", envvar="RAY_ADDRESS",
        help="HEAD_IP:PORT (default: the cluster this host joined).")] = None,
    format: Annotated[Format, typer.Option("--format", help="table, json or yaml.")]
    = Format.table,
    state_dir: _StateDir = None,
) -> None:
    """List every node: IP, GPUs, CPUs, liveness, versions, and what differs between nodes."""
    from shardserve.launch.cluster import ray_cluster as cluster
    from shardserve.launch.cluster.ray_nodes import list_nodes, node_problems
    with user_errors():
        folder = cluster.state_dir(state_dir)
        record = cluster.read_record(folder)
        os.environ.update(cluster.auth_env(folder))
        nodes = list_nodes(None, cluster.resolve_address(address, folder) or (record.address if record else None))
    reference = next((n["facts"] for n in nodes if n["head"] and "facts" in n), None)
    problems = node_problems(nodes, reference) if reference else {}
    rows = [{"ip": n["ip"], "alive": n["alive"], "head": n["head"], "gpus": n["gpus"],
             "cpus": n["cpus"], "versions": n.get("facts", {}).get("versions"),
             "problems": problems.get(n["ip"], [])} for n in nodes]
    if format is not Format.table:
        print_data({"nodes": rows}, format)
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


@cluster_app.command("down", short_help="Stop the Ray node this host started.")
def cluster_down(state_dir: _StateDir = None) -> None:
    """Stop the Ray node this host started (only its recorded processes)."""
    from shardserve.launch.cluster import ray_cluster as cluster
    with user_errors():
        record = cluster.stop_node(cluster.state_dir(state_dir))
    if record is None:
        Console().print("no Ray node started by shardserve on this host; nothing to stop")
    else:
        Console().print(f"stopped the {record.role} node {record.node_ip} "
                        f"(cluster {record.address})")
