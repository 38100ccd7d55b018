"""`shardserve doctor`'s checks of the GPU build: torch's CUDA, the GPUs torch sees, the driver, Triton, NCCL."""

from __future__ import annotations

import os
import re
from importlib import metadata

from shardserve.launch.cluster.check import Check

INSTALL_GPU = "on a GPU machine: make install-gpu (torch's CUDA build)"
# The oldest Linux driver of each CUDA major version (CUDA minor-version compatibility).
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
# NOTE: torch's CUDA index for each CUDA major version a driver may top out at: cu126 runs on every CUDA 12
# driver (minor-version compatibility) and keeps the pre-Turing GPUs that CUDA 13 builds dropped.
OLDER_TORCH_INDEX = {12: "https://download.pytorch.org/whl/cu126"}
BF16_CAPABILITY = (8, 0)  # bfloat16 and the Triton kernels' tensor-core paths
TUNED_CAPABILITY = (9, 0)  # the Triton kernels' tile sizes are chosen for sm_90 (wgmma)


def gpu_build_checks(has_nvml_gpus: bool, nvml=None, torch=None, triton_probe=None) -> list[Check]:
    """The rows after `gpus`. `torch` is the module (a stand-in in tests), imported when not given;
    `has_nvml_gpus`: the driver shows GPUs, so a build that cannot use them fails rather than skips."""
    if torch is None:
        torch = _import_torch()
    return [check_torch_cuda(torch, has_nvml_gpus), check_cuda_devices(torch, has_nvml_gpus),
            check_driver(torch, nvml), check_triton(torch, triton_probe), check_nccl(torch)]


def check_torch_cuda(torch, has_nvml_gpus: bool) -> Check:
    missing = "fail" if has_nvml_gpus else "skip"
    if torch is None:
        return Check("torch_cuda", missing, "torch is not installed (the runtime extra)", INSTALL_GPU)
    if not torch.version.cuda:
        return Check("torch_cuda", missing, f"torch {torch.__version__} is a CPU build "
                     "(torch.version.cuda is None)" + ("; NVML sees GPUs it cannot use" if has_nvml_gpus else ""),
                     INSTALL_GPU)
    return Check("torch_cuda", "pass", f"torch {torch.__version__} built for CUDA {torch.version.cuda}")


def check_cuda_devices(torch, has_nvml_gpus: bool) -> Check:
    if torch is None or not torch.version.cuda:
        return Check("cuda_devices", "skip", "torch is a CPU build: it sees no GPU", INSTALL_GPU)
    if not torch.cuda.is_available():
        if has_nvml_gpus:
            return Check("cuda_devices", "fail", f"torch (CUDA {torch.version.cuda}) sees no GPU though NVML "
                         "shows some", "check CUDA_VISIBLE_DEVICES and the driver row (a driver older than "
                         "torch's CUDA hides every GPU)")
        return Check("cuda_devices", "skip", f"torch is built for CUDA {torch.version.cuda} but no GPU is visible")
    count = torch.cuda.device_count()
    capabilities = {torch.cuda.get_device_capability(i) for i in range(count)}
    names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
    judged = [judge_capability(c, torch.cuda.get_arch_list()) for c in sorted(capabilities)]
    status = next((s for s in ("fail", "warn") if any(j[0] == s for j in judged)), "pass")
    fix = next((j[2] for j in judged if j[0] == status), None)
    return Check("cuda_devices", status, f"{count}x {', '.join(names)}: " + "; ".join(j[1] for j in judged), fix)


def check_driver(torch, nvml=None) -> Check:
    found = driver_versions(nvml)
    if found is None:
        return Check("driver", "skip", "no NVIDIA driver: NVML cannot be loaded",
                     "on a GPU machine: install the NVIDIA driver (nvidia-smi lists the GPUs)")
    driver, driver_cuda = found
    if torch is None or not torch.version.cuda:
        return Check("driver", "skip", f"driver {driver} (CUDA {_dotted(driver_cuda)}); torch is no CUDA build "
                     "to compare it with", INSTALL_GPU)
    status, detail, fix = judge_driver(driver, driver_cuda, parse_cuda(torch.version.cuda))
    return Check("driver", status, detail, fix)


def check_triton(torch, probe=None) -> Check:
    """Triton's version, and on a GPU a real kernel of the runtime compiled and run on GPU 0.
    `probe(torch) -> detail` runs it (raises when it fails)."""
    try:
        version = metadata.version("triton")
    except metadata.PackageNotFoundError:
        gpu = torch is not None and bool(torch.version.cuda) and torch.cuda.is_available()
        return Check("triton", "fail" if gpu else "skip", "triton is not installed (the gpu extra)", INSTALL_GPU)
    if torch is None or not torch.version.cuda or not torch.cuda.is_available():
        return Check("triton", "skip", f"triton {version}: no CUDA GPU to compile a kernel for", INSTALL_GPU)
    if os.environ.get("TRITON_INTERPRET") == "1":
        return Check("triton", "warn", f"triton {version}: TRITON_INTERPRET=1 runs every kernel in Triton's "
                     "interpreter (slow, nothing compiled)", "unset TRITON_INTERPRET")
    try:
        detail = (probe or run_triton_probe)(torch)
    except Exception as e:  # noqa: BLE001 - any failure to compile or run is the finding
        return Check("triton", "fail", f"triton {version} could not compile and run a kernel on GPU 0: "
                     f"{str(e).splitlines()[0] if str(e) else type(e).__name__}",
                     "Triton builds its launcher with a C compiler and the Python headers: install gcc "
                     "and python3-dev (python3.11-dev), and keep triton the version torch pins")
    return Check("triton", "pass", f"triton {version}: {detail}")


def run_triton_probe(torch) -> str:
    """The runtime's SiLU-and-mul kernel, JIT-compiled for GPU 0, against torch's own result."""
    from shardserve.runtime.layers.triton_activation import silu_and_mul
    x = torch.randn(4, 512, device="cuda:0", dtype=torch.float16)  # [rows, 2 * 256]: gate | up
    gate, up = x.float().chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate).half().float() * up).half()
    got = silu_and_mul(x)
    torch.cuda.synchronize()
    if not torch.allclose(got, want, atol=1e-2, rtol=1e-2):
        raise RuntimeError(f"the kernel's result differs from torch's by {(got - want).abs().max().item():.3g}")
    major, minor = torch.cuda.get_device_capability(0)
    return f"compiled and ran the runtime's SiLU kernel on GPU 0 (sm_{major}{minor})"


def check_nccl(torch) -> Check:
    if torch is None or not torch.version.cuda:
        return Check("nccl", "skip", "NCCL comes with torch's CUDA build; this one is a CPU build "
                     "(gloo carries the collectives)", INSTALL_GPU)
    try:
        version = _dotted(torch.cuda.nccl.version())
    except Exception as e:  # noqa: BLE001 - a CUDA build without NCCL (or a broken one) is the finding
        return Check("nccl", "fail", f"torch {torch.__version__} has no usable NCCL: {e}",
                     "install torch's CUDA wheel for Linux, which bundles NCCL: " + INSTALL_GPU)
    if not torch.cuda.is_available():
        return Check("nccl", "skip", f"NCCL {version} is in torch; no GPU here to run it")
    return Check("nccl", "pass", f"NCCL {version} (torch's own)")


def judge_capability(capability: tuple[int, int], arch_list: list[str]) -> tuple[str, str, str | None]:
    """A GPU's compute capability against the architectures torch was compiled for: (status, detail, fix)."""
    sm = f"sm_{capability[0]}{capability[1]}"
    if arch_list and not has_kernels_for(capability, arch_list):
        return ("fail", f"{sm}, but this torch has kernels only for {' '.join(arch_list)}",
                f"install a torch build for an older CUDA that lists this GPU: make install-gpu "
                f"TORCH_INDEX={OLDER_TORCH_INDEX[12]}")
    if capability < BF16_CAPABILITY:
        return ("warn", f"{sm}: float16 only (dtype auto picks it), and the Triton kernels are tuned for sm_90",
                "expect less speed than the plan predicts; sm_80 or later is the target")
    tuned = "the Triton kernels' tuned target" if capability >= TUNED_CAPABILITY else "the kernels are tuned for sm_90"
    return "pass", f"{sm} ({tuned})", None


def has_kernels_for(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """A cubin runs on later minor versions of its major (sm_80 on sm_86); PTX on any later GPU."""
    for arch in arch_list:
        match = re.fullmatch(r"(sm|compute)_(\d+)(\d)a?", arch)
        if match is None:
            continue
        built = (int(match.group(2)), int(match.group(3)))
        if built == capability or (match.group(1) == "sm" and built[0] == capability[0] and built < capability):
            return True
        if match.group(1) == "compute" and built <= capability:
            return True
    return False


def judge_driver(driver: str, driver_cuda: tuple[int, int], torch_cuda: tuple[int, int]) -> tuple[str, str, str | None]:
    """The driver (its version and the newest CUDA it supports) against the CUDA torch was built for."""
    said = f"driver {driver} supports CUDA {_dotted(driver_cuda)}, torch is built for CUDA {_dotted(torch_cuda)}"
    if driver_cuda >= torch_cuda:
        return "pass", said, None
    minimum = MIN_DRIVER.get(torch_cuda[0])
    upgrade = f"upgrade the NVIDIA driver to {minimum} or later" if minimum else "upgrade the NVIDIA driver"
    index = OLDER_TORCH_INDEX.get(driver_cuda[0])
    older = f", or install torch for CUDA {driver_cuda[0]}: make install-gpu TORCH_INDEX={index}" if index else ""
    if driver_cuda[0] == torch_cuda[0] and minimum and _driver_tuple(driver) >= _driver_tuple(minimum):
        return ("warn", f"{said}: runs through CUDA minor-version compatibility (kernels built for the newer "
                "CUDA's PTX cannot load)", upgrade)
    return "fail", f"{said}: torch cannot start CUDA on this driver", upgrade + older


def driver_versions(nvml=None) -> tuple[str, tuple[int, int]] | None:
    """(driver version, the newest CUDA it supports) from NVML; None where there is no driver."""
    if nvml is None:
        try:
            import pynvml
        except ImportError:
            return None
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...: no driver here
        return None
    try:
        driver = nvml.nvmlSystemGetDriverVersion()
        cuda = nvml.nvmlSystemGetCudaDriverVersion()  # 13020 for 13.2
    finally:
        nvml.nvmlShutdown()
    return (driver.decode() if isinstance(driver, bytes) else driver), (cuda // 1000, cuda % 1000 // 10)


def parse_cuda(text: str) -> tuple[int, int]:
    """torch.version.cuda ("13.0") as (13, 0)."""
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def _driver_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in version)


def _import_torch():
    try:
        import torch
    except ImportError:
        return None
    return torch
