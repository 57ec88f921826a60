"""GPU facts: a catalogue of accelerators with the total memory CUDA reports, and NVML detection.

vLLM sizes everything from ``torch.cuda.mem_get_info()`` (cudaMemGetInfo) ``total``, which is
below both the marketing size and nvidia-smi's total (the driver reserves a slice; ECC on GDDR
datacenter cards takes 1/16 more). Each entry records where its total comes from:

- ``observed``: a real log or error message printed this total (source cited);
- ``derived``: nvidia-smi's MiB total (or the physical size) minus the driver reserve seen on
  observed cards of the same generation (0.25–0.65 GiB); accurate to a few tenths of a GiB.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from oomguard.errors import BadInput, EnvironmentProblem, UnknownGPU
from oomguard.facts.nvml import NvmlDevice, NvmlUnavailable, read_devices
from oomguard.memory.spec import GPUSpec
from oomguard.units import GIB

_LOGS = "../shared/data/vllm-startup-logs.jsonl"
_OOMS = "../shared/data/oom-cases.jsonl"
# nvidia-smi totals per model: modal-labs/modal-client PR #2797 (H100 81559 MiB, A100-80 81920,
# A100-40 40960, A10 23028, L40S 46068, L4 23034, T4 15360); others from vendor spec sheets.
_SMI = "nvidia-smi total (modal-labs/modal-client#2797 or vendor spec) minus driver reserve"
_HOLDOUT = "bench/data/startup-logs-holdout.jsonl"
# Interconnect (``nvlink``), from NVIDIA's product pages and data sheets: SXM/SXM2 modules sit on
# NVLink (HGX boards: NVSwitch, every pair linked); H100 NVL and GH200 ship with NVLink; GeForce
# RTX 40/50, RTX 6000 Ada, RTX PRO 6000, L4/L40/L40S, A10/A10G and T4 have no NVLink; RTX 3090 and
# A6000 accept a 2-way bridge and A100/H100 PCIe an optional bridge, but cloud and workstation
# builds mostly run them without, so they count as PCIe-only (the conservative case for a bridged
# pair is ``nvlink=True`` via a custom GPU). AMD Instinct MI300X: xGMI, fully connected on the
# 8-GPU platform. vLLM keys its custom all-reduce on this (custom_all_reduce.py).
_NVLINK = frozenset({"V100 16GB SXM2", "V100 32GB SXM2", "A100 40GB SXM", "A100 80GB SXM",
                     "H100 SXM", "H100 NVL", "H200", "H20", "H20 141GB", "GH200", "B200", "MI300X",
                     "A800 80GB", "H800"})  # fmt: skip


# NVSwitch systems of the Hopper/Blackwell generations (HGX boards; NVIDIA HGX data sheets): NCCL
# can run NVLink SHARP (NVLS) there. A100 SXM has NVSwitch but no NVLS (third-generation
# NVSwitch is Hopper's); NVL cards and GH200 link pairs or nothing.
_NVLS = frozenset({"H100 SXM", "H800", "H200", "H20", "H20 141GB", "B200"})
# Integrated GPUs that share the host's memory (torch ``is_integrated``): vLLM reads their free
# memory from the OS (psutil) since 0.12, and everything else on the box competes for it.
_UNIFIED = frozenset({"GB10", "Jetson AGX Thor", "Jetson AGX Orin 64GB", "Jetson AGX Orin 32GB"})
_ADA_WS = "NVIDIA RTX Ada workstation data sheet"


class NoGPUDetected(EnvironmentProblem):
    """``--gpu auto`` was asked for but NVML found no usable NVIDIA GPU."""


@dataclass(frozen=True)
class _Row:
    name: str
    marketing_gb: float
    total_gib: float
    cc: str
    device_name: str
    source: str
    aliases: tuple[str, ...] = ()
    vendor: str = "nvidia"


_ROWS: tuple[_Row, ...] = (
    # consumer
    _Row("RTX 2060 12GB", 12, 11.997, "7.5", "NVIDIA GeForce RTX 2060 12GB",
         "observed: vLLM log total_gpu_memory (12.00GiB, so 11.995-12.0) on an RTX 2060 12GB "
         f"({_HOLDOUT}, row 13)",
         ("2060 12gb",)),
    _Row("RTX 3060", 12, 11.76, "8.6", "NVIDIA GeForce RTX 3060",
         f"derived: 12288 MiB {_SMI}", ("3060", "rtx 3060 12gb")),
    _Row("RTX 3070", 8, 7.76, "8.6", "NVIDIA GeForce RTX 3070",
         f"derived: 8192 MiB {_SMI}", ("3070",)),
    _Row("RTX 3080", 10, 9.77, "8.6", "NVIDIA GeForce RTX 3080",
         f"derived: 10240 MiB {_SMI}", ("3080", "rtx 3080 10gb")),
    _Row("RTX 3080 12GB", 12, 11.76, "8.6", "NVIDIA GeForce RTX 3080",
         f"derived: 12288 MiB {_SMI}", ("3080 12gb",)),
    _Row("RTX 3090", 24, 23.58, "8.6", "NVIDIA GeForce RTX 3090",
         f"observed: vLLM log total_gpu_memory=23.58GiB ({_LOGS}, vllm-project/vllm#10517)",
         ("3090",)),
    _Row("RTX 3090 Ti", 24, 23.57, "8.6", "NVIDIA GeForce RTX 3090 Ti",
         f"derived: 24564 MiB {_SMI}", ("3090 ti", "3090ti")),
    _Row("RTX 4060 Ti 16GB", 16, 15.70, "8.9", "NVIDIA GeForce RTX 4060 Ti",
         f"derived: 16380 MiB {_SMI}", ("4060 ti", "4060ti", "4060 ti 16gb")),
    _Row("RTX 4070", 12, 11.72, "8.9", "NVIDIA GeForce RTX 4070",
         f"derived: 12282 MiB {_SMI}", ("4070",)),
    _Row("RTX 4070 Ti Super", 16, 15.70, "8.9", "NVIDIA GeForce RTX 4070 Ti SUPER",
         f"derived: 16376 MiB {_SMI}", ("4070 ti super", "4070tis")),
    _Row("RTX 4080", 16, 15.70, "8.9", "NVIDIA GeForce RTX 4080",
         f"derived: 16376 MiB {_SMI}", ("4080",)),
    _Row("RTX 4080 Super", 16, 15.70, "8.9", "NVIDIA GeForce RTX 4080 SUPER",
         f"derived: 16376 MiB {_SMI}", ("4080 super",)),
    _Row("RTX 4090", 24, 23.65, "8.9", "NVIDIA GeForce RTX 4090",
         "observed: PyTorch OOM 'total capacity of 23.65 GiB' on RTX 4090 "
         "(MotrixLab/AiOS#29, HKUDS/GraphGPT#29)",
         ("4090",)),
    _Row("RTX 5070 Ti", 16, 15.48, "12.0", "NVIDIA GeForce RTX 5070 Ti",
         "derived: same 16 GB GDDR7 as the RTX 5080 observed at 15.48 GiB", ("5070 ti", "5070ti")),
    _Row("RTX 5080", 16, 15.48, "12.0", "NVIDIA GeForce RTX 5080",
         f"observed: 'total capacity of 15.48 GiB' ({_OOMS}, vllm-project/vllm#14452)", ("5080",)),
    _Row("RTX 5090", 32, 31.36, "12.0", "NVIDIA GeForce RTX 5090",
         f"derived: 32607 MiB {_SMI}", ("5090",)),
    # workstation
    _Row("RTX A6000", 48, 47.54, "8.6", "NVIDIA RTX A6000",
         f"derived: 49140 MiB (ECC off) {_SMI}", ("a6000",)),
    _Row("RTX 6000 Ada", 48, 47.50, "8.9", "NVIDIA RTX 6000 Ada Generation",
         f"derived: 49140 MiB (ECC off) {_SMI}", ("6000 ada", "rtx 6000 ada generation")),
    _Row("RTX 2000 Ada", 16, 15.70, "8.9", "NVIDIA RTX 2000 Ada Generation",
         f"derived: 16 GB GDDR6 ({_ADA_WS}), 16380 MiB like the other 16 GB Ada cards, {_SMI}",
         ("rtx 2000 ada generation", "2000 ada", "rtx 2000 ada 16gb")),
    _Row("RTX 4000 Ada", 20, 19.70, "8.9", "NVIDIA RTX 4000 Ada Generation",
         f"derived: 20 GB GDDR6 ({_ADA_WS}), 20475 MiB {_SMI}",
         ("4000 ada", "rtx 4000 ada generation")),
    _Row("RTX 4500 Ada", 24, 23.68, "8.9", "NVIDIA RTX 4500 Ada Generation",
         f"derived: 24 GB GDDR6 ({_ADA_WS}), 24570 MiB {_SMI}",
         ("4500 ada", "rtx 4500 ada generation")),
    _Row("RTX 5000 Ada", 32, 31.65, "8.9", "NVIDIA RTX 5000 Ada Generation",
         f"derived: 32 GB GDDR6 ({_ADA_WS}), 32760 MiB {_SMI}",
         ("5000 ada", "rtx 5000 ada generation")),
    _Row("RTX A4000", 16, 15.70, "8.6", "NVIDIA RTX A4000",
         f"derived: 16376 MiB {_SMI}", ("a4000",)),
    _Row("RTX A5000", 24, 23.68, "8.6", "NVIDIA RTX A5000",
         f"derived: 24564 MiB {_SMI}", ("a5000",)),
    _Row("RTX PRO 6000 Blackwell", 96, 94.97, "12.0",
         "NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
         f"derived: 97887 MiB {_SMI}",
         ("rtx pro 6000", "pro 6000", "rtx pro 6000 96gb", "6000 blackwell")),
    # datacenter
    _Row("V100 16GB SXM2", 16, 15.77, "7.0", "Tesla V100-SXM2-16GB", f"derived: 16160 MiB {_SMI}",
         ("v100", "v100 16gb", "tesla v100", "v100-sxm2-16gb", "v100 sxm2 16gb")),
    _Row("V100 32GB SXM2", 32, 31.74, "7.0", "Tesla V100-SXM2-32GB",
         f"observed: vLLM log total_gpu_memory (31.74GiB) on a V100 32GB ({_HOLDOUT}, row 14)",
         ("v100 32gb", "v100-32gb", "v100 32g", "v100-sxm2-32gb", "v100 sxm2 32gb")),
    _Row("V100 16GB PCIe", 16, 15.77, "7.0", "Tesla V100-PCIE-16GB",
         "derived: same 16160 MiB HBM2 as the V100 16GB SXM2",
         ("v100-pcie-16gb", "v100 pcie 16gb", "v100 pcie")),
    _Row("V100 32GB PCIe", 32, 31.74, "7.0", "Tesla V100-PCIE-32GB",
         "derived: same 32 GB HBM2 as the V100 32GB SXM2 observed at 31.74 GiB",
         ("v100-pcie-32gb", "v100 pcie 32gb")),
    _Row("T4", 16, 14.74, "7.5", "Tesla T4",
         f"observed: vLLM log total 14.74 GiB ({_LOGS}; 15360 MiB with ECC)",
         ("tesla t4", "t4 16gb")),
    _Row("A10", 24, 22.20, "8.6", "NVIDIA A10", f"derived: 23028 MiB (ECC on) {_SMI}", ()),
    _Row("A10G", 24, 22.20, "8.6", "NVIDIA A10G", f"derived: 23028 MiB (ECC on) {_SMI}", ()),
    _Row("L4", 24, 22.17, "8.9", "NVIDIA L4", f"derived: 23034 MiB (ECC on) {_SMI}", ()),
    _Row("L40", 48, 44.39, "8.9", "NVIDIA L40",
         "derived: same 48 GB GDDR6 (ECC on) as the L40S observed at 44.39 GiB", ()),
    _Row("L40S", 48, 44.39, "8.9", "NVIDIA L40S",
         f"observed: vLLM log total 44.39 GiB ({_LOGS})", ()),
    _Row("A40", 48, 44.39, "8.6", "NVIDIA A40",
         "derived: 48 GB GDDR6 with ECC on (NVIDIA A40 data sheet), the same 46068 MiB as the L40S "
         "observed at 44.39 GiB", ("nvidia a40", "a40 48gb")),
    _Row("L20", 48, 44.39, "8.9", "NVIDIA L20",
         "derived: 48 GB GDDR6 with ECC on, as the L40S observed at 44.39 GiB", ("l20 48gb",)),
    _Row("A100 40GB PCIe", 40, 39.39, "8.0", "NVIDIA A100-PCIE-40GB",
         "derived: same 40 GB HBM2 as the A100 40GB SXM observed at 39.39 GiB",
         ("a100 pcie 40gb", "a100-pcie-40gb")),
    _Row("A100 40GB SXM", 40, 39.39, "8.0", "NVIDIA A100-SXM4-40GB",
         f"observed: vLLM log total_gpu_memory (39.39GiB) on ml.p4d ({_LOGS})",
         ("a100 40gb", "a100-40gb", "a100 40g", "a100-sxm4-40gb")),
    _Row("A100 80GB PCIe", 80, 79.35, "8.0", "NVIDIA A100 80GB PCIe",
         "derived: same 80 GB HBM2e as the A100 80GB observed at 79.35 GiB",
         ("a100 pcie 80gb", "a100 pcie")),
    _Row("A100 80GB SXM", 80, 79.35, "8.0", "NVIDIA A100-SXM4-80GB",
         f"observed: 'A100 80GB (79.35 GiB)' ({_OOMS}); 81920 MiB in nvidia-smi",
         ("a100", "a100 80gb", "a100-80gb", "a100 80g", "a100-sxm4-80gb")),
    _Row("A800 80GB", 80, 79.33, "8.0", "NVIDIA A800-SXM4-80GB",
         "observed: '8x A800 80GB (79.33 GiB)' "
         "(bench/data/oom-cases-holdout.jsonl, QwenLM/Qwen3#67)",
         ("a800", "a800 80gb", "a800-sxm4-80gb")),
    _Row("H100 PCIe", 80, 79.19, "9.0", "NVIDIA H100 PCIe",
         "derived: same 81559 MiB as the H100 SXM observed at 79.19 GiB", ("h100 pcie 80gb",)),
    _Row("H100 SXM", 80, 79.19, "9.0", "NVIDIA H100 80GB HBM3",
         f"observed: vLLM logs total_gpu_memory 79.18-79.22 GiB, 79.19 in 42 rows ({_LOGS})",
         ("h100", "h100 80gb", "h100-80g", "h100 80g", "h100 80gb hbm3", "h100 sxm5",
          "h100-sxm5-80gb")),
    _Row("H100 NVL", 94, 93.10, "9.0", "NVIDIA H100 NVL",
         f"derived: 95830 MiB {_SMI}", ("h100 nvl 94gb",)),
    _Row("H800", 80, 79.19, "9.0", "NVIDIA H800",
         "derived: same 81559 MiB HBM3 as the H100 SXM observed at 79.19 GiB", ("h800 80gb",)),
    _Row("H200", 141, 139.72, "9.0", "NVIDIA H200",
         f"derived: same 141 GB HBM3e as the H20 141GB observed at 139.72 GiB ({_OOMS}, "
         "vllm-project/vllm#31273)",
         ("h200 141gb", "h200 sxm")),
    _Row("H20", 96, 95.10, "9.0", "NVIDIA H20", f"derived: 97871 MiB {_SMI}", ("h20 96gb",)),
    _Row("H20 141GB", 141, 139.72, "9.0", "NVIDIA H20",
         f"observed: 'H20 141GB (139.72 GiB)' ({_OOMS}, vllm-project/vllm#31273)",
         ("h20-141g", "h20 141g")),
    _Row("GH200", 96, 95.00, "9.0", "NVIDIA GH200 480GB",
         f"derived: 97871 MiB {_SMI}", ("gh200 96gb", "gh200 480gb")),
    _Row("H200 NVL", 141, 139.72, "9.0", "NVIDIA H200 NVL",
         "derived: same 141 GB HBM3e as the H20 141GB observed at 139.72 GiB", ("h200nvl",)),
    _Row("GB10", 128, 121.69, "12.1", "NVIDIA GB10",
         "observed: 'Free memory on device cuda:0 (8.88/121.69 GiB)' on a DGX Spark "
         "(bench/data/oom-cases-holdout4.jsonl, Blackwellboy/model-serving-minefield#53); unified "
         "LPDDR5X shared with the host",
         ("dgx spark", "spark", "gb10 dgx spark", "nvidia dgx spark")),
    _Row("Jetson AGX Thor", 128, 121.69, "11.0", "NVIDIA Jetson AGX Thor",
         "derived: 128 GB LPDDR5X unified memory (Jetson AGX Thor data sheet) less the share "
         "the GB10's identical 128 GB leaves CUDA (121.69 GiB observed); give "
         "--gpu-memory-gib for yours",
         ("thor", "agx thor", "jetson thor")),
    _Row("Jetson AGX Orin 64GB", 64, 60.84, "8.7", "Orin",
         "derived: 64 GB LPDDR5 unified memory (Jetson AGX Orin data sheet) with the GB10's "
         "CUDA-visible share (121.69 of 128 GiB); give --gpu-memory-gib for yours",
         ("agx orin", "jetson orin", "orin 64gb", "jetson agx orin")),
    _Row("Jetson AGX Orin 32GB", 32, 30.42, "8.7", "Orin",
         "derived: 32 GB LPDDR5 unified memory (Jetson AGX Orin data sheet) with the GB10's "
         "CUDA-visible share (121.69 of 128 GiB); give --gpu-memory-gib for yours",
         ("orin 32gb", "jetson agx orin 32gb")),
    _Row("B200", 180, 178.56, "10.0", "NVIDIA B200",
         f"derived: 183359 MiB {_SMI}", ("b200 180gb", "b200 192gb")),
    _Row("MI300X", 192, 191.98, "9.4", "AMD Instinct MI300X",
         "derived: 192 GiB HBM3 less the ROCm reserve seen in MI300X OOM messages",
         ("instinct mi300x", "mi300"), "amd"),
)  # fmt: skip


def _spec(row: _Row) -> GPUSpec:
    return GPUSpec(
        name=row.name,
        total_bytes=round(row.total_gib * GIB),
        marketing_gb=row.marketing_gb,
        vendor=row.vendor,
        compute_capability=row.cc,
        device_name=row.device_name,
        source=row.source,
        nvlink=row.name in _NVLINK,
        nvls=row.name in _NVLS,
        unified_memory=row.name in _UNIFIED,
    )


GPU_CATALOGUE: tuple[GPUSpec, ...] = tuple(_spec(r) for r in _ROWS)

_NOISE_WORDS = re.compile(
    r"\b(nvidia|geforce|tesla|amd|instinct|radeon|graphics|gpu|generation|edition|workstation)\b"
)
# Board variants that nvidia-smi names but that carry the same GPU and memory as the catalogue
# entry, differing only in cooling and power: "RTX PRO 6000 Blackwell Server Edition" and
# "... Max-Q Workstation Edition" are the Workstation Edition's GB202 with its 96 GB (same silicon,
# other cooling: vllm-project/vllm#40991; NVIDIA RTX PRO 6000 Blackwell data sheets).
_SAME_MEMORY_VARIANTS = re.compile(r"\b(server\s+edition|max-?q)\b")


def _key(name: str) -> str:
    text = _SAME_MEMORY_VARIANTS.sub(" ", name.lower())
    text = _NOISE_WORDS.sub(" ", text)
    text = re.sub(r"(\d+)\s*g(b|ib)?\b", r"\1gb", text)  # 80G / 80 GiB → 80gb
    return re.sub(r"[^a-z0-9]", "", text)


def _index() -> dict[str, GPUSpec]:
    idx: dict[str, GPUSpec] = {}
    for row, spec in zip(_ROWS, GPU_CATALOGUE, strict=True):
        for alias in (row.name, row.device_name, *row.aliases):
            idx.setdefault(_key(alias), spec)
        idx.setdefault(_key(row.name.replace("RTX ", "")), spec)
    return idx


_INDEX = _index()


def list_gpus() -> list[GPUSpec]:
    """Every catalogue GPU, consumer first, datacenter last."""
    return list(GPU_CATALOGUE)


def find_gpu(name: str) -> GPUSpec:
    """The catalogue GPU for a forgiving name ("4090", "NVIDIA H100 80GB HBM3", "H100-80G", "h100").

    A bare family name picks the most common variant (``h100`` → H100 SXM, ``a100`` → A100 80GB
    SXM). Raises :class:`UnknownGPU` listing the closest names.
    """
    key = _key(name)
    if key in _INDEX:
        return _INDEX[key]
    # strip a trailing form-factor/memory qualifier the table does not list ("rtx 4090 24gb")
    trimmed = _key(re.sub(r"\b\d+\s*g(i?b)?\b|\b(sxm\d?|pcie)\b", " ", name.lower()))
    if trimmed and trimmed in _INDEX:
        return _INDEX[trimmed]
    close = difflib.get_close_matches(key, list(_INDEX), n=8, cutoff=0.5)
    names: list[str] = []
    for k in close:
        if _INDEX[k].name not in names:
            names.append(_INDEX[k].name)
    near = f"; closest: {', '.join(names[:5])}" if names else ""
    raise UnknownGPU(
        f"unknown GPU {name!r}{near}",
        "pass a catalogue name (see `oomguard gpus`) or give the memory with --gpu-memory-gib",
    )


def custom_gpu(total_gib: float, name: str = "custom") -> GPUSpec:
    """A GPUSpec for a user-given CUDA total (``--gpu-memory-gib``); must be positive."""
    if not total_gib > 0:
        raise BadInput(
            f"GPU memory must be positive, got {total_gib} GiB",
            "pass --gpu-memory-gib as CUDA reports it",
        )
    return GPUSpec(
        name=name,
        total_bytes=round(total_gib * GIB),
        marketing_gb=total_gib,
        source="user-given total",
    )


@dataclass(frozen=True)
class GPUProcess:
    """Another process holding memory on a GPU (a co-tenant shrinks vLLM's budget)."""

    pid: int
    used_bytes: int | None  # None when the driver does not say (containers without PID namespace)
    name: str = ""


@dataclass(frozen=True)
class DetectedGPU:
    """One GPU as NVML sees it right now."""

    index: int
    name: str  # NVML name, e.g. "NVIDIA H100 80GB HBM3"
    total_bytes: int  # NVML total (nvidia-smi's figure)
    free_bytes: int
    used_bytes: int
    reserved_bytes: int  # driver-reserved (NVML v2), 0 when unknown
    processes: tuple[GPUProcess, ...]
    spec: GPUSpec  # catalogue entry when the name matches, else built from NVML

    @property
    def cuda_total_bytes(self) -> int:
        """The total CUDA (and so vLLM) will report for this GPU."""
        return self.spec.total_bytes


def detect_gpus() -> list[DetectedGPU]:
    """Every NVIDIA GPU NVML can see, with memory use and the processes using it.

    Raises :class:`NoGPUDetected` when NVML (nvidia-ml-py or the driver) is unavailable or
    reports no devices.
    """
    try:
        devices = read_devices()
    except NvmlUnavailable as exc:
        if exc.reason == "not_installed":
            raise NoGPUDetected(
                "--gpu auto needs nvidia-ml-py, which is not installed",
                "pip install nvidia-ml-py, or name the GPU with --gpu NAME",
            ) from None
        if exc.reason == "no_driver":
            raise NoGPUDetected(
                f"--gpu auto found no NVIDIA driver ({exc.detail})",
                "name the GPU with --gpu NAME (e.g. --gpu 'H100 SXM') or --gpu-memory-gib N",
            ) from None
        raise
    if not devices:
        raise NoGPUDetected("--gpu auto: NVML reports no GPUs", "name the GPU with --gpu NAME")
    return [_detected(d) for d in devices]


def _detected(device: NvmlDevice) -> DetectedGPU:
    procs: list[GPUProcess] = []
    for p in device.processes:
        if all(q.pid != p.pid for q in procs):
            procs.append(GPUProcess(pid=p.pid, used_bytes=p.used_bytes))
    try:
        spec = find_gpu(device.name)
    except UnknownGPU:
        spec = GPUSpec(
            name=device.name,
            total_bytes=device.total_bytes - device.reserved_bytes,
            marketing_gb=round(device.total_bytes / 1e9),
            device_name=device.name,
            source="NVML total minus driver reserve (not in catalogue)",
        )
    return DetectedGPU(
        index=device.index,
        name=device.name,
        total_bytes=device.total_bytes,
        free_bytes=device.free_bytes,
        used_bytes=device.used_bytes,
        reserved_bytes=device.reserved_bytes,
        processes=tuple(procs),
        spec=spec,
    )


# The name the planner, doctor and benchmarks use for the lookup.
resolve_gpu = find_gpu
