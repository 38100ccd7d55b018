"""`shardserve doctor`'s GPU build rows on a real GPU: torch's CUDA, the GPUs, the driver, a Triton kernel
compiled and run, NCCL."""

from shardserve.launch.cluster.doctor import run_checks


def test_gpu_build_rows_pass():
    rows = {c.name: c for c in run_checks(None)}
    for name in ("torch_cuda", "cuda_devices", "triton", "nccl"):
        assert rows[name].status == "pass", (name, rows[name].detail, rows[name].fix)
    assert rows["driver"].status in ("pass", "warn"), rows["driver"].detail
    assert "compiled and ran the runtime's SiLU kernel on GPU 0" in rows["triton"].detail
