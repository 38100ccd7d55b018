"""Joining the process grid: rendezvous, the default group, and one tensor-parallel group per stage."""

from __future__ import annotations

import logging
import os
import secrets
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

from shardserve.runtime.distributed.parallel_state import ParallelState, set_parallel_state, set_tensor_parallel_group

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(minutes=5)  # a collective stuck this long fails its rank
CHECK_KEY = "engine"  # the engine writes it under the secret before any rank starts
# NOTE: libuv's store serves a socket handed to it only from torch 2.8 on; the older backend always did
LIBUV_TAKES_LISTEN_FD = TorchVersion(torch.__version__) >= "2.8"


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where ranks meet: the engine's store, and the secret its keys live under. It reaches a rank
    only through the channel that starts it (the mp pipe, a Ray actor's arguments)."""

    host: str
    port: int
    secret: str = field(repr=False)


def start_rendezvous(host: str, world_size: int) -> tuple[dist.TCPStore, Rendezvous]:
    """The store server, in the engine process (it must outlive no worker), listening on `host` alone
    at a port the OS picks (two engines on one machine never collide). NOTE: TCPStore listens on
    every interface whatever its host, so the socket is bound here and handed to it. Dropping the
    returned store stops the server."""
    listener = socket.create_server((host, 0), family=socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0])
    port, fd = listener.getsockname()[1], listener.detach()
    try:
        store = dist.TCPStore(host, port, world_size + 1, is_master=True, timeout=COLLECTIVE_TIMEOUT,
                              wait_for_workers=False, master_listen_fd=fd, use_libuv=LIBUV_TAKES_LISTEN_FD)
    except BaseException:
        os.close(fd)
        raise
    rendezvous = Rendezvous(host, port, secrets.token_hex(16))
    dist.PrefixStore(rendezvous.secret, store).set(CHECK_KEY, "1")
    return store, rendezvous


def join_rendezvous(rendezvous: Rendezvous, world_size: int) -> dist.PrefixStore:
    """A rank's view of the engine's store: only the keys under the secret. Refuses a store without
    the engine's check key (another engine's, or a stranger's on a reused port).
    NOTE: TCPStore has no authentication; anyone who can connect can list its keys, the secret
    among them. The secret stops blind and accidental writes; the bind (loopback, or the cluster
    interface) and closing the store early (needs_store_after_joining) limit who can connect."""
    client = dist.TCPStore(rendezvous.host, rendezvous.port, world_size + 1, is_master=False,
                           timeout=COLLECTIVE_TIMEOUT)
    store = dist.PrefixStore(rendezvous.secret, client)
    if not store.check([CHECK_KEY]):
        raise RuntimeError(f"the rendezvous store at {rendezvous.host}:{rendezvous.port} is not this engine's "
                           "(its check key is missing under this rank's secret)")
    return store


def needs_store_after_joining(device: torch.device) -> bool:
    """Whether ranks still use the store once every rank has joined. NOTE: NCCL makes communicators
    through it lazily (a group's first collective, each pair's first send) and its watchdog polls it
    for as long as the group lives; gloo connects every pair of a group while making the group and
    never reads the store again, unless TORCH_GLOO_LAZY_INIT defers that to first use."""
    lazy_gloo = os.environ.get("TORCH_GLOO_LAZY_INIT", "0").lower() not in ("", "0", "false")
    return distributed_backend(device) == "nccl" or lazy_gloo


def distributed_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(state: ParallelState, rendezvous: Rendezvous, device: torch.device) -> None:
    """Join the world, then build every stage's TP group (each rank must create all groups, in the
    same order) and keep its own. NOTE: stages talk point to point on the default group by global
    rank, so no separate PP group is needed."""
    set_parallel_state(state)
    store = join_rendezvous(rendezvous, state.world_size)
    dist.init_process_group(distributed_backend(device), store=store, rank=state.global_rank,
                            world_size=state.world_size, timeout=COLLECTIVE_TIMEOUT)
    tp_group = None
    for stage in range(state.pp_size):
        ranks = [stage * state.tp_size + t for t in range(state.tp_size)]
        group = dist.new_group(ranks) if state.tp_size > 1 else None
        if stage == state.pp_rank:
            tp_group = group
    set_tensor_parallel_group(tp_group)
    logger.debug("rank %d joined: tp %d/%d, pp %d/%d on %s", state.global_rank, state.tp_rank, state.tp_size,
                 state.pp_rank, state.pp_size, device)


def destroy_distributed() -> None:
    set_tensor_parallel_group(None)
    if dist.is_initialized():
        dist.destroy_process_group()
