"""GPU catalogue totals (as CUDA reports them) and forgiving name resolution."""

from __future__ import annotations

import pytest

from oomguard.errors import BadInput, EnvironmentProblem, UnknownGPU
from oomguard.facts.gpus import GPU_CATALOGUE, NoGPUDetected, custom_gpu, detect_gpus, find_gpu


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        ("RTX 4090", "RTX 4090"),
        ("4090", "RTX 4090"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("H100-80G", "H100 SXM"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("h100", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("H100 NVL", "H100 NVL"),
        ("a100", "A100 80GB SXM"),
        ("A100-40GB", "A100 40GB SXM"),
        ("NVIDIA A100-SXM4-40GB", "A100 40GB SXM"),
        ("Tesla T4", "T4"),
        ("NVIDIA A10G", "A10G"),
        ("rtx 3080 12gb", "RTX 3080 12GB"),
        ("RTX 4060 Ti 16GB", "RTX 4060 Ti 16GB"),
        ("RTX PRO 6000", "RTX PRO 6000 Blackwell"),
        ("AMD Instinct MI300X", "MI300X"),
        ("rtx 4090 24gb", "RTX 4090"),
        # names exactly as nvidia-smi / NVML print them
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "RTX PRO 6000 Blackwell"),
        ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "RTX PRO 6000 Blackwell"),
        ("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition", "RTX PRO 6000 Blackwell"),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM"),
        ("NVIDIA A100-PCIE-40GB", "A100 40GB PCIe"),
        ("Tesla V100-SXM2-32GB", "V100 32GB SXM2"),
        ("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada"),
        ("NVIDIA GeForce RTX 4070 Ti SUPER", "RTX 4070 Ti Super"),
        ("NVIDIA GH200 480GB", "GH200"),
        ("NVIDIA H200 NVL", "H200 NVL"),
    ],
)
def test_forgiving_names(name: str, canonical: str) -> None:
    assert find_gpu(name).name == canonical


def test_cuda_totals_are_below_marketing_size_and_sourced() -> None:
    for gpu in GPU_CATALOGUE:
        assert gpu.total_bytes < gpu.marketing_gb * 2**30, gpu.name
        assert gpu.total_gib > 0.9 * gpu.marketing_gb * 1e9 / 2**30 * 0.93, gpu.name
        assert gpu.source.startswith(("observed", "derived")), gpu.name
        assert gpu.device_name and gpu.compute_capability


def test_observed_totals_match_real_logs() -> None:
    assert find_gpu("H100 SXM").total_gib == pytest.approx(79.19, abs=0.005)
    assert find_gpu("RTX 3090").total_gib == pytest.approx(23.58, abs=0.005)
    assert (
        find_gpu("a100").device_name.lower().find("a100") >= 0
    )  # vLLM keys default tiers on "a100"


def test_every_catalogue_device_name_resolves_to_its_own_entry() -> None:
    # the name NVML reports for a catalogued product finds that product (shared device names,
    # e.g. "NVIDIA H20" for both H20 sizes or "Orin", resolve to one of them)
    for gpu in GPU_CATALOGUE:
        found = find_gpu(gpu.device_name)
        assert found.device_name == gpu.device_name, gpu.name


def test_a_variant_word_does_not_hide_another_product() -> None:
    with pytest.raises(UnknownGPU):
        find_gpu("NVIDIA RTX PRO 5000 Blackwell Server Edition")


def test_unknown_gpu_lists_close_names() -> None:
    with pytest.raises(UnknownGPU, match="closest: .*RTX 4090"):
        find_gpu("RTX 4099")


def test_custom_gpu_rejects_non_positive() -> None:
    assert custom_gpu(40.0).total_bytes == 40 * 2**30
    with pytest.raises(BadInput):
        custom_gpu(-1)


def test_detect_without_driver_is_clear_error() -> None:
    try:
        gpus = detect_gpus()
    except NoGPUDetected as exc:
        assert "--gpu" in exc.one_line()
        assert isinstance(exc, EnvironmentProblem)  # no driver: the machine, not the input
    else:  # a machine with a GPU: the numbers must be self-consistent
        for gpu in gpus:
            assert gpu.total_bytes >= gpu.free_bytes and gpu.spec.total_bytes > 0


@pytest.mark.parametrize(
    ("name", "canonical", "total_gib"),
    [
        ("Tesla V100-SXM2-32GB", "V100 32GB SXM2", 31.74),  # the log's total_gpu_memory
        ("v100 32gb", "V100 32GB SXM2", 31.74),
        ("v100", "V100 16GB SXM2", 15.77),
        ("Tesla V100-PCIE-16GB", "V100 16GB PCIe", 15.77),
        ("RTX 2060 12GB", "RTX 2060 12GB", 12.00),  # printed as 12.00GiB
    ],
)
def test_volta_and_turing_cards(name: str, canonical: str, total_gib: float) -> None:
    gpu = find_gpu(name)
    assert gpu.name == canonical
    assert round(gpu.total_gib, 2) == total_gib
    assert gpu.compute_capability in ("7.0", "7.5")


def test_plain_rtx_2060_is_not_taken_for_the_12gb_card() -> None:
    # the common RTX 2060 has 6 GB: the 12 GB entry must not answer for it
    with pytest.raises(UnknownGPU):
        find_gpu("RTX 2060")


@pytest.mark.parametrize(
    ("name", "nvlink"),
    [
        ("H100 SXM", True),
        ("H200", True),
        ("A100 40GB SXM", True),
        ("B200", True),
        ("V100 32GB SXM2", True),
        ("MI300X", True),
        ("H100 PCIe", False),
        ("A100 80GB PCIe", False),
        ("L4", False),
        ("L40S", False),
        ("A10G", False),
        ("T4", False),
        ("RTX 4090", False),
        ("RTX 5090", False),
        ("RTX 3090", False),
        ("V100 16GB PCIe", False),
    ],
)
def test_interconnect_fact(name: str, nvlink: bool) -> None:
    assert find_gpu(name).nvlink is nvlink


def test_user_given_total_is_priced_as_nvlink() -> None:
    # unknown interconnect: the conservative (larger non-torch) side
    assert custom_gpu(24.0).nvlink is True


@pytest.mark.parametrize(
    ("name", "canonical", "total_gib", "unified"),
    [
        ("NVIDIA RTX 2000 Ada Generation", "RTX 2000 Ada", 15.70, False),
        ("A40", "A40", 44.39, False),
        ("NVIDIA GB10", "GB10", 121.69, True),
        ("DGX Spark", "GB10", 121.69, True),
        ("Jetson AGX Thor", "Jetson AGX Thor", 121.69, True),
    ],
)
def test_new_cards_and_unified_memory_parts(
    name: str, canonical: str, total_gib: float, unified: bool
) -> None:
    spec = find_gpu(name)
    assert spec.name == canonical and spec.total_gib == pytest.approx(total_gib, abs=0.01)
    assert spec.unified_memory is unified
    assert spec.source.split(":")[0] in ("observed", "derived")


def test_gb10_keeps_the_small_batch_tier_from_0_33() -> None:
    from oomguard.memory.versions import batch_defaults, resolve_era

    gb10 = find_gpu("GB10")
    kw = {
        "platform": "cuda",
        "usage_context": "server",
        "device_total_bytes": gb10.total_bytes,
        "device_name": gb10.device_name,
        "compute_capability": gb10.compute_capability,
    }
    assert batch_defaults(resolve_era("0.33"), **kw).max_num_batched_tokens == 2048
    assert batch_defaults(resolve_era("0.32"), **kw).max_num_batched_tokens == 8192


def test_plan_on_unified_memory_says_what_competes_for_it() -> None:
    from oomguard.plan.service import plan

    result = plan("Qwen/Qwen3-8B", "GB10", allow_hub=False)
    note = next(n for n in result.notes if "shares its" in n)
    assert "page cache" in note and "--headroom-gib" in note
