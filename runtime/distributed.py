"""Joining the process grid: rendezvous, the default group, and one tensor-parallel group per stage.

The engine process hosts the rendezvous store on a port the OS picks (bind to port 0), so two
engines on one machine never collide; each rank connects to it as a client."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shardserve.runtime.parallel_state import ParallelState, set_parallel_state, set_tensor_parallel_group

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(minutes=5)  # a collective stuck this long fails its rank


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where ranks meet: the engine's store."""

    host: str
    port: int


def start_rendezvous(host: str, world_size: int) -> tuple[dist.TCPStore, Rendezvous]:
    """The store server lives in the engine process (it must outlive no worker); port chosen free."""
    store = dist.TCPStore(host, 0, world_size + 1, is_master=True, timeout=COLLECTIVE_TIMEOUT,
                          wait_for_workers=False)
    return store, Rendezvous(host, store.port)


def distributed_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(state: ParallelState, rendezvous: Rendezvous, device: torch.device) -> None:
    """Join the world, then build every stage's TP group (each rank must create all groups, in the
    same order) and keep its own. NOTE: stages talk point to point on the default group by global
    rank, so no separate PP group is needed."""
    set_parallel_state(state)
    store = dist.TCPStore(rendezvous.host, rendezvous.port, state.world_size + 1, is_master=False,
                          timeout=COLLECTIVE_TIMEOUT)
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
