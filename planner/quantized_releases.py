"""Quantized weights of the same model (the catalog's releases of it, or fp8 quantized while loading) and
which of them the planner's own memory model fits where the model's weights do not."""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardserve.planner.catalog import model_catalog
from shardserve.planner.errors import PlanError
from shardserve.planner.model_source import load_model
from shardserve.planner.model_spec import ModelSpec
from shardserve.planner.options import resolve_settings
from shardserve.planner.rules import Layout
from shardserve.planner.search import Search, choose
from shardserve.planner.served import check_served

# words a release adds to its model's name (Meta-Llama-3.1-8B-Instruct-AWQ-INT4 is Llama-3.1-8B-Instruct)
_RELEASE_WORDS = frozenset({"fp8", "awq", "gptq", "int4", "int8", "w4a16", "w8a8", "w8a16", "dynamic",
                            "4bit", "8bit", "quantized", "hf"})
UNQUANTIZED_BITS = 16


@dataclass(frozen=True)
class Release:
    """Weights of one model in another format: a catalog id, or the model's own path with --quantization."""
    model: str
    method: str  # fp8 | awq | gptq
    bits: int
    quantization: str | None = None  # the --quantization it needs (fp8 quantized while loading); None: its config's

    @property
    def label(self) -> str:
        return "fp8" if self.method == "fp8" else f"int{self.bits} {self.method.upper()}"


def base_name(model_id: str) -> str:
    """The model a name stands for, lowercase, its org, `Meta-` and the release words dropped."""
    name = model_id.rstrip("/").split("/")[-1].lower().removeprefix("meta-")
    parts = name.split("-")
    while len(parts) > 1 and parts[-1] in _RELEASE_WORDS:
        parts.pop()
    return "-".join(parts)


def _shape(spec: ModelSpec) -> tuple:
    return (spec.architecture, spec.num_layers, spec.hidden_size, spec.num_attention_heads,
            spec.num_kv_heads, spec.vocab_size, spec.num_experts)


def catalog_releases(spec: ModelSpec) -> list[Release]:
    """The catalog's quantized releases of the model `spec` describes: the same name once the release
    words are dropped and the same shapes (an AWQ release may pad intermediate_size), most bits first."""
    out = []
    for model_id, config in model_catalog().items():
        if "quantization_config" not in config or model_id == spec.id or base_name(model_id) != base_name(spec.id):
            continue
        try:
            other = ModelSpec.from_config(model_id, config)
        except PlanError:
            continue
        if other.quantization is not None and _shape(other) == _shape(spec):
            out.append(Release(model_id, other.quantization.method, other.quantization.bits))
    return sorted(out, key=lambda r: (-r.bits, r.model))


def smaller_releases(search: Search) -> list[Release]:
    """Releases with fewer weight bits than the searched model's, and fp8 quantized while loading when the
    model is unquantized and the GPU computes in fp8, most bits first."""
    spec, gpu = search.model.spec, search.hardware.gpu
    bits = spec.quantization.bits if spec.quantization else UNQUANTIZED_BITS
    out = [r for r in catalog_releases(spec) if r.bits < bits]
    if spec.quantization is None and gpu.has_fp8:
        out.append(Release(search.model.path or spec.id, "fp8", 8, quantization="fp8"))
    return sorted(out, key=lambda r: -r.bits)


def _variant(search: Search, release: Release) -> Search | None:
    """The search for `release` instead of the searched weights, without latency targets (fitting in
    memory is the question); None when the planner refuses the release itself."""
    try:
        # these weights quantized while loading: the config already read (no Hub request); else a catalog id
        model = (search.model.with_quantization(release.quantization) if release.quantization
                 else load_model(release.model))
        check_served(model.spec)
        options = replace(search.options, quantization=release.quantization)
        settings = resolve_settings(options, model.spec, search.hardware.gpu)
    except PlanError:
        return None
    targets = replace(search.targets, ttft_ms=None, tpot_ms=None)
    return replace(search, model=model, options=options, settings=settings, targets=targets)


def fitting_layout(search: Search, release: Release) -> Layout | None:
    """The layout the planner would choose for `release` on the searched hardware, or None."""
    variant = _variant(search, release)
    if variant is None:
        return None
    chosen = choose(variant.candidates(), variant.hardware, variant.targets, variant.settings)
    return chosen.layout if chosen is not None else None


def _fits_at(search: Search, release: Release, layout: Layout) -> bool:
    variant = _variant(search, release)
    if variant is None:
        return False
    base = variant.shape(layout.tensor_parallel_size, layout.pipeline_parallel_size, with_rate=False)[0]
    return base.is_feasible


def quantized_fix(search: Search) -> str | None:
    """'fp8 weights would fit at tp=8 pp=1 dp=1: ...' for the most bits that fit, naming each way to
    get them (another at the same bits is checked at the same layout); None when none fits."""
    releases = smaller_releases(search)
    for bits in sorted({r.bits for r in releases}, reverse=True):
        same = [r for r in releases if r.bits == bits]
        found = next(((r, layout) for r in same if (layout := fitting_layout(search, r))), None)
        if found is None:
            continue
        first, layout = found
        fits = [first] + [r for r in same if r is not first and _fits_at(search, r, layout)]
        ways = [f"--quantization {r.quantization} on these weights (quantized while loading)" if r.quantization
                else r.model if r.label == first.label else f"{r.model} ({r.label})" for r in fits]
        return f"{first.label} weights would fit at {layout}: {' or '.join(ways)}."
    return None
