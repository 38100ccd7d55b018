"""Decode CUDA graphs as the planner and the runtime both count them: the batch sizes captured and the
bytes one rank's graphs hold."""

from __future__ import annotations

from dataclasses import dataclass

# NOTE: a captured graph's executable lives outside torch's allocator, roughly in proportion to its
# kernel launches (about a dozen per layer); 128 KiB per layer per graph is what Hopper-class GPUs
# with recent drivers show. The pool slack covers the allocator's rounding of the graph pool.
GRAPH_BYTES_PER_LAYER = 128 * 2**10
GRAPH_POOL_SLACK_BYTES = 32 * 2**20


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's ladder: 1, 2, 4, then every multiple of 8 below max_num_seqs, and max_num_seqs itself
    (so that every decode batch the scheduler can issue has a graph)."""
    small = {size for size in (1, 2, 4) if size < max_num_seqs}
    return sorted(small | set(range(8, max_num_seqs, 8)) | {max_num_seqs})


@dataclass(frozen=True)
class GraphShape:
    """What sizes one rank's decode graphs: the model's slice on this rank and the scheduler's limits."""

    max_num_seqs: int
    max_model_len: int
    block_size: int
    hidden_size: int
    dtype_bytes: int
    num_layers: int  # this rank's stage
    activation_bytes_per_token: int  # peak activations of one token's forward on this rank
    is_first_stage: bool


def cuda_graph_bytes(shape: GraphShape) -> int:
    """One rank's decode graphs, all sizes:

        pool      the largest graph's activations (the smaller ones are captured after it and reuse them)
        outputs   each graph keeps its output rows alive: [size, hidden] and a residual beside it
        static    input ids, positions, slots, seq lens, block tables; IntermediateTensors past stage 0
        graphs    the executables, per layer per graph"""
    sizes = capture_sizes(shape.max_num_seqs)
    largest = sizes[-1]
    row = shape.hidden_size * shape.dtype_bytes
    pool = largest * shape.activation_bytes_per_token
    outputs = sum(sizes) * 2 * row
    max_blocks_per_request = -(-shape.max_model_len // shape.block_size)
    static = largest * (3 * 8 + 4 + 4 * max_blocks_per_request)
    if not shape.is_first_stage:
        static += largest * 2 * row
    graphs = len(sizes) * shape.num_layers * GRAPH_BYTES_PER_LAYER
    return pool + outputs + static + graphs + GRAPH_POOL_SLACK_BYTES
