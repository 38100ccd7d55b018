"""Make a target's files from a plan and write them into the -o folder at once: the folder holds
all of them or, after a failure, what it held before.

One file per target: k8s.yaml, lws.yaml, kuberay.yaml (the objects as one multi-document YAML,
for `kubectl apply -f DIR`) or slurm.sbatch (for `sbatch DIR/slurm.sbatch`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import yaml

from shardserve.launch.deploy.k8s import k8s_objects, lws_objects
from shardserve.launch.deploy.plan import DeployError, DeployOptions, check_options, describe
from shardserve.launch.deploy.kuberay import kuberay_objects
from shardserve.launch.deploy.slurm import sbatch_script
from shardserve.planner.plan_file import PlanFile

FILE_NAMES = {"k8s": "k8s.yaml", "lws": "lws.yaml", "kuberay": "kuberay.yaml", "slurm": "slurm.sbatch"}
# --force replaces a folder only when it holds nothing but files such as these (a previous deploy's)
_REPLACEABLE = (".yaml", ".yml", ".sbatch", ".sh", ".json")


class _Dumper(yaml.SafeDumper):
    """Scripts and the plan as literal blocks (`|`), readable and diffable, not one quoted line; a
    mapping used twice (labels as a selector) written out twice, not as a YAML alias."""

    def ignore_aliases(self, data) -> bool:
        return True


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _text)


def render_objects(objects: list[dict], header: str) -> str:
    body = yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, width=1000, explicit_start=True)
    return "".join(f"# {line}\n" for line in header.splitlines()) + body


def render(plan: PlanFile, options: DeployOptions) -> dict[str, str]:
    """{file name: text} for the target; refuses what the target cannot deploy."""
    check_options(plan, options)
    if options.target == "slurm":
        return {FILE_NAMES["slurm"]: sbatch_script(plan, options)}
    build = {"k8s": k8s_objects, "lws": lws_objects, "kuberay": kuberay_objects}[options.target]
    header = (f"shardserve deploy --target {options.target}: {describe(plan)}\n"
              f"apply with: kubectl apply -f {FILE_NAMES[options.target]}")
    return {FILE_NAMES[options.target]: render_objects(build(plan, options), header)}


def write_folder(folder: Path, files: dict[str, str], force: bool) -> None:
    """Write `files` into `folder` (made if missing); an existing non-empty folder only with `force`,
    and then it is replaced whole. Written beside it first, then renamed into place."""
    folder = folder.expanduser().absolute()
    if not folder.parent.is_dir():
        raise DeployError(f"cannot write {folder}: its parent folder does not exist")
    if folder.exists() and not folder.is_dir():
        raise DeployError(f"-o {folder} is a file: give a folder")
    existing = sorted(folder.iterdir()) if folder.is_dir() else []
    if existing and not force:
        raise DeployError(f"-o {folder} is not empty ({existing[0].name}, ...): give a new or empty folder, "
                          "or --force to replace it")
    stray = [p.name for p in existing if not (p.is_file() and p.suffix in _REPLACEABLE)]
    if stray:
        raise DeployError(f"--force replaces {folder} whole, and it holds {stray[0]}, which deploy does not write: "
                          "give a new or empty -o folder")
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        for name, text in files.items():
            (staging / name).write_text(text)
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp's 0700 is for secrets; these are not
        _swap(staging, folder, existing)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _swap(staging: Path, folder: Path, existing: list[Path]) -> None:
    if not folder.exists() or not existing:
        os.replace(staging, folder)  # rename(2) replaces an empty folder too
        return
    old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
    os.rename(folder, old)
    try:
        os.rename(staging, folder)
    except BaseException:
        os.rename(old, folder)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
