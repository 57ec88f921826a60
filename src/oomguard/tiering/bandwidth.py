"""Memory bandwidths that bound decode speed: GPU memory, host RAM, PCIe.

Decoding one token reads every active weight once, so a memory-bound decode step takes
``bytes / bandwidth`` on each device that holds weights; oomguard states slowdowns from these
figures as estimates (compute, batching and kernel efficiency are left out). GPU figures are
the vendors' data-sheet peaks.
"""

from __future__ import annotations

# GB/s, NVIDIA/AMD product data sheets
GPU_BANDWIDTH_GBPS = {
    "RTX 3060": 360, "RTX 3070": 448, "RTX 3080": 760, "RTX 3080 12GB": 912, "RTX 3090": 936,
    "RTX 3090 Ti": 1008, "RTX 4060 Ti 16GB": 288, "RTX 4070": 504, "RTX 4070 Ti Super": 672,
    "RTX 4080": 717, "RTX 4080 Super": 736, "RTX 4090": 1008, "RTX 5070 Ti": 896, "RTX 5080": 960,
    "RTX 5090": 1792, "T4": 320, "L4": 300, "A10": 600, "A10G": 600, "L40": 864, "L40S": 864,
    "A40": 696, "RTX A6000": 768, "RTX 6000 Ada": 960, "A100 40GB PCIe": 1555,
    "A100 40GB SXM": 1555, "A100 80GB PCIe": 1935, "A100 80GB SXM": 2039, "H100 PCIe": 2000,
    "H100 SXM": 3350, "H100 NVL": 3900, "H200": 4800, "H20": 4000, "GH200": 4000, "B200": 8000,
    "MI300X": 5300, "V100 16GB SXM2": 900, "V100 32GB SXM2": 900, "V100 16GB PCIe": 900,
    "V100 32GB PCIe": 900,
}  # fmt: skip
HOST_RAM_GBPS = 60.0  # dual-channel DDR5-4800 peak is 77 GB/s; what a CPU decode reaches, about 60
PCIE_GBPS = 25.0  # PCIe 4.0 x16, achievable host→device copy bandwidth


def gpu_bandwidth_gbps(gpu_name: str) -> float | None:
    """The data-sheet bandwidth of a catalogue GPU, or None when not known."""
    if gpu_name in GPU_BANDWIDTH_GBPS:
        return float(GPU_BANDWIDTH_GBPS[gpu_name])
    for name, value in GPU_BANDWIDTH_GBPS.items():
        if gpu_name.startswith(name + " "):  # "RTX 4090 (24 GiB)" from --gpu-memory-gib
            return float(value)
    return None
