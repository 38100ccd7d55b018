"""Factories for planner tests: plans from catalog ids and declared hardware, and a stand-in
for the NVML library (no NVIDIA driver on the machines that run the tests)."""

import types

from shardserve.planner import PlanOptions, load_model, make_plan, parse_declared


def plan_for(model: str, hardware: str, **options):
    return make_plan(load_model(model), parse_declared(hardware), PlanOptions(**options))


class FakeNvml:
    """A stand-in for the pynvml module (the NVIDIA library is not on a CPU machine)."""

    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 4

    class NVMLError(Exception):
        pass

    def __init__(self, names, total=80 * 2**30, free=None, links=None, fail_init=False):
        self.names, self.total, self.fail_init = names, total, fail_init
        self.free = free or [total] * len(names)
        self.links = links or {}  # (gpu, link) -> remote bus id
        self.shutdown = False

    def nvmlInit(self):
        if self.fail_init:
            raise self.NVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shutdown = True

    def nvmlDeviceGetCount(self):
        return len(self.names)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self.names[h].encode()

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(total=self.total, free=self.free[h], used=0)

    def nvmlDeviceGetPciInfo(self, h):
        return types.SimpleNamespace(busId=f"00000000:{h + 1:02X}:00.0".encode())

    def nvmlDeviceGetNvLinkState(self, h, link):
        if link >= self.NVML_NVLINK_MAX_LINKS:
            raise self.NVMLError("Invalid Argument")
        return int((h, link) in self.links)

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return types.SimpleNamespace(busId=self.links[(h, link)].encode())
