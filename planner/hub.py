"""The Hugging Face Hub: the cache's folders, a remote model's config and safetensors headers, and the
download of the files a launch loads (safetensors weights only; config and tokenizer alone for load_format dummy).

huggingface_hub is imported only here and only when a call needs it: a plan of a local folder never
loads it. It reads HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE itself; its progress bars go to stderr.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace
from math import prod
from pathlib import Path

from shardserve.planner.errors import PlanError
from shardserve.planner.hf_config import read_config_json
from shardserve.planner.model_spec import TensorInfo

logger = logging.getLogger("shardserve.planner.hub")

INDEX_FILE = "model.safetensors.index.json"
# Besides the safetensors shards, a launch fetches only these (top level, but the pooling head's folder):
# the config, the sampling defaults, the tokenizer and chat template, and the small JSON files of
# quantized and pooling checkpoints. Never .bin, .pt, .gguf, .msgpack, .h5 or ONNX files.
SMALL_FILES = (
    "config.json", "generation_config.json", INDEX_FILE,
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "chat_template.jinja", "chat_template.json", "vocab.json", "vocab.txt", "merges.txt",
    "quantize_config.json", "quant_config.json", "hf_quant_config.json",
    "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "1_Pooling/config.json",
)
_COMMIT = re.compile(r"[0-9a-f]{40}")


class HubError(PlanError):
    """The Hub refused a request or could not be reached; the message names the fix."""


@dataclass(frozen=True)
class HubOptions:
    """Where a Hub id is looked up and downloaded: the settings of the same names (None: the
    defaults of huggingface_hub, that is $HF_HUB_CACHE, the main branch, $HF_TOKEN)."""
    download_dir: str | None = None
    revision: str | None = None
    hf_token: str | None = field(default=None, repr=False)  # never in a log line

    @classmethod
    def of(cls, settings: object) -> HubOptions:
        """From anything that holds these settings as attributes (launch's DeployConfig)."""
        return cls(**{f.name: getattr(settings, f.name, None) for f in fields(cls)})

    @property
    def cache_dir(self) -> Path:
        return Path(self.download_dir).expanduser() if self.download_dir else hf_cache_dir()


def hf_cache_dir() -> Path:
    """The cache huggingface_hub uses: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


_BARE_ID = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9])?")  # the Hub's older ids: gpt2, t5-small


def is_hub_id(model: str) -> bool:
    """`org/name`, or a bare name as the Hub's oldest models have (gpt2, as vLLM takes it); not a path, and
    not a plan or profile file's name."""
    org, slash, name = model.partition("/")
    if not slash:
        return bool(_BARE_ID.fullmatch(model)) and ".." not in model and not model.endswith((".yaml", ".yml", ".json"))
    return bool(org and name) and "/" not in name and not model.startswith((".", "~"))


def cached_snapshot(model_id: str, hub: HubOptions | None = None) -> Path | None:
    """The folder of `org/name` in the Hugging Face cache holding a config.json: the snapshot that
    refs/<revision> (main by default) or a commit hash names; without a revision asked, else the newest."""
    if not is_hub_id(model_id):
        return None
    hub = hub or HubOptions()
    repo = hub.cache_dir / ("models--" + model_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    revision = hub.revision or "main"
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision if _COMMIT.fullmatch(revision) else None
    if commit is not None and (snapshots / commit / "config.json").is_file():
        return snapshots / commit
    if hub.revision is not None:  # a revision asked for is that revision or nothing
        return None
    found = sorted((p for p in snapshots.iterdir() if (p / "config.json").is_file()),
                   key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def has_weights(folder: Path) -> bool:
    """Every shard the index names is there; without an index, some *.safetensors file."""
    shards = _indexed_shards(folder)
    if shards is not None:
        return all((folder / shard).is_file() for shard in shards)
    return any(folder.glob("*.safetensors"))


def _indexed_shards(folder: Path) -> list[str] | None:
    index = folder / INDEX_FILE
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        raise PlanError(f"{index} is not a safetensors index (a JSON object with a weight_map)") from None
    return sorted(set(weight_map.values()))


def is_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set: the Hub is never asked."""
    from huggingface_hub import constants
    return bool(constants.HF_HUB_OFFLINE)


def pinned(model: str, hub: HubOptions) -> HubOptions:
    """The same options at the commit the revision names now, so the config and the headers come from
    one commit. NOTE: this one request fails at once when the Hub is unreachable, the id is wrong or the
    revision missing, where a file download would retry for half a minute first."""
    from huggingface_hub import HfApi

    sha = HfApi(token=hub.hf_token).model_info(model, revision=hub.revision).sha
    return replace(hub, revision=sha) if sha else hub


def remote_config(model: str, hub: HubOptions) -> dict:
    """config.json of a Hub id, fetched into a throw-away folder: a plan leaves the cache as it was, so
    what the cache holds is what a launch downloaded."""
    from huggingface_hub import hf_hub_download

    with tempfile.TemporaryDirectory(prefix="shardserve-config-") as tmp:
        path = Path(hf_hub_download(model, "config.json", revision=hub.revision, cache_dir=tmp,
                                    token=hub.hf_token))
        return read_config_json(path, f"{model}: its config.json")


def remote_tensors(model: str, hub: HubOptions) -> list[TensorInfo] | None:
    """Every tensor in the repo's safetensors headers, read with ranged requests (no weights);
    None: the repo has no model.safetensors nor an index."""
    from huggingface_hub import get_safetensors_metadata
    from huggingface_hub.errors import NotASafetensorsRepoError

    try:
        metadata = get_safetensors_metadata(model, revision=hub.revision, token=hub.hf_token)
    except NotASafetensorsRepoError:
        return None
    return [TensorInfo(name, prod(info.shape), info.dtype)
            for _, file in sorted(metadata.files_metadata.items()) for name, info in file.tensors.items()]


def download(model: str, hub: HubOptions) -> Path:
    """The repo's safetensors weights and small files in the cache; returns the snapshot folder.

    NOTE: two passes: the small files first (the index among them), then exactly the shards the index
    names. A repo that also ships its weights in another layout (consolidated.safetensors beside the
    shards, a subfolder of originals) is fetched once, not twice."""
    from huggingface_hub import HfApi, snapshot_download

    info = HfApi(token=hub.hf_token).model_info(model, revision=hub.revision)
    if not any(s.rfilename.endswith(".safetensors") and "/" not in s.rfilename for s in info.siblings or ()):
        raise HubError(f"{model} has no safetensors weights on the Hub: shardserve loads safetensors only; "
                       "pick a repo that has them, or convert the checkpoint and pass its folder")
    logger.info("downloading %s%s from the Hub into %s (safetensors weights, config and tokenizer files)",
                model, f" at {hub.revision}" if hub.revision else "", hub.cache_dir)
    folder = _small_files(model, hub)
    shards = _indexed_shards(folder)
    folder = Path(snapshot_download(model, revision=folder.name, cache_dir=hub.cache_dir, token=hub.hf_token,
                                    allow_patterns=shards or ["*.safetensors"],
                                    ignore_patterns=None if shards else ["*/*"]))
    if not has_weights(folder):
        raise HubError(f"{model}: the download in {folder} lacks shards that {INDEX_FILE} names; run the launch "
                       "again to finish it")
    return folder


def download_config(model: str, hub: HubOptions) -> Path:
    """The repo's config.json, tokenizer and other small files in the cache, no weights (load_format dummy:
    random weights of the checkpoint's shapes); returns the snapshot folder."""
    logger.info("downloading %s%s from the Hub into %s (config and tokenizer files; no weights: load_format "
                "dummy)", model, f" at {hub.revision}" if hub.revision else "", hub.cache_dir)
    folder = _small_files(model, hub)
    if not (folder / "config.json").is_file():
        raise HubError(f"{model} has no config.json on the Hub: not a transformers model")
    return folder


def _small_files(model: str, hub: HubOptions) -> Path:
    """SMALL_FILES at the revision as asked (the cache's refs/<revision> then names the commit)."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, revision=hub.revision, cache_dir=hub.cache_dir, token=hub.hf_token,
                                  allow_patterns=list(SMALL_FILES)))


@contextlib.contextmanager
def hub_errors(model: str, hub: HubOptions, nearest: Callable[[str], str]) -> Iterator[None]:
    """huggingface_hub's errors as one line each, naming the fix (`nearest`: close catalog ids)."""
    from huggingface_hub import constants
    from huggingface_hub import errors as hf

    page = f"{constants.ENDPOINT.rstrip('/')}/{model}"
    unreachable: tuple[type[BaseException], ...] = (hf.LocalEntryNotFoundError, hf.OfflineModeIsEnabled,
                                                    *_transport_errors())
    try:
        yield
    except hf.GatedRepoError:
        raise HubError(f"{model} is gated: accept the license at {page} and set HF_TOKEN (or --hf-token) "
                       "to a token of that account") from None
    except hf.RepositoryNotFoundError:
        raise HubError(f"{model} is not a model on the Hub ({constants.ENDPOINT}): the id is wrong, or the repo "
                       f"is private (set HF_TOKEN); {nearest(model)}") from None
    except hf.RevisionNotFoundError:
        raise HubError(f"--revision {hub.revision or 'main'}: {model} has no such branch, tag or commit "
                       f"(see {page}/tree/main)") from None
    except hf.RemoteEntryNotFoundError:
        raise HubError(f"{model} has no config.json on the Hub: not a transformers model") from None
    except hf.HFValidationError:
        raise HubError(f"{model!r} is not a Hub id: write org/name (or a bare name such as gpt2)") from None
    except unreachable:
        raise HubError(offline_help(model, hub) if is_offline() else
                       f"cannot reach the Hub at {constants.ENDPOINT} for {model}: check the network (a proxy: "
                       "HTTPS_PROXY), or download it where the Hub is reachable (`hf download "
                       f"{model}`), copy that cache here and set HF_HUB_OFFLINE=1") from None
    except hf.HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "an error"
        raise HubError(f"the Hub answered {status} for {model}"
                       + (": is HF_TOKEN (or --hf-token) valid?" if status in (401, 403) else
                          f": {str(e).splitlines()[0]}")) from None


def offline_help(model: str, hub: HubOptions) -> str:
    return (f"{model} is not in the Hugging Face cache ({hub.cache_dir}), and HF_HUB_OFFLINE forbids asking "
            f"the Hub: unset HF_HUB_OFFLINE, or download it where the Hub is reachable "
            f"(`hf download {model}`) and point HF_HUB_CACHE or --download-dir at that cache")


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client's connection errors: httpx2 (huggingface_hub 2) or httpx (huggingface_hub 1)."""
    found = []
    for name in ("httpx2", "httpx"):
        with contextlib.suppress(ImportError):
            found.append(importlib.import_module(name).TransportError)
    return tuple(found)
