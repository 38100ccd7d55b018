"""What one machine holds that a multi-node launch depends on (versions, interfaces, the model's
files, NCCL/gloo variables), and the differences between two machines that break a launch."""

from __future__ import annotations

import fcntl
import os
import platform
import socket
import struct
from importlib import metadata
from pathlib import Path

PACKAGES = ("shardserve", "torch", "transformers", "ray")
ENV_PREFIXES = ("NCCL_", "GLOO_")
IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")  # each node's own interface
_SIOCGIFADDR = 0x8915


def interface_addresses() -> dict[str, str | None]:
    """Each interface -> its (primary) IPv4 address, None where it has none.
    NOTE: the ioctl needs no iproute2 and reads the same table `ip addr` shows."""
    table: dict[str, str | None] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                table[name] = None
                continue
            table[name] = socket.inet_ntoa(raw[20:24])
    return table


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for package in PACKAGES:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return found


def model_files(path: str | None) -> dict[str, int] | None:
    """File name -> size for the files a load reads; None if the folder is missing."""
    if path is None:
        return {}
    folder = Path(path)
    if not folder.is_dir():
        return None
    return {f.name: f.stat().st_size for f in sorted(folder.iterdir())
            if f.is_file() and (f.suffix in (".safetensors", ".json", ".model", ".txt", ".jinja"))}


def node_facts(model_path: str | None = None, ip: str | None = None) -> dict:
    """This machine's facts; `ip` is the address Ray knows it by (looked up when run in Ray)."""
    if ip is None:
        try:
            import ray
            ip = ray.util.get_node_ip_address() if ray.is_initialized() else None
        except ImportError:
            ip = None
    return {"ip": ip, "hostname": socket.gethostname(), "versions": versions(),
            "interfaces": interface_addresses(),
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
            "model": {"path": model_path, "files": model_files(model_path)}}


def version_differences(reference: dict, node: dict) -> list[str]:
    ref, got = reference["versions"], node["versions"]
    return [f"{name} {got.get(name, 'missing')} there, {ref.get(name, 'missing')} on "
            f"{reference['ip'] or 'the launching host'}"
            for name in ("python", *PACKAGES) if ref.get(name) != got.get(name)]


def model_differences(reference: dict, node: dict) -> list[str]:
    path, want, have = node["model"]["path"], reference["model"]["files"], node["model"]["files"]
    if not path or want is None:
        return []
    if have is None:
        return [f"the model folder {path} is missing"]
    if want and not have:
        return [f"the model folder {path} is empty"]
    missing = [name for name in want if name not in have]
    problems = [f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing from {path}"
                ] if missing else []
    problems += [f"{name} is {have[name]:,} bytes there, {size:,} bytes on "
                 f"{reference['ip'] or 'the launching host'} (a partial copy?)"
                 for name, size in want.items() if name in have and have[name] != size]
    return problems


def ip_problem(node: dict) -> str | None:
    """The several-IPs pitfall: Ray knows the node by an address none of its interfaces has."""
    if node["ip"] and node["ip"] not in node["interfaces"].values():
        owned = ", ".join(f"{n} {a}" for n, a in sorted(node["interfaces"].items()) if a)
        return (f"Ray knows this node as {node['ip']}, which none of its interfaces has "
                f"({owned})")
    return None


def interface_problem(node: dict) -> str | None:
    """NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME naming an interface the node lacks."""
    names = node["interfaces"].keys()
    for var in IFNAME_VARS:
        value = node["env"].get(var)
        if not value or value.startswith("^"):
            continue
        wanted = [v.lstrip("=") for v in value.split(",") if v]
        if not any(any(n.startswith(w) for n in names) for w in wanted):
            return f"{var}={value} names none of its interfaces ({', '.join(sorted(names))})"
    return None


def env_differences(reference: dict, node: dict) -> list[str]:
    """NCCL_*/GLOO_* variables set differently (the interface names are each node's own)."""
    ref, got = reference["env"], node["env"]
    keys = sorted((ref.keys() | got.keys()) - set(IFNAME_VARS))
    return [f"{k}={got.get(k, '<unset>')} there, {ref.get(k, '<unset>')} on the head"
            for k in keys if ref.get(k) != got.get(k)]
