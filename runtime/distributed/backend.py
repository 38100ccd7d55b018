"""Which executor runs an engine's ranks: the backend chosen by the planner's rule, the layout checked,
then the executor made (one rank in this process, mp processes on this machine, or Ray actors)."""

from __future__ import annotations

from shardserve.runtime.config import EngineConfig, ParallelConfig
from shardserve.runtime.distributed.executor import Executor, InProcessExecutor


def resolve_backend(parallel: ParallelConfig, num_local_devices: int | None) -> str:
    """The planner's rule: one rank runs in-process; ranks that fit this machine use "mp"; more than
    it holds need "ray". An explicit distributed_executor_backend wins."""
    backend = parallel.distributed_executor_backend
    if backend is not None:
        return backend
    if parallel.world_size == 1:
        return "uni"
    if num_local_devices is not None and parallel.world_size > num_local_devices:
        return "ray"
    return "mp"


def local_device_count(device: str) -> int | None:
    import torch

    from shardserve.runtime.config import first_device_index

    if not device.startswith("cuda"):
        return None
    return torch.cuda.device_count() - first_device_index(device)  # GPUs from the first one on


def make_executor(config: EngineConfig) -> Executor:
    """Check the layout, then start the executor the backend names (nothing starts if the check fails)."""
    from shardserve.runtime.distributed.parallel_layout import check_parallel_layout
    from shardserve.runtime.worker.pipeline import plan_layer_split

    parallel = config.parallel
    num_devices = local_device_count(config.device)
    backend = resolve_backend(parallel, num_devices)
    check_parallel_layout(config.model, parallel, num_devices if backend == "mp" else None)
    if backend == "uni":
        if parallel.world_size != 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank; tensor_parallel_size x "
                             f"pipeline_parallel_size = {parallel.world_size}: use 'mp' or 'ray'")
        return InProcessExecutor(config)
    if config.scheduler.async_scheduling:
        raise ValueError(f"async_scheduling runs one rank in this process; tensor_parallel_size x "
                         f"pipeline_parallel_size = {parallel.world_size} with distributed_executor_backend="
                         f"{backend!r} cannot honour it: turn async_scheduling off")
    quant = config.model.quantization
    layer_split = parallel.layer_split or plan_layer_split(
        config.model.model, parallel.tensor_parallel_size, parallel.pipeline_parallel_size, config.model.dtype,
        quant.format if quant else None)
    if backend == "mp":
        from shardserve.runtime.distributed.mp_executor import MultiprocExecutor
        return MultiprocExecutor(config, layer_split)
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'ray[default]'") from None
    from shardserve.runtime.distributed.ray_executor import RayExecutor
    return RayExecutor(config, layer_split)
