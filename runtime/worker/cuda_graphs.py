"""CUDA graphs for decode steps: the sizes to capture, padding a batch to one, the static inputs the
graphs read, capture and replay.

A decode step (one new token per request) of n requests replays the graph of the smallest captured
size >= n. Rows past n are padding that touches only a scratch block outside the block manager's pool:

    static rows:   | r0  r1  ...  r(n-1) | pad  ...  pad |     (size rows, size in capture_sizes)
    padding row:   token 0 at position 0, seq_len 1, block table [scratch, ...],
                   slot scratch * block_size: it writes and reads only the scratch block

Prefill and mixed steps, batches above the largest size, and the sampler run eagerly. Which ranks
capture at which sizes (all of them, the same ladder) is cuda_graph_plan.py's; a stage after the
first reads the previous stage's IntermediateTensors from static buffers too, filled before replay."""

from __future__ import annotations

import bisect
import logging
import time
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from shardserve.runtime.worker.forward_context import AttentionMetadata, ForwardContext, forward_context
from shardserve.runtime.worker.inputs import HostInputs, PendingTokens
from shardserve.runtime.worker.pipeline import IntermediateTensors
from shardserve.runtime.worker.staging import StagingBuffer

logger = logging.getLogger(__name__)


def padded_size(num_requests: int, sizes: list[int]) -> int | None:
    """The smallest of the (sorted) captured sizes that holds num_requests; None if none does."""
    index = bisect.bisect_left(sizes, num_requests)
    return sizes[index] if index < len(sizes) else None


@dataclass(slots=True)
class DecodeBatch:
    """A decode step padded to a captured size, on the host (see the module docstring)."""

    input_ids: np.ndarray  # [size] int64
    positions: np.ndarray  # [size] int64
    slot_mapping: np.ndarray  # [size] int64
    seq_lens: np.ndarray  # [size] int32
    block_tables: np.ndarray  # [size, widest block table of the step] int32
    pending_rows: np.ndarray  # [num_pending] int64: input ids to take from the last step's samples
    pending_sources: np.ndarray  # [num_pending] int64
    state_slots: np.ndarray | None = None  # [size] int64, padding rows in the scratch slot; None: no states
    group_tables: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # other KV groups' slots, tables

    @property
    def size(self) -> int:
        return len(self.input_ids)


def pad_decode_batch(host: HostInputs, size: int, scratch_block: int, block_size: int,
                     scratch_state: int | None = None) -> DecodeBatch:
    num_requests = host.num_requests
    if not host.is_decode_only or num_requests > size:
        raise ValueError(f"only a decode step of at most {size} requests pads to {size} rows; got "
                         f"{num_requests} requests and {host.num_tokens} tokens")
    num_padding = size - num_requests

    def padded(slot_mapping: np.ndarray, block_tables: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        tables = np.zeros((size, block_tables.shape[1]), dtype=np.int32)
        tables[:num_requests] = block_tables
        tables[num_requests:, 0] = scratch_block
        return np.concatenate((slot_mapping, np.full(num_padding, scratch_block * block_size, dtype=np.int64))), tables

    slot_mapping, tables = padded(host.slot_mapping, host.block_tables)
    return DecodeBatch(
        input_ids=np.concatenate((host.input_ids, np.zeros(num_padding, dtype=np.int64))),
        positions=np.concatenate((host.positions, np.zeros(num_padding, dtype=np.int64))),
        slot_mapping=slot_mapping, seq_lens=np.concatenate((host.seq_lens, np.ones(num_padding, dtype=np.int32))),
        block_tables=tables, pending_rows=host.pending_rows, pending_sources=host.pending_sources,
        group_tables=[padded(*pair) for pair in host.group_tables],
        state_slots=None if host.state_slots is None else np.concatenate(
            (host.state_slots, np.full(num_padding, scratch_state, dtype=np.int64))))


class StaticDecodeInputs:
    """The tensors every captured graph reads, at fixed addresses; a replay first copies its padded
    batch into the leading rows. Until then every row is padding, which is what capture runs on.
    block_tables has a column for every block of max_model_len; a step copies only its own width,
    and a request never reads columns past its seq_len."""

    def __init__(self, max_size: int, max_model_len: int, block_size: int, scratch_block: int,
                 device: torch.device, scratch_state: int | None = None, num_groups: int = 1):
        self.max_model_len = max_model_len
        max_blocks_per_request = -(-max_model_len // block_size)
        int32: dict[str, Any] = dict(dtype=torch.int32, device=device)
        int64: dict[str, Any] = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_size, **int64)
        self.positions = torch.zeros(max_size, **int64)
        self.seq_lens = torch.ones(max_size, **int32)
        self.query_start_loc = torch.arange(max_size + 1, **int32)  # one token per request, never changes

        def slots_and_tables() -> tuple[torch.Tensor, torch.Tensor]:
            tables = torch.zeros((max_size, max_blocks_per_request), **int32)
            tables[:, 0] = scratch_block
            return torch.full((max_size,), scratch_block * block_size, **int64), tables

        self.slot_mapping, self.block_tables = slots_and_tables()
        self.group_tables = [slots_and_tables() for _ in range(num_groups - 1)]  # the other KV groups'
        # the recurrent layers' state rows (a model with such layers): padding rows use the scratch slot
        self.state_slots = None if scratch_state is None else torch.full((max_size,), scratch_state, **int64)

    def load(self, batch: DecodeBatch, staging: StagingBuffer) -> PendingTokens | None:
        """One host->device copy through the staging buffer, then copies on the device into the
        static tensors. Returns where the pending input ids go (filled by the caller)."""
        size, width = batch.size, batch.block_tables.shape[1]
        extra: tuple[np.ndarray, ...] = () if batch.state_slots is None else (batch.state_slots,)
        extra += tuple(slots for slots, _ in batch.group_tables)
        tables = (batch.block_tables,) + tuple(t for _, t in batch.group_tables)
        moved = staging.to_device(batch.input_ids, batch.positions, batch.slot_mapping, batch.seq_lens, *extra,
                                  *tables, batch.pending_rows, batch.pending_sources)
        values, moved_tables, (rows, sources) = moved[:-2 - len(tables)], moved[-2 - len(tables):-2], moved[-2:]
        statics: tuple[torch.Tensor, ...] = (self.input_ids, self.positions, self.slot_mapping, self.seq_lens)
        if self.state_slots is not None:
            statics += (self.state_slots,)
        statics += tuple(slots for slots, _ in self.group_tables)
        for static, value in zip(statics, values, strict=True):
            static[:size].copy_(value)
        for static, value in zip((self.block_tables, *(t for _, t in self.group_tables)), moved_tables, strict=True):
            static[:size, :width].copy_(value)
        return PendingTokens(rows, sources) if len(batch.pending_rows) else None

    def metadata(self, size: int) -> AttentionMetadata:
        """Views of the first `size` rows. Nothing in it is read from a tensor on the host: the decode
        kernel takes its split count from max_model_len, fixed for every replay."""
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
                                 seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size],
                                 max_query_len=1, max_seq_len=self.max_model_len,
                                 query_start_loc_cpu=list(range(size + 1)), seq_lens_cpu=None,
                                 state_slots=None if self.state_slots is None else self.state_slots[:size])
        meta.groups = tuple(dataclasses.replace(meta, slot_mapping=slots[:size], block_tables=tables[:size])
                            for slots, tables in self.group_tables)
        return meta


def static_intermediate(max_size: int, hidden_size: int, dtype: torch.dtype,
                        device: torch.device) -> IntermediateTensors:
    """A later stage's graph input: [max_size, hidden_size] hidden states and residual. NOTE: the
    residual buffer exists whatever the model; families that hand none on (GPT-2, OPT) never read it."""
    hidden = torch.zeros(max_size, hidden_size, dtype=dtype, device=device)
    return IntermediateTensors(hidden, torch.zeros_like(hidden))


def leading_rows(output, num_rows: int):
    """The first num_rows of a graph's output: a tensor, or a stage's IntermediateTensors."""
    if isinstance(output, IntermediateTensors):
        residual = None if output.residual is None else output.residual[:num_rows]
        return IntermediateTensors(output.hidden_states[:num_rows], residual)
    return output[:num_rows]


class DecodeGraphRunner:
    """One captured decode forward per size, all reading one StaticDecodeInputs (and, past the first
    stage, one static IntermediateTensors) and sharing one memory pool. forward_static is what each
    graph records; on a CPU it runs as it is (the tests)."""

    def __init__(self, model: torch.nn.Module, backend, sizes: list[int], max_model_len: int, block_size: int,
                 scratch_block: int, device: torch.device, intermediate: IntermediateTensors | None = None,
                 scratch_state: int | None = None, num_groups: int = 1):
        self.model, self.backend, self.sizes, self.device = model, backend, sorted(sizes), device
        self.block_size, self.scratch_block, self.scratch_state = block_size, scratch_block, scratch_state
        self.inputs = StaticDecodeInputs(self.sizes[-1], max_model_len, block_size, scratch_block, device,
                                         scratch_state, num_groups)
        self.intermediate = intermediate  # [max size, hidden_size] each; None on the first stage
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # [size, hidden_size] (an IntermediateTensors of two before the last stage), overwritten by each replay
        self.outputs: dict[int, torch.Tensor | IntermediateTensors] = {}

    def forward_static(self, size: int) -> torch.Tensor | IntermediateTensors:
        intermediate = None if self.intermediate is None else leading_rows(self.intermediate, size)
        with forward_context(ForwardContext(self.inputs.metadata(size), self.backend)):
            return self.model(self.inputs.input_ids[:size], self.inputs.positions[:size], intermediate)

    @torch.inference_mode()
    def capture(self) -> int:
        """Capture every size (largest first); returns the device memory the graphs took."""
        start = time.perf_counter()
        with torch.cuda.device(self.device):  # a replica's thread may have another current device
            torch.cuda.synchronize()
            free_before = torch.cuda.mem_get_info()[0]
            pool = torch.cuda.graph_pool_handle()
            for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool memory
                self.forward_static(size)  # warm-up: Triton compiles its kernels, cuBLAS picks its own
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                # thread_local: data-parallel replicas in other threads of this process keep running
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    self.outputs[size] = self.forward_static(size)
                self.graphs[size] = graph
            torch.cuda.synchronize()
            measured = free_before - torch.cuda.mem_get_info()[0]
        logger.info("captured %d decode CUDA graphs (batch sizes %d..%d) in %.1f s", len(self.sizes),
                    self.sizes[0], self.sizes[-1], time.perf_counter() - start)
        return measured

    def can_replay(self, host: HostInputs) -> bool:
        return host.is_decode_only and host.num_requests <= self.sizes[-1]

    def load(self, host: HostInputs, staging: StagingBuffer) -> tuple[int, PendingTokens | None]:
        """Copy the step into the static inputs; returns the padded size that runs it and where its
        pending input ids go (into self.inputs.input_ids)."""
        size = padded_size(host.num_requests, self.sizes)
        assert size is not None  # can_replay: a captured size holds the step
        batch = pad_decode_batch(host, size, self.scratch_block, self.block_size, self.scratch_state)
        return size, self.inputs.load(batch, staging)

    def replay(self, size: int, num_requests: int) -> torch.Tensor | IntermediateTensors:
        """[num_requests, hidden_size]: the step's hidden states (and residual, before the last stage),
        valid until the next replay (read on the device before it: the next step's replay is queued
        behind this step's sampling). Past the first stage, `intermediate` holds the step's rows by now."""
        self.graphs[size].replay()  # on the current device: the worker makes its own current
        return leading_rows(self.outputs[size], num_requests)
