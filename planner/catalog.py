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


def find_model(model_id: str) -> tuple[str, dict] | None:
    """A catalog config by id, case-insensitive; the org may be left out when the name is unique."""
    wanted = model_id.strip().lower()
    exact = [k for k in model_catalog() if k.lower() == wanted]
    matches = exact or [k for k in model_catalog() if k.lower().split("/")[-1] == wanted]
    if len(matches) == 1:
        return matches[0], dict(model_catalog()[matches[0]])
    return None
