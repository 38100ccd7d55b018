"""`shardserve deploy`: write the Kubernetes (Deployment, LeaderWorkerSet, KubeRay) or Slurm files
that run a plan; nothing is applied or submitted, no cluster is contacted."""

from __future__ import annotations

import enum
import re
from pathlib import Path
from typing import Annotated, Optional

import typer

from shardserve.launch.cli_options import plan_command_settings, setting_options
from shardserve.launch.cli_support import err, user_errors

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class Target(str, enum.Enum):
    k8s = "k8s"
    lws = "lws"
    kuberay = "kuberay"
    slurm = "slurm"


@setting_options(plan_command_settings())
def deploy(
    plan_file: Annotated[Optional[Path], typer.Argument(
        metavar="PLAN.yaml", help="A plan from `shardserve plan -o`; without one, plan now from --profile "
        "and the planning flags (declare the cluster: --hardware 2x8xH100-80GB).")] = None,
    target: Annotated[Target, typer.Option(
        "--target", help="k8s: a Deployment (one pod per replica, on one node) and a Service. lws: a "
        "LeaderWorkerSet, one group of pods per replica (replicas over several nodes). kuberay: a RayCluster "
        "for the whole plan (ray executor). slurm: an sbatch script for the whole plan.")] = Target.k8s,
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", help="The folder to write (required): k8s.yaml, lws.yaml or kuberay.yaml (the "
        "objects as one multi-document YAML, for kubectl apply -f DIR), or slurm.sbatch; - writes the file to "
        "stdout (kubectl apply -f -).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace a non-empty -o folder that holds only "
                                        "files such as deploy writes.")] = False,
    image: Annotated[Optional[str], typer.Option(
        help="The container image with shardserve (Kubernetes targets; required); the repo's Dockerfile "
        "builds it.")] = None,
    model_cache: Annotated[Optional[str], typer.Option(
        help="The Hugging Face cache the pods load from (HF_HOME): pvc:CLAIM (mounted at /models) or "
        "hostpath:/PATH (a folder on every node, mounted at the same path; on Slurm: HF_HOME=/PATH).")] = None,
    api_key_secret: Annotated[Optional[str], typer.Option(
        help="A Secret whose key 'api-key' holds the API key: the server reads it as SHARDSERVE_API_KEY.")]
    = None,
    namespace: Annotated[Optional[str], typer.Option(help="The objects' namespace (default: kubectl's).")]
    = None,
    name: Annotated[Optional[str], typer.Option(
        help="The objects' (or the Slurm job's) name (default: the model's, e.g. llama-3-1-70b-instruct).")]
    = None,
    load_rate_gbps: Annotated[float, typer.Option(
        min=0.001, help="GB/s a node reads the weights at (disk or network): the startup probe allows twice "
        "the plan's weight bytes per node at this rate, plus 180 s (and 600 s for a group to gather).")] = 1.0,
    socket_ifname: Annotated[Optional[str], typer.Option(
        help="NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME for every pod or node, such as eth0.")] = None,
    env: Annotated[Optional[list[str]], typer.Option(
        "--env", help="NAME=VALUE for every pod or node, such as --env NCCL_IB_HCA=mlx5.")] = None,
    profile: Annotated[Optional[str], typer.Option(
        help="Plan from this profile (name or YAML file); the planning flags override it.")] = None,
    **settings,
) -> None:
    """Write the files that run a plan on Kubernetes or Slurm. Each pod asks for the plan's GPUs,
    2 + 4 CPUs per GPU (twice that as the limit) and 8 GiB + 6 GiB per GPU of memory plus a /dev/shm of
    2 GiB per GPU, on nodes whose nvidia.com/gpu.product is the plan's GPU; probes on /health, metrics
    on :8000/metrics. A plan of CPU ranks gets pods without GPUs. Nothing is applied: the command prints
    what to run."""
    from shardserve.launch.deploy_config import parse_env
    from shardserve.launch.deploy.output import render, write_folder
    from shardserve.launch.deploy.plan import DeployOptions, check_name, default_name, parse_model_cache
    with user_errors():
        if output is None:
            raise _error("-o DIR is required: the folder to write the files into")
        _check_names(namespace, api_key_secret, socket_ifname)
        plan = _plan(plan_file, profile, settings)
        options = DeployOptions(target.value, check_name(name, "--name") if name else default_name(plan), image,
                                namespace, parse_model_cache(model_cache), api_key_secret, load_rate_gbps,
                                socket_ifname, tuple(parse_env(env or []).items()))
        files = render(plan, options)
        if str(output) == "-":
            return _to_stdout(plan, options, files)
        write_folder(output, files, force)
    _report(plan, options, output, files)


def _to_stdout(plan, options, files: dict[str, str]) -> None:
    """For `kubectl apply -f -`: the one file on stdout, what to watch for on stderr."""
    if len(files) > 1:
        raise _error(f"-o -: the {options.target} target writes {len(files)} files; give a folder")
    print(next(iter(files.values())), end="")
    _warnings(plan, options)


def _error(message: str):
    from shardserve.launch.deploy.plan import DeployError
    return DeployError(message)


def _plan(plan_file: Path | None, profile: str | None, settings: dict):
    """The plan file, or a plan made now; both at once is refused (which would win is not obvious)."""
    given = [k for k, v in settings.items() if v is not None]
    if plan_file is not None:
        if profile or given:
            flag = "--profile" if profile else "--" + given[0].replace("_", "-")
            raise _error(f"{flag} with a plan file: give PLAN.yaml or the planning flags, not both (plan again "
                         "with `shardserve plan ... -o plan.yaml`)")
        from shardserve.planner.plan_file import PlanFile
        from shardserve.planner.yaml_file import read_yaml
        data, _ = read_yaml(str(plan_file), "plan")
        return PlanFile.from_dict(data, str(plan_file))
    from shardserve.launch.plan_view import make_plan_from
    return make_plan_from(settings, profile, None)


def _check_names(namespace: str | None, api_key_secret: str | None, socket_ifname: str | None) -> None:
    for flag, value in (("--namespace", namespace), ("--api-key-secret", api_key_secret)):
        if value is not None and not _DNS_LABEL.match(value):
            raise _error(f"{flag} {value!r}: a Kubernetes name: lowercase letters, digits and dashes")
    if socket_ifname is not None and not re.fullmatch(r"[\w.:-]+(,[\w.:-]+)*", socket_ifname):
        raise _error(f"--socket-ifname {socket_ifname!r}: an interface name such as eth0 (or a list: eth0,eth1)")


def _report(plan, options, output: Path, files: dict[str, str]) -> None:
    from shardserve.launch.deploy.plan import nodes_per_replica
    for file_name in files:
        print(f"wrote {output / file_name}")
    _warnings(plan, options)
    print("next:")
    if options.target == "slurm":
        print(f"  sbatch {output / next(iter(files))}")
        return
    if options.target == "lws" and nodes_per_replica(plan) > 1:
        print(f"  kubectl create secret generic {options.ray_token_secret}{_ns(options)} "
                  '--from-literal=token="$(openssl rand -hex 32)"')
    if options.api_key_secret:
        print(f"  kubectl create secret generic {options.api_key_secret}{_ns(options)} "
                  "--from-literal=api-key=YOUR_KEY")
    print(f"  kubectl apply -f {output}")


def _warnings(plan, options) -> None:
    from shardserve.launch.deploy.plan import gpu_product_label, is_cpu_plan
    if options.target != "slurm" and gpu_product_label(plan) is None and not is_cpu_plan(plan):
        err.print(f"[yellow]warning:[/] no nvidia.com/gpu.product value known for {plan.hardware.gpu.name}: the "
                  "pods have no nodeSelector; add one by hand", highlight=False)
    if options.model_cache is None:
        err.print("[yellow]warning:[/] no --model-cache: each pod or node reads the model from its own Hugging "
                  "Face cache (downloading it there first)", highlight=False)


def _ns(options) -> str:
    return f" -n {options.namespace}" if options.namespace else ""
