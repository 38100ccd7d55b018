"""The doctor's NCCL probe for real: an all-reduce over two GPUs of this machine with
NCCL_DEBUG=INFO, and the channels NCCL logged (P2P/NVLink expected on an H100/H200 node)."""

import pytest
import torch

from shardserve.launch.cluster.nccl_probe import judge, parse_nccl_log, run_local_probe


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the NCCL probe needs two GPUs")
def test_local_probe_reports_the_transport():
    report = parse_nccl_log(run_local_probe(2))
    assert report.channels, "NCCL logged no channel line"
    assert report.kinds <= {"p2p", "shm"}
    assert judge(report, crosses_nodes=False)[0] in ("pass", "warn")
