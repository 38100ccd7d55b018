"""CUDA graphs across ranks, all but the capture itself: every rank agrees on one ladder of sizes (or
none captures), a later pipeline stage's graph reads static IntermediateTensors buffers (padding rows
included) and gives the eager stages' logits, and those buffers are filled over a real process group."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. at the imports below

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from shardserve.runtime.attention.layer import Attention  # noqa: E402
from shardserve.runtime.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from shardserve.runtime.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from shardserve.runtime.config import load_model_config  # noqa: E402
from shardserve.runtime.config import (CacheConfig, EngineConfig, ModelConfig, ParallelConfig,  # noqa: E402
                                       SchedulerConfig)
from shardserve.runtime.worker.cuda_graph_plan import CaptureDecision, agree, agreed_decision  # noqa: E402
from shardserve.runtime.models.llama import LlamaForCausalLM  # noqa: E402
from shardserve.runtime.worker.cuda_graphs import DecodeGraphRunner, leading_rows, static_intermediate  # noqa: E402
from shardserve.runtime.worker.forward_context import ForwardContext, forward_context  # noqa: E402
from shardserve.runtime.worker.inputs import RequestState, build_host_inputs, to_device  # noqa: E402
from shardserve.runtime.worker.staging import StagingBuffer  # noqa: E402
from shardserve.runtime.worker.loader import load_model  # noqa: E402
from shardserve.runtime.distributed.parallel_state import ParallelState, get_parallel_state, set_parallel_state  # noqa: E402
from shardserve.runtime.worker.pipeline import (IntermediateTensors, recv_intermediate_into,  # noqa: E402
                                         send_intermediate)
from shardserve.runtime.sampling_params import SamplingParams  # noqa: E402

BLOCK_SIZE, NUM_BLOCKS, MAX_MODEL_LEN = 4, 24, 64
SCRATCH = NUM_BLOCKS


def test_every_rank_captures_the_same_ladder_or_none_does():
    ladder = CaptureDecision(None, (1, 2, 4, 8))
    assert agree([ladder] * 4) == ladder
    eager = agree([ladder, ladder, CaptureDecision("enforce_eager=True"), ladder])
    assert not eager.captures and eager.reason == "rank 2: enforce_eager=True"
    assert agree([CaptureDecision("the device is cpu")] * 2) == CaptureDecision("the device is cpu")
    with pytest.raises(RuntimeError, match=r"ranks \[1\] would capture CUDA graphs at sizes other than rank 0's"):
        agree([ladder, CaptureDecision(None, (1, 2, 4)), ladder])


@pytest.fixture
def restore_parallel_state():
    saved = get_parallel_state()
    yield
    set_parallel_state(saved)


def build_stage(folder: str, pp_rank: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """Stage pp_rank of two, with a KV pool of NUM_BLOCKS blocks and the scratch block after them."""
    set_parallel_state(ParallelState(pp_rank=pp_rank, pp_size=2))
    model = load_model(load_model_config(folder), torch.device("cpu"))
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    cache = torch.zeros(len(layers), 2, NUM_BLOCKS + 1, BLOCK_SIZE, layers[0].num_kv_heads, layers[0].head_dim)
    for index, layer in enumerate(layers):
        layer.kv_cache = cache[index]
    return model, cache


def make_states(lengths: list[int]) -> list[RequestState]:
    states, next_block = [], 0
    for i, length in enumerate(lengths):
        num_blocks = -(-(length + 1) // BLOCK_SIZE)
        blocks = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        tokens = [(13 * i + 7 * t) % 290 + 5 for t in range(length)]
        states.append(RequestState(f"r{i}", tokens, length, SamplingParams(), 0, frozenset(), blocks, 0))
    return states


def eager_chain(first, last, states) -> torch.Tensor:
    """Both stages eagerly over every state's uncomputed tokens; logits of each request's last token."""
    scheduled = {s.request_id: len(s.token_ids) - s.num_computed_tokens for s in states}
    host = build_host_inputs(states, scheduled, BLOCK_SIZE)
    inputs = to_device(host, StagingBuffer(torch.device("cpu")))
    with forward_context(ForwardContext(inputs.attn_metadata, TorchAttentionBackend())):
        handoff = first(inputs.input_ids, inputs.positions)
    with forward_context(ForwardContext(inputs.attn_metadata, TorchAttentionBackend())):
        hidden = last(None, inputs.positions, handoff)
    return last.compute_logits(hidden[torch.from_numpy(host.logits_indices)])


@pytest.mark.parametrize("family", ["llama3", "gpt2"])  # a residual handed on, and none
def test_a_later_stage_graph_reads_static_intermediate_buffers(family, checkpoint_factory,
                                                               restore_parallel_state):
    folder, _ = checkpoint_factory(family)
    (first, first_cache), (last, last_cache) = build_stage(folder, 0), build_stage(folder, 1)
    hidden_size = load_model_config(folder).hf_config.hidden_size
    states = make_states([9, 14, 5])
    with torch.inference_mode():
        eager_chain(first, last, states)  # prefill
        for i, state in enumerate(states):
            state.num_computed_tokens = len(state.token_ids)
            state.token_ids.append(17 + i)
        saved = first_cache.clone(), last_cache.clone()
        expected = eager_chain(first, last, states)
        first_cache.copy_(saved[0])
        last_cache.copy_(saved[1])
        for state in states:
            state.num_computed_tokens = len(state.token_ids) - 1
        host = build_host_inputs(states, {s.request_id: 1 for s in states}, BLOCK_SIZE)
        buffers = static_intermediate(4, hidden_size, torch.float32, torch.device("cpu"))
        generator = torch.Generator().manual_seed(0)  # stale rows: padding must not leak into the real rows
        buffers.hidden_states.copy_(100 * torch.randn(buffers.hidden_states.shape, generator=generator))
        buffers.residual.copy_(100 * torch.randn(buffers.residual.shape, generator=generator))
        runners = [DecodeGraphRunner(model, TritonAttentionBackend(), [2, 4], MAX_MODEL_LEN, BLOCK_SIZE,
                                     scratch_block=SCRATCH, device=torch.device("cpu"), intermediate=intermediate)
                   for model, intermediate in ((first, None), (last, buffers))]
        sizes = [runner.load(host, StagingBuffer(torch.device("cpu")))[0] for runner in runners]
        assert sizes == [4, 4]  # every stage replays the same padded size
        handoff = leading_rows(runners[0].forward_static(4), 3)  # what the first stage sends
        assert isinstance(handoff, IntermediateTensors) and handoff.hidden_states.shape == (3, hidden_size)
        buffers.hidden_states[:3].copy_(handoff.hidden_states)  # what recv_intermediate_into does
        if handoff.residual is not None:
            buffers.residual[:3].copy_(handoff.residual)
        hidden = runners[1].forward_static(4)[:3]
        torch.testing.assert_close(last.compute_logits(hidden), expected, atol=1e-4, rtol=1e-4)
    # the padding rows wrote only the scratch block of each stage
    for cache, before in ((first_cache, saved[0]), (last_cache, saved[1])):
        changed = (cache != before).flatten(4).any(dim=-1).any(dim=1).any(dim=0)  # [num_blocks + 1, BLOCK_SIZE]
        written = set(torch.nonzero(changed.flatten()).flatten().tolist())
        assert written == set(host.slot_mapping.tolist()) | {SCRATCH * BLOCK_SIZE}


def _send_and_receive(rank: int, store_path: str, results) -> None:
    """Rank 0 is stage 0 (sends 3 rows), rank 1 stage 1 (receives into 8-row static buffers)."""
    set_parallel_state(ParallelState(pp_rank=rank, pp_size=2))
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        hidden = torch.arange(3 * 5, dtype=torch.float32).reshape(3, 5)
        if rank == 0:
            send_intermediate(IntermediateTensors(hidden, -hidden))
            send_intermediate(IntermediateTensors(hidden[:2], None))
            send_intermediate(IntermediateTensors(hidden, None))
            results.put((rank, True))
            return
        buffers = IntermediateTensors(torch.full((8, 5), 7.0), torch.full((8, 5), 7.0))
        recv_intermediate_into(buffers, 3)
        ok = torch.equal(buffers.hidden_states[:3], hidden) and torch.equal(buffers.residual[:3], -hidden)
        ok &= bool((buffers.hidden_states[3:] == 7).all() and (buffers.residual[3:] == 7).all())
        recv_intermediate_into(buffers, 2)  # no residual sent: the residual rows stay as they were
        ok &= torch.equal(buffers.hidden_states[:2], hidden[:2]) and torch.equal(buffers.residual[:2], -hidden[:2])
        try:
            recv_intermediate_into(buffers, 2)  # 3 rows sent for a step of 2 requests
            ok = False
        except RuntimeError as error:
            ok &= "expects [2, 5]" in str(error)
            dist.recv(torch.empty(3, 5), 0)  # what was sent still arrives
        results.put((rank, ok))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_static_buffers_are_filled_over_a_process_group(tmp_path):
    assert run_ranks(_send_and_receive, tmp_path) == {0: True, 1: True}

def engine_config(enforce_eager: bool, max_num_seqs: int) -> EngineConfig:
    model = ModelConfig(model="m", hf_config=None, architecture="LlamaForCausalLM", dtype=torch.bfloat16,
                        max_model_len=128, enforce_eager=enforce_eager)
    cache = CacheConfig(block_size=16, gpu_memory_utilization=0.9, kv_cache_memory_bytes=None,
                        enable_prefix_caching=True, kv_cache_dtype="auto")
    return EngineConfig(model=model, cache=cache, scheduler=SchedulerConfig(max_num_seqs, 8192),
                        parallel=ParallelConfig(2, 1), device="cuda")


def _decide(rank: int, store_path: str, settings: list[tuple[bool, int]], results) -> None:
    """Each rank decides on its own settings (on a 'cuda' device: deciding touches no GPU), then agrees."""
    set_parallel_state(ParallelState(tp_rank=rank, tp_size=2))
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        model = LlamaForCausalLM.__new__(LlamaForCausalLM)
        decision = agreed_decision(engine_config(*settings[rank]), torch.device("cuda"), model)
        results.put((rank, decision))
    except RuntimeError as error:
        results.put((rank, str(error)))
    finally:
        dist.destroy_process_group()


def run_ranks(target, tmp_path, *args) -> dict:
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=target, args=(rank, str(tmp_path / "store"), *args, results))
                 for rank in range(2)]
    for process in processes:
        process.start()
    try:
        return dict(results.get(timeout=60) for _ in processes)
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()


@pytest.mark.slow
@pytest.mark.parametrize("settings, expected", [
    ([(False, 8), (False, 8)], CaptureDecision(None, (1, 2, 4, 8))),
    ([(False, 8), (True, 8)], CaptureDecision("rank 1: enforce_eager=True")),
    ([(False, 8), (False, 16)], "ranks [1] would capture CUDA graphs at sizes other than rank 0's [1, 2, 4, 8]: "
                                "every rank must capture the same sizes in the same order"),
])
def test_ranks_agree_over_their_process_group(settings, expected, tmp_path):
    decisions = run_ranks(_decide, tmp_path, settings)
    assert decisions == {0: expected, 1: expected}
