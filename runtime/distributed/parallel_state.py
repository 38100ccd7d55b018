"""The process's place in the tensor/pipeline grid, set once, and the collectives that use it.

Global ranks map to groups like this (tp_size=2, pp_size=2):

    global rank | pp_rank (stage) | tp_rank
    ------------+-----------------+--------
         0      |        0        |    0
         1      |        0        |    1
         2      |        1        |    0
         3      |        1        |    1

    global_rank = pp_rank * tp_size + tp_rank
    TP group of a rank: the ranks of its stage.  PP neighbours: same tp_rank, stage +/- 1.
The output rank (the one that samples and returns results) is tp_rank 0 of the last stage.
Stage p owns `layer_split[p]` consecutive layers (the planner's split; None: even).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    layer_split: tuple[int, ...] | None = None  # layers per stage; None: the even split
    enable_expert_parallel: bool = False  # MoE: whole experts per tp rank (num_experts / tp_size each)

    def __post_init__(self) -> None:
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(f"invalid parallel state {self}")
        if self.layer_split is not None and len(self.layer_split) != self.pp_size:
            raise ValueError(f"layer_split {self.layer_split} does not have pp_size={self.pp_size} stages")

    def __str__(self) -> str:
        """As logs name a rank: 'tp 1/2, pp 0/2'."""
        return f"tp {self.tp_rank}/{self.tp_size}, pp {self.pp_rank}/{self.pp_size}"

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def global_rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def previous_stage_rank(self) -> int:
        """Global rank this rank receives IntermediateTensors from (not on the first stage)."""
        return self.global_rank - self.tp_size

    @property
    def next_stage_rank(self) -> int:
        """Global rank this rank sends IntermediateTensors to (not on the last stage)."""
        return self.global_rank + self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_output_rank(self) -> bool:
        return self.is_last_stage and self.tp_rank == 0


_STATE = ParallelState()
_TP_GROUP = None  # torch.distributed ProcessGroup of this rank's stage, once groups exist


def get_parallel_state() -> ParallelState:
    return _STATE


def set_parallel_state(state: ParallelState) -> None:
    """Called once per worker process before the model is built."""
    global _STATE
    _STATE = state


def set_tensor_parallel_group(group) -> None:
    """Called once per worker process by distributed.init_distributed."""
    global _TP_GROUP
    _TP_GROUP = group


def tensor_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _STATE.tp_size == 1:
        return x
    torch.distributed.all_reduce(x, group=_TP_GROUP)
    return x


def tensor_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _STATE.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.tp_size)]
    torch.distributed.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)


def world_any(flags: list[bool], device: torch.device) -> list[bool]:
    """Each flag, set where any rank of the engine set it: one all-reduce (MAX) over every rank, so all
    ranks must call it with as many flags (alone, a rank's own flags come back)."""
    if _STATE.world_size == 1:
        return flags
    agreed = torch.tensor(flags, dtype=torch.int32, device=device)
    torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)  # the default group: every rank
    return [bool(flag) for flag in agreed.tolist()]
