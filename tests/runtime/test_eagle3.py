"""Speculative decoding with an EAGLE-3 head (method eagle3): the tokens are those without speculation, and a head
that reads its features at the right positions drafts what a cycling model samples next, every time (catch-up after
prompts, after partly kept steps, across preemption and the prefix cache, at tp 2)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from draft_heads import head_shapes, random_head_tensors, save_eagle3_head
from runtime_checkpoints import CYCLE_PERIOD as PERIOD, VOCAB_SIZE
from shardserve.planner.settings import SettingError
from shardserve.planner.speculative import SpeculativeConfig
from shardserve.runtime import SamplingParams
from test_spec_decode import PROMPTS, generate, same_logprobs

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
DRAFT_VOCAB = 64  # the cycling prompts' tokens are all below it


def eagle3(folder: str, k: int = 3) -> str:
    return SpeculativeConfig("eagle3", k, model=folder).to_json()


@pytest.fixture(scope="module")
def random_head(target, tmp_path_factory) -> str:
    return save_eagle3_head(str(tmp_path_factory.mktemp("head")), target, random_head_tensors(target, seed=3))


@pytest.fixture(scope="module")
def cycle_head(cycle_checkpoint, tmp_path_factory) -> str:
    """A head whose draft is the cycling model's token two after the feature's: its feature is the hidden state of
    position p (the cycling model's layers write nothing, so every captured state is p's embedding), its layer
    writes nothing, and its head maps that embedding to the token two steps on. Read at p = the last computed
    position, that is exactly the model's next sample after the one just made. Its draft vocabulary is the first
    64 ids, reversed (d2t), and it has no embedding (the model's is shared)."""
    embed = load_file(os.path.join(cycle_checkpoint, "model.safetensors"))["model.embed_tokens.weight"]
    shapes = head_shapes(cycle_checkpoint, DRAFT_VOCAB)
    tensors = {name: torch.ones(shape) if len(shape) == 1 else torch.zeros(shape) for name, shape in shapes.items()
               if name != "embed_tokens.weight"}
    hidden = embed.shape[1]
    tensors["fc.weight"][:, :hidden] = torch.eye(hidden)
    ids = torch.arange(VOCAB_SIZE)
    two_on = ids - ids % PERIOD + (ids % PERIOD + 2) % PERIOD
    draft_ids = torch.arange(DRAFT_VOCAB)
    target_of_draft = DRAFT_VOCAB - 1 - draft_ids
    unit = embed / embed.norm(dim=1, keepdim=True) * 3.0
    lm_head = torch.full((DRAFT_VOCAB, hidden), 0.0)
    for y in range(DRAFT_VOCAB - PERIOD):  # the row of draft id d is the embedding two steps before its token
        lm_head[DRAFT_VOCAB - 1 - int(two_on[y])] = unit[y]
    tensors["lm_head.weight"] = lm_head
    tensors["d2t"] = target_of_draft - draft_ids
    tensors["t2d"] = torch.zeros(VOCAB_SIZE, dtype=torch.bool)
    return save_eagle3_head(str(tmp_path_factory.mktemp("cycle_head")), cycle_checkpoint, tensors, DRAFT_VOCAB)


@pytest.fixture(scope="module")
def token_head(cycle_checkpoint, tmp_path_factory) -> str:
    """A head whose draft is the cycling model's successor of the token it reads: its feature is ignored (zero
    hidden_norm, normed before the residual), each attention head's query matches only its own token's key (the
    embeddings' 16-feature slices share a norm), the values carry that token's first 32 features out, and the
    head maps them to the successor's. Each draft is kept only if every token is read at its position: the one
    after the feature's in catch-up, draft i in round i. It has no embedding (the model's is shared)."""
    embed = load_file(os.path.join(cycle_checkpoint, "model.safetensors"))["model.embed_tokens.weight"]
    shapes = head_shapes(cycle_checkpoint)
    tensors = {name: torch.ones(shape) if len(shape) == 1 else torch.zeros(shape) for name, shape in shapes.items()
               if name != "embed_tokens.weight"}
    tensors["midlayer.hidden_norm.weight"].zero_()
    eye = torch.eye(16)
    for head in range(4):  # query heads 2g and 2g + 1 read key/value head g: features 16g to 16g + 16
        group = head // 2
        tensors["midlayer.self_attn.q_proj.weight"][16 * head:16 * head + 16, 16 * group:16 * group + 16] = 20 * eye
    for group in range(2):
        for name in ("k_proj", "v_proj"):
            tensors[f"midlayer.self_attn.{name}.weight"][16 * group:16 * group + 16, 16 * group:16 * group + 16] = eye
        tensors["midlayer.self_attn.o_proj.weight"][16 * group:16 * group + 16, 32 * group:32 * group + 16] = eye
    ids = torch.arange(VOCAB_SIZE)
    successor = ids - ids % PERIOD + (ids % PERIOD + 1) % PERIOD
    part = embed[:, :32] / embed[:, :32].norm(dim=1, keepdim=True) * 3.0
    tensors["lm_head.weight"] = torch.zeros(VOCAB_SIZE, embed.shape[1])
    tensors["lm_head.weight"][successor, :32] = part
    return save_eagle3_head(str(tmp_path_factory.mktemp("token_head")), cycle_checkpoint, tensors,
                            norm_before_residual=True)


def test_a_head_reading_the_right_tokens_has_every_draft_kept(cycle_checkpoint, token_head):
    """Off by a position (reading x_p rather than x_{p+1}, or a round's draft at the wrong place) and it would draft
    another token of the cycle: every draft is kept only when the tokens line up, round after round."""
    plain, _, _ = generate(cycle_checkpoint, GREEDY)
    tokens, _, stats = generate(cycle_checkpoint, GREEDY, eagle3(token_head, 4))
    spec = stats.spec_decode
    assert tokens == plain
    assert spec.num_draft_tokens > 60 and spec.num_accepted_tokens == spec.num_draft_tokens


@pytest.mark.parametrize("k", [1, 3])
def test_a_head_reading_the_right_features_has_every_first_draft_kept(cycle_checkpoint, cycle_head, k):
    """Off by a position (the feature of p - 1 or p + 1, or the model's token at p) and it would draft another
    token of the cycle: the first draft of every step is kept only when catch-up lines up."""
    plain, _, _ = generate(cycle_checkpoint, GREEDY)
    tokens, _, stats = generate(cycle_checkpoint, GREEDY, eagle3(cycle_head, k))
    spec = stats.spec_decode
    assert tokens == plain
    assert spec.num_drafts > 20 and spec.accepted_per_position[0] == spec.num_drafts


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.9, max_tokens=40, ignore_eos=True, seed=7, logprobs=1),
    SamplingParams(temperature=0.8, top_k=20, max_tokens=40, ignore_eos=True, repetition_penalty=1.2),
], ids=["greedy", "seeded", "penalties"])
def test_tokens_are_those_without_speculation(target, random_head, params):
    plain, plain_logprobs, _ = generate(target, params)
    tokens, logprobs, stats = generate(target, params, eagle3(random_head, 4))
    assert tokens == plain and stats.spec_decode.num_drafts > 0
    if params.logprobs:
        assert same_logprobs(logprobs, plain_logprobs, tokens)


def test_preemption_and_the_prefix_cache_keep_the_features_in_line(cycle_checkpoint, cycle_head, kv_bytes_for):
    """A pool too small for every request: the newest are preempted and come back, partly from the prefix cache;
    their features are computed again with them, so every first draft is still kept."""
    prompts = PROMPTS + [p[::-1] for p in PROMPTS]
    plain, _, _ = generate(cycle_checkpoint, GREEDY, prompts=prompts)
    tight = 40 * (kv_bytes_for(cycle_checkpoint, 1, 4) // 2 * 3)  # 40 blocks of the model's 2 layers and the head's
    tokens, _, stats = generate(cycle_checkpoint, GREEDY, eagle3(cycle_head), prompts=prompts,
                                kv_cache_memory_bytes=tight, enable_prefix_caching=True, max_model_len=80)
    spec = stats.spec_decode
    assert tokens == plain and stats.num_preemptions > 0
    assert spec.accepted_per_position[0] == spec.num_drafts > 0


def test_a_head_that_cannot_draft_here_is_refused_by_name(target, random_head, checkpoint_factory, tmp_path):
    settings = dict(device="cpu", kv_cache_memory_bytes=1 << 22)

    def edited(**changes) -> str:
        folder = tmp_path / "_".join(changes)
        folder.mkdir()
        config = json.loads(open(os.path.join(random_head, "config.json")).read())
        (folder / "config.json").write_text(json.dumps({**config, **changes}))
        os.symlink(os.path.join(random_head, "model.safetensors"), folder / "model.safetensors")
        return str(folder)

    from shardserve.runtime import LLM
    for folder, message in [
        (target, r"its architectures are \['LlamaForCausalLM'\], not an EAGLE-3 head's"),
        (edited(vocab_size=VOCAB_SIZE + 64), "it drafts for a vocabulary of 384 tokens, the model's has 320"),
        (edited(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 5]}),
         r"eagle_aux_hidden_state_layer_ids \[0, 1, 5\]: three layer indices from 0 to 2"),
    ]:
        with pytest.raises(SettingError, match=message):
            LLM(target, speculative_config=eagle3(folder), **settings)
    with pytest.raises(SettingError, match="GPT2LMHeadModel does not hand its layers' hidden states"):
        LLM(checkpoint_factory("gpt2")[0], speculative_config=eagle3(random_head), **settings)
    with pytest.raises(SettingError, match="method eagle3 runs beside the first pipeline stage only"):
        LLM(target, speculative_config=eagle3(random_head), pipeline_parallel_size=2, **settings)


@pytest.mark.slow
def test_tensor_parallel_ranks_draft_alike(target, random_head, cycle_checkpoint, cycle_head):
    """tp 2 over mp ranks: each rank keeps the features and runs its shard of the head, so all draft alike."""
    plain, _, _ = generate(target, GREEDY)
    tokens, _, stats = generate(target, GREEDY, eagle3(random_head), tensor_parallel_size=2,
                                distributed_executor_backend="mp")
    assert tokens == plain and stats.spec_decode.num_drafts > 0
    tokens, _, stats = generate(cycle_checkpoint, GREEDY, eagle3(cycle_head), tensor_parallel_size=2,
                                distributed_executor_backend="mp")
    assert stats.spec_decode.accepted_per_position[0] == stats.spec_decode.num_drafts > 0


def test_the_plan_sizes_the_pool_the_engine_makes_and_names_the_head(target, random_head):
    """plan = launch: the pages hold the head's layer beside the model's, in both; on a GPU the plan runs every
    step eagerly, as the engine does with a head (it reads each step's hidden states)."""
    from shardserve.launch.engine_export import export_plan
    from shardserve.planner import PlanOptions, load_model, make_plan, parse_declared
    from shardserve.runtime import LLM

    pool = 1 << 22
    options = PlanOptions(kv_cache_memory_bytes=pool, block_size=4, max_model_len=256,
                          speculative_config=eagle3(random_head), draft_acceptance_rate=0.6)
    plan = make_plan(load_model(target), parse_declared("cpu"), options)
    with LLM(target, device="cpu", kv_cache_memory_bytes=pool, block_size=4, max_model_len=256,
             speculative_config=eagle3(random_head)) as llm:
        assert llm.kv_cache_info.num_blocks == plan.record().memory.num_blocks
    assert any(f"the EAGLE-3 head {random_head} takes" in line for line in plan.rationale)
    sglang = dict(export_plan(plan.record(), "sglang").flags)
    assert (sglang["--speculative-algorithm"], sglang["--speculative-draft-model-path"],
            sglang["--speculative-num-steps"], sglang["--speculative-num-draft-tokens"]) == ("EAGLE3", random_head, "3", "4")
    assert json.loads(dict(export_plan(plan.record(), "vllm").flags)["--speculative-config"]) == json.loads(
        eagle3(random_head))
    gpu = make_plan(load_model(target), parse_declared("1xH100-80GB"), PlanOptions(
        max_model_len=256, concurrency=1.0, speculative_config=eagle3(random_head), draft_acceptance_rate=0.3))
    assert any(f"every step runs without CUDA graphs, as the EAGLE-3 head {random_head} reads" in w
               for w in gpu.warnings)


def test_a_head_in_the_speculators_format_drafts_alike(cycle_checkpoint, token_head, tmp_path):
    """vllm-project/speculators' layout of the same head (config under transformer_layer_config, layer ids at the top,
    normed before the residual by default, the layer as layers.0): every draft is kept, as with the EAGLE authors'."""
    config = json.loads(open(os.path.join(token_head, "config.json")).read())
    layer = {k: v for k, v in config.items() if k not in ("architectures", "eagle_config", "draft_vocab_size",
                                                         "norm_before_residual")}
    speculators = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                   "transformer_layer_config": layer, "draft_vocab_size": config["draft_vocab_size"],
                   "eagle_aux_hidden_state_layer_ids": config["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
                   "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
                       {"proposal_type": "greedy", "speculative_tokens": 4}], "verifier": {"name_or_path": "cycle"}}}
    folder = tmp_path / "speculators"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(speculators))
    tensors = load_file(os.path.join(token_head, "model.safetensors"))
    save_file({name.replace("midlayer.", "layers.0."): t for name, t in tensors.items()},
              str(folder / "model.safetensors"))
    plain, _, _ = generate(cycle_checkpoint, GREEDY)
    tokens, _, stats = generate(cycle_checkpoint, GREEDY, eagle3(str(folder), 4))
    assert tokens == plain and stats.spec_decode.num_accepted_tokens == stats.spec_decode.num_draft_tokens > 60


def test_the_memory_profile_runs_the_head_beside_the_model(target, random_head):
    """A GPU's KV budget is what the profile's forward leaves: the states the head reads and its own forward run in it
    (here on the CPU, as the profile runs them: no KV, the step's tokens at once)."""
    from shardserve.runtime import LLM
    from shardserve.runtime.worker.forward_context import ForwardContext, forward_context

    with LLM(target, device="cpu", kv_cache_memory_bytes=1 << 22, speculative_config=eagle3(random_head)) as llm:
        worker = llm.engine.executor.worker
        heads = worker.drafter
        ids, positions = torch.arange(16) + 3, torch.arange(16)
        with torch.inference_mode(), forward_context(ForwardContext(None, worker.backend, capture=heads.capture)):
            hidden = worker.model(ids, positions, None)
            assert len(heads.capture.captured) == 3
            heads.dry_run(ids, positions, hidden, 4)
        assert heads.capture.captured == [] and heads.features == {} and not heads.kv_cache.any()
