"""`shardserve cluster up/join/status/down`: start and stop this host's Ray node with the IP that
routes to the head, token authentication on, NCCL/gloo told the same interface, and the node's
process ids recorded so that `down` stops only what `up`/`join` started."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, overload

from shardserve.launch.cluster.node_facts import IFNAME_VARS, interface_addresses
from shardserve.launch.cluster.ray_ports import head_port_problem, local_ray_instances
from shardserve.planner import PlanError

REGISTER_TIMEOUT_SECONDS = 60.0
STOP_GRACE_SECONDS = 10.0
_UNROUTABLE = "192.0.2.1"  # TEST-NET-1: a UDP connect to it only asks the kernel for a route
# NOTE: the GCS declares a silent node dead after period x threshold; Ray's default (3 s x 5)
# leaves /health green for 15 s after a node is lost
HEAD_ENV = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
            "RAY_health_check_failure_threshold": "3"}



class ClusterError(PlanError):
    exit_code = 1


@dataclass(frozen=True)
class NodeAddress:
    ip: str
    interface: str
    reason: str


@dataclass
class NodeRecord:
    """What this host started, kept in the state folder (node.json)."""

    role: str  # head | worker
    address: str  # the head's ip:port
    node_ip: str
    interface: str
    session_id: int  # `ray start` ran as a session leader: every Ray process here is in it
    pids: list[list[Any]]  # [pid, start time in clock ticks (None: it had ended)]: a reused pid is not ours
    temp_dir: str


def state_dir(flag: str | None = None) -> Path:
    return Path(flag or os.environ.get("SHARDSERVE_CLUSTER_DIR")
                or Path.home() / ".shardserve" / "cluster")


def route_source(destination: str) -> str | None:
    """The source address the kernel picks to reach `destination` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((destination, 9))
        except OSError:
            return None
        return s.getsockname()[0]


def choose_node_ip(head_ip: str | None, node_ip: str | None,
                   interfaces: dict[str, str | None] | None = None) -> NodeAddress:
    """The interface that routes to the head (a worker) or carries the default route (the head).
    NOTE: not the first interface found: that is how Ray and NCCL end up on different networks."""
    table = {n: a for n, a in (interfaces or interface_addresses()).items() if a}
    by_ip = {a: n for n, a in table.items()}
    if node_ip:
        if node_ip not in by_ip:
            raise ClusterError(f"--node-ip {node_ip} is on no interface of this host "
                               f"({_describe(table)})")
        return NodeAddress(node_ip, by_ip[node_ip], "given with --node-ip")
    if head_ip:
        source = route_source(head_ip)
        if source is None or source not in by_ip:
            raise ClusterError(f"no route from this host to the head {head_ip} "
                               f"({_describe(table)}): fix the network or pass --node-ip")
        if source.startswith("127."):
            return NodeAddress(source, by_ip[source], "the head is this host's loopback")
        return NodeAddress(source, by_ip[source], f"{by_ip[source]} routes to the head {head_ip}")
    source = route_source(_UNROUTABLE)
    if source in by_ip and not source.startswith("127."):
        return NodeAddress(source, by_ip[source], f"{by_ip[source]} carries the default route")
    candidates = {n: a for n, a in table.items() if not a.startswith("127.")}
    if len(candidates) == 1:
        (name, ip), = candidates.items()
        return NodeAddress(ip, name, f"{name} is the only interface besides loopback")
    raise ClusterError(f"no default route and {len(candidates)} candidate interfaces "
                       f"({_describe(candidates)}): pass --node-ip with the address the other "
                       "nodes reach this host at")


def _describe(table: dict) -> str:
    return ", ".join(f"{n} {a}" for n, a in sorted(table.items())) or "no IPv4 interfaces"


def read_record(folder: Path) -> NodeRecord | None:
    try:
        return NodeRecord(**json.loads((folder / "node.json").read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as e:
        raise ClusterError(f"{folder / 'node.json'} is unreadable ({e}): remove it after "
                           "checking no Ray node of ours runs (ps -ef | grep raylet)") from None


def _write_record(folder: Path, record: NodeRecord) -> None:
    tmp = folder / "node.json.tmp"
    tmp.write_text(json.dumps(asdict(record), indent=2))
    tmp.replace(folder / "node.json")


def token_path(folder: Path) -> Path:
    return folder / "auth_token"


def token_env(folder: Path) -> dict[str, str]:
    """Ray's token authentication with the token kept in `folder`."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path(folder))}


def auth_env(folder: Path | None = None) -> dict[str, str]:
    """Variables a Ray client needs to reach a cluster this host belongs to, unless the caller's
    environment already says how to authenticate."""
    folder = folder or state_dir()
    if "RAY_AUTH_MODE" in os.environ or "RAY_AUTH_TOKEN" in os.environ or \
            not token_path(folder).is_file():
        return {}
    return token_env(folder)


def use_cluster_auth() -> None:
    os.environ.update(auth_env())


@overload
def resolve_address(address: str, folder: Path | None = None) -> str: ...
@overload
def resolve_address(address: None, folder: Path | None = None) -> None: ...


def resolve_address(address: str | None, folder: Path | None = None) -> str | None:
    """'auto' means the cluster this host joined through `cluster up/join` (its record), said on stderr;
    anything else is Ray's to read. NOTE: never Ray's own 'auto', which attaches to whatever Ray instance
    runs on the host (another user's, a test's)."""
    if address != "auto":
        return address
    folder = folder or state_dir()
    record = read_record(folder)
    if record is not None and _alive(record):
        print(f"--ray-address auto: the cluster at {record.address}, which this host joined as its "
              f"{record.role} (read from {folder / 'node.json'}, written by `shardserve cluster "
              f"{'up' if record.role == 'head' else 'join'}`)", file=sys.stderr)
        return record.address
    if record is not None:
        raise ClusterError(f"--ray-address auto: {folder / 'node.json'} records the cluster at {record.address}, "
                           "but this host's Ray node of it no longer runs: `shardserve cluster down`, then "
                           "`cluster up`/`join` again, or pass --ray-address HOST:PORT")
    found = local_ray_instances()
    if found:
        listed = ", ".join(f"{a} (process {pid})" for a, pid in sorted(found.items()))
        raise ClusterError(f"--ray-address auto: this host joined no cluster through `shardserve cluster "
                           f"up/join` (no {folder / 'node.json'}), but Ray runs here: {listed}; pass "
                           f"--ray-address {min(found)} to use it, or start one with `shardserve cluster up --head`")
    raise ClusterError(f"--ray-address auto: this host joined no cluster through `shardserve cluster up/join` "
                       f"(no {folder / 'node.json'}) and no Ray runs here: `shardserve cluster up --head` "
                       "(or `cluster join HEAD_IP:PORT`) first, or pass --ray-address HOST:PORT")


def _save_token(folder: Path, token_file: str | None, is_head: bool) -> None:
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as e:
            raise ClusterError(f"cannot read --token-file {token_file}: {e.strerror}") from None
    elif os.environ.get("RAY_AUTH_TOKEN"):
        token = os.environ["RAY_AUTH_TOKEN"].strip()
    elif is_head:
        token = secrets.token_hex(32)
    else:
        raise ClusterError("the cluster uses token authentication: copy the head's token file "
                           "(printed by `shardserve cluster up`) here and pass --token-file, "
                           "or set RAY_AUTH_TOKEN")
    if not token:
        raise ClusterError("the token is empty: copy the head's token file again")
    fd = os.open(token_path(folder), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # also when the file was already there with looser bits
        f.write(token)


def _check_reachable(head: str, port: int) -> None:
    try:
        with socket.create_connection((head, port), timeout=5.0):
            pass
    except OSError as e:
        raise ClusterError(f"cannot reach the head at {head}:{port} ({e.strerror or e}): is "
                           "`shardserve cluster up --head` running there, and is the port open "
                           "between the hosts?") from None


def start_node(folder: Path, head: tuple[str, int] | None, address: NodeAddress,
               port: int, num_gpus: int | None, num_cpus: int | None,
               token_file: str | None) -> NodeRecord:
    """`ray start` as a session leader, wait until the node is registered, record its processes.
    `head` is None to start a head (on `port`), else the head to join."""
    record = read_record(folder)
    if record is not None and _alive(record):
        raise ClusterError(f"this host already runs a Ray node of ours ({record.role}, "
                           f"{record.node_ip}, cluster {record.address}): "
                           "`shardserve cluster down` first")
    if head is not None:
        _check_reachable(*head)
    elif problem := head_port_problem(port):
        raise ClusterError(problem)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    _save_token(folder, token_file, head is None)
    # NOTE: Ray's socket paths must stay under ~107 bytes, so its temp dir is short, not in folder
    temp_dir = tempfile.mkdtemp(prefix="shardserve-ray-")
    command = [sys.executable, "-m", "ray.scripts.scripts", "start",
               f"--node-ip-address={address.ip}", f"--temp-dir={temp_dir}",
               "--disable-usage-stats"]
    command += ([f"--address={head[0]}:{head[1]}"] if head else ["--head", f"--port={port}"])
    command += [f"--num-gpus={num_gpus}"] if num_gpus is not None else []
    command += [f"--num-cpus={num_cpus}"] if num_cpus is not None else []
    env = {**os.environ, **node_env(folder, address, is_head=head is None)}
    log = folder / "ray-start.log"
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        code = process.wait(timeout=REGISTER_TIMEOUT_SECONDS * 2)
    joined = f"{head[0]}:{head[1]}" if head else _head_address(temp_dir)
    record = NodeRecord("worker" if head else "head", joined or "", address.ip,
                        address.interface, process.pid, [], temp_dir)
    record.pids = [[pid, _start_time(pid)] for pid in session_pids(record.session_id)]
    _write_record(folder, record)
    if code != 0 or not joined:
        stop_node(folder)
        raise ClusterError(f"`ray start` failed (exit {code}); its output is in {log}:\n"
                           + _tail(log))
    try:
        wait_registered(record.address, address.ip, folder)
    except BaseException:
        stop_node(folder)
        raise
    record.pids = [[pid, _start_time(pid)] for pid in session_pids(record.session_id)]
    _write_record(folder, record)
    return record


def node_env(folder: Path, address: NodeAddress, is_head: bool) -> dict[str, str]:
    """The environment of this host's Ray node, so every rank started on it inherits it."""
    env = token_env(folder) | dict.fromkeys(IFNAME_VARS, address.interface)
    if is_head:
        env |= {k: v for k, v in HEAD_ENV.items() if k not in os.environ}
    return env


def _head_address(temp_dir: str) -> str | None:
    try:
        return (Path(temp_dir) / "ray_current_cluster").read_text().strip() or None
    except OSError:
        return None


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def wait_registered(address: str, node_ip: str, folder: Path) -> None:
    """Return once the cluster lists this node alive (a fresh process: ray.init is one per process)."""
    code = ("import ray, sys, time\n"
            f"ray.init(address={address!r}, log_to_driver=False, logging_level='ERROR')\n"
            f"deadline = time.monotonic() + {REGISTER_TIMEOUT_SECONDS}\n"
            "while time.monotonic() < deadline:\n"
            f"    if any(n['Alive'] and n['NodeManagerAddress'] == {node_ip!r} for n in ray.nodes()):\n"
            "        sys.exit(0)\n"
            "    time.sleep(0.5)\n"
            "sys.exit(3)\n")
    env = {**os.environ, **token_env(folder)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            timeout=REGISTER_TIMEOUT_SECONDS * 2)
    if result.returncode != 0:
        raise ClusterError(f"the node {node_ip} did not register with {address} within "
                           f"{REGISTER_TIMEOUT_SECONDS:.0f} s (wrong token, or a firewall "
                           f"between the hosts?):\n{result.stderr.strip()[-1500:]}")


def stop_node(folder: Path) -> NodeRecord | None:
    """Stop the processes this host's `up`/`join` started (SIGTERM, then SIGKILL), nothing else."""
    record = read_record(folder)
    if record is None:
        return None
    ours = _our_pids(record)
    for pid in ours:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    while time.monotonic() < deadline and (ours := _our_pids(record)):
        time.sleep(0.2)
    for pid in ours:
        _signal(pid, signal.SIGKILL)
    shutil.rmtree(record.temp_dir, ignore_errors=True)
    (folder / "node.json").unlink(missing_ok=True)
    return record


def _our_pids(record: NodeRecord) -> list[int]:
    """Live processes of the recorded session, plus recorded ones that are still the same process."""
    pids = set(session_pids(record.session_id))
    pids |= {pid for pid, started in record.pids if _start_time(pid) == started}
    return sorted(pids)


def _alive(record: NodeRecord) -> bool:
    return bool(_our_pids(record))


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (which may hold spaces)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def _start_time(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[19]) if fields else None  # field 22 of stat: start time


def session_pids(session_id: int) -> list[int]:
    """Processes whose session is `session_id`, zombies excluded."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields and fields[0] != "Z" and int(fields[3]) == session_id:
                found.append(int(entry.name))
    return found
