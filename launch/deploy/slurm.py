"""The sbatch script of `deploy --target slurm`: the whole plan as one Ray cluster over the job's
nodes (the head on the first, the others joined by srun), then `launch` on the first node; a plan
that fits one node is served there by `launch` alone."""

from __future__ import annotations

import shlex

from shardserve.launch.deploy import scripts as deploy_scripts
from shardserve.launch.deploy.plan import (HTTP_PORT, RAY_PORT, DeployOptions, Shape, cpus, describe,
                                           memory_gib, whole_shape)
from shardserve.launch.deploy.pod import plan_text
from shardserve.planner.plan_file import PlanFile

PLAN_END = "SHARDSERVE_PLAN_END"  # the here-document's delimiter (no plan line is this word)
# NOTE: each node's record is outside the job's folder, which the first node's EXIT trap removes
# while that node's Ray head may still be stopping (it reads its record to stop)
_REMOVE_NODE_DIR = 'rm -rf "$SHARDSERVE_CLUSTER_DIR"'


def sbatch_script(plan: PlanFile, options: DeployOptions) -> str:
    shape = whole_shape(plan)
    return "\n".join(_header(plan, options, shape) + _setup(plan, options) + (
        _on_many_nodes(shape) if shape.pods_per_group > 1 else _on_one_node())) + "\n"


def _header(plan: PlanFile, options: DeployOptions, shape: Shape) -> list[str]:
    return [
        "#!/bin/bash",
        f"# shardserve deploy --target slurm: {describe(plan)}",
        "# Submit from a shell where `shardserve` and its `python` are on PATH (sbatch passes the environment on):",
        "#   sbatch slurm.sbatch      then: curl http://FIRST_NODE:8000/health (FIRST_NODE: squeue's NODELIST)",
        f"#SBATCH --job-name={options.name}",
        f"#SBATCH --nodes={shape.pods_per_group}",
        "#SBATCH --ntasks-per-node=1",
        *([] if shape.is_cpu else [f"#SBATCH --gpus-per-node={shape.gpus_per_pod}"]),
        f"#SBATCH --cpus-per-task={cpus(shape)}",
        f"#SBATCH --mem={memory_gib(shape)}G",
        "#SBATCH --output=%x-%j.out",
        deploy_scripts.STRICT,
        "",
    ]


def _setup(plan: PlanFile, options: DeployOptions) -> list[str]:
    """Ports, variables, and the plan written from a here-document into the job's folder on the first node."""
    text = plan_text(plan)
    assert PLAN_END not in text
    return [
        f"http_port={HTTP_PORT}",
        'job_dir="${TMPDIR:-/tmp}/shardserve-${SLURM_JOB_ID}"',
        *_exports(options),
        'mkdir -p "$job_dir"',
        "trap 'rm -rf \"$job_dir\"' EXIT",
        'plan="$job_dir/plan.yaml"',
        f"cat > \"$plan\" <<'{PLAN_END}'",
        text.rstrip("\n"),
        PLAN_END,
        "",
    ]


def _on_one_node() -> list[str]:
    """The plan fits the first node: `launch` starts its ranks there (a local Ray, or processes)."""
    return ['echo "shardserve: serving on $SLURMD_NODENAME:$http_port"',
            'shardserve launch "$plan" --host 0.0.0.0 --port "$http_port"']


def _on_many_nodes(shape: Shape) -> list[str]:
    return [
        f"ray_port={RAY_PORT}",
        "# each node keeps its Ray node record and token here, on its own disk, until the job ends",
        'export SHARDSERVE_CLUSTER_DIR="${TMPDIR:-/tmp}/shardserve-${SLURM_JOB_ID}-node"',
        "# the Ray cluster's token, new for each job: every node gets it through srun's environment",
        "export RAY_AUTH_MODE=token",
        "RAY_AUTH_TOKEN=\"$(od -An -tx1 -N32 /dev/urandom | tr -d ' \\n')\"",
        "export RAY_AUTH_TOKEN",
        "",
        *_node_functions(shape),
        "",
        'mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'head_node="${nodes[0]}"',
        f'echo "shardserve: Ray head on $head_node:$ray_port, ${{#nodes[@]}} node(s), waiting for {deploy_scripts.group_need(shape)}"',
        'srun --nodes=1 --ntasks=1 --overlap --nodelist="$head_node" bash -c \'start_head "$@"\' _ "$ray_port" &',
        'srun --nodes="$(( ${#nodes[@]} - 1 ))" --ntasks-per-node=1 --overlap --exclude="$head_node" \\',
        '  bash -c \'join_head "$@"\' _ "$head_node" "$ray_port" &',
        deploy_scripts.wait_for_group('"$head_node:$ray_port"', shape),
        'shardserve launch "$plan" --host 0.0.0.0 --port "$http_port" --ray-address "$head_node:$ray_port"',
    ]


def _exports(options: DeployOptions) -> list[str]:
    out = []
    if options.model_cache:
        out.append(f"export HF_HOME={shlex.quote(options.model_cache.mount_path)}")
    out += [f"export {name}={shlex.quote(value)}" for name, value in options.variables().items()]
    return out


def _node_functions(shape: Shape) -> list[str]:
    """What srun runs on the nodes (exported to their bash): each holds its step while Ray runs, since
    Slurm ends a step's processes when the step's command returns, and stops Ray when the job ends."""
    return [
        "start_head() {  # on the first node: the Ray head",
        f"  {deploy_scripts.STRICT}",
        f'  shardserve cluster up --head --port "$1"{deploy_scripts.node_slots(shape)}',
        *("  " + line for line in deploy_scripts.hold_node(_REMOVE_NODE_DIR)),
        "}",
        "join_head() {  # on every other node: wait for the head, then join it",
        f"  {deploy_scripts.STRICT}",
        *("  " + line for line in deploy_scripts.wait_for_port("$1", "$2", "the job's output file")),
        f'  shardserve cluster join "$1:$2"{deploy_scripts.node_slots(shape)}',
        *("  " + line for line in deploy_scripts.hold_node(_REMOVE_NODE_DIR)),
        "}",
        "export -f start_head join_head",
    ]
