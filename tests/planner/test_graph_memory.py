"""Decode CUDA graph memory: the ladder of sizes, the bytes one rank's graphs hold, and the planner
reserving them on every GPU stage (never on CPU ranks)."""

from dataclasses import replace

from shardserve.planner.graph_memory import GRAPH_BYTES_PER_LAYER, GraphShape, capture_sizes, cuda_graph_bytes
from shardserve.planner.memory import CPU_PROCESS_BYTES, overhead_bytes
from shardserve.planner import parse_declared

from tests.planner.factories import plan_for

LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"
SHAPE = GraphShape(max_num_seqs=256, max_model_len=8192, block_size=16, hidden_size=4096, dtype_bytes=2,
                   num_layers=32, activation_bytes_per_token=96 * 1024, is_first_stage=True)


def test_capture_sizes_are_the_ladder_every_rank_captures():
    assert capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert capture_sizes(3) == [1, 2, 3]


def test_graph_bytes_follow_the_ladder_and_the_stage():
    base = cuda_graph_bytes(SHAPE)
    assert 0.1 * 2**30 < base < 1 * 2**30  # what vLLM logs for an 8B model's graphs
    assert cuda_graph_bytes(replace(SHAPE, max_num_seqs=512)) > base > cuda_graph_bytes(replace(SHAPE, max_num_seqs=8))
    later = cuda_graph_bytes(replace(SHAPE, is_first_stage=False))
    assert later - base == 256 * 2 * 4096 * 2  # the static IntermediateTensors of the largest size
    fewer_layers = cuda_graph_bytes(replace(SHAPE, num_layers=16))
    assert base - fewer_layers >= len(capture_sizes(256)) * 16 * GRAPH_BYTES_PER_LAYER


def test_the_plan_reserves_graph_memory_on_every_gpu_stage():
    small = plan_for(LLAMA_8B, "H100", max_num_seqs=8).to_dict()["memory"]["per_gpu"]
    large = plan_for(LLAMA_8B, "H100", max_num_seqs=512).to_dict()["memory"]["per_gpu"]
    fixed = overhead_bytes(parse_declared("H100").gpu, 1, 1)
    assert small["overhead_bytes"] > fixed  # the graphs on top of the context
    assert large["overhead_bytes"] - small["overhead_bytes"] > 100 * 2**20
    cpu = plan_for("shardserve-demo", "2xcpu").to_dict()["memory"]["per_gpu"]
    assert cpu["overhead_bytes"] == CPU_PROCESS_BYTES


def test_enforce_eager_plans_no_graph_memory_and_says_so_in_the_plan():
    eager = plan_for(LLAMA_8B, "H100", enforce_eager=True).to_dict()
    graphs = plan_for(LLAMA_8B, "H100").to_dict()
    assert eager["runtime"]["enforce_eager"] is True and graphs["runtime"]["enforce_eager"] is False
    assert eager["memory"]["per_gpu"]["overhead_bytes"] == overhead_bytes(parse_declared("H100").gpu, 1, 1)
    assert eager["memory"]["num_blocks"] > graphs["memory"]["num_blocks"]
