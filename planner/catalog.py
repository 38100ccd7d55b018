"""The bundled catalogs: GPU datasheets and popular model configs, read from catalog/*.yaml."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import yaml

_CATALOG_DIR = Path(__file__).parent / "catalog"
# the bundled catalogs through libyaml where PyYAML has it: the pure-Python loader took 0.23 s of a 0.55 s plan
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_VENDOR_WORDS = re.compile(r"\b(nvidia|tesla|geforce)\b", re.IGNORECASE)


def normalize_gpu_name(name: str) -> str:
    """'NVIDIA GeForce RTX 4090' -> 'RTX-4090'; 'h100-80gb' -> 'H100-80GB'."""
    name = _VENDOR_WORDS.sub(" ", name)
    return re.sub(r"[\s_]+", "-", name.strip()).strip("-").upper()


@functools.cache
def gpu_catalog() -> dict[str, dict]:
    with open(_CATALOG_DIR / "gpus.yaml") as f:
        return yaml.load(f, Loader=_LOADER)


@functools.cache
def _gpu_names() -> dict[str, str]:
    names = {}
    for canonical, entry in gpu_catalog().items():
        for name in [canonical, *entry.get("aliases", [])]:
            names[normalize_gpu_name(name)] = canonical
    return names


def find_gpu(name: str) -> tuple[str, dict] | None:
    """The catalog entry for a GPU name, alias or NVML name, or None."""
    canonical = _gpu_names().get(normalize_gpu_name(name))
    return (canonical, gpu_catalog()[canonical]) if canonical else None


@functools.cache
def model_catalog() -> dict[str, dict]:
    with open(_CATALOG_DIR / "models.yaml") as f:
        return yaml.load(f, Loader=_LOADER)


def catalog_matches(model_id: str) -> list[str]:
    """The catalog ids a name stands for, case-insensitive: the id itself, else every id whose name (the org left
    out) it is."""
    wanted = model_id.strip().lower()
    exact = [k for k in model_catalog() if k.lower() == wanted]
    return exact or [k for k in model_catalog() if k.lower().split("/")[-1] == wanted]


def find_model(model_id: str) -> tuple[str, dict] | None:
    """A catalog config by id, case-insensitive; the org may be left out when the name is unique."""
    matches = catalog_matches(model_id)
    if len(matches) == 1:
        return matches[0], dict(model_catalog()[matches[0]])
    return None


def resolution_note(model_id: str, found: str) -> str | None:
    """What a name that is not the catalog id it stands for became, and the catalog's variants of that id (a
    short name that plans the base model says the chat model's id); None when the name is the id."""
    if model_id == found:
        return None
    variants = [k for k in model_catalog() if k.lower().startswith(found.lower() + "-")]
    also = f" (also in the catalog: {', '.join(variants)})" if variants else ""
    return f"model {model_id} is the catalog's {found}{also}"
