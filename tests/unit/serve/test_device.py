"""The CPU build's device is the NUMA node vLLM's CPU worker sizes its pool from."""

from __future__ import annotations

from pathlib import Path

import psutil

from oomguard.serve.device import cpu_node_device, refreshed


def test_cpu_node_reads_total_and_available_like_vllm() -> None:
    device = cpu_node_device()
    assert device is not None
    assert device.platform == "cpu" and device.spec.vendor == "cpu"
    assert device.spec.name.startswith("CPU node ")
    assert 0 < device.spec.total_bytes <= psutil.virtual_memory().total
    assert device.free_bytes is not None and 0 <= device.free_bytes <= device.spec.total_bytes
    meminfo = Path("/sys/devices/system/node/node0/meminfo")
    if meminfo.exists() and "cgroup" not in device.source:
        fields = {
            line.split()[2].rstrip(":"): int(line.split()[3]) * 1024
            for line in meminfo.read_text().splitlines()
            if len(line.split()) >= 4
        }
        assert device.spec.total_bytes == fields["MemTotal"]


def test_refreshed_keeps_the_name_calibration_is_stored_under() -> None:
    device = cpu_node_device()
    assert device is not None
    again = refreshed(device)
    assert again.name == device.name and again.platform == "cpu"
    assert again.free_bytes is not None
