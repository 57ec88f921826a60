"""vLLM releases as data: what each minor version does to the memory plan.

Every behaviour that changed between vLLM 0.10 and 0.33 and matters for the KV-cache budget is
one field of :class:`VllmEra`; :data:`ERAS` holds one row per minor release. Code elsewhere asks
the era (``era.requested_ceil``), never compares version numbers itself. Source: the published
vLLM wheels 0.10.0 … 0.33.0 as summarised in docs/memory-model.md (sections cited per
field).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from oomguard.errors import BadInput
from oomguard.units import GIB

OLDEST_MINOR = 10
NEWEST_MINOR = 33


@dataclass(frozen=True)
class VllmEra:
    """Memory-relevant behaviour of one vLLM minor release (V1 engine unless ``engine='v0'``)."""

    minor: int  # 0.<minor>
    label: str  # the version string as resolved, e.g. "0.19"
    engine: str = "v1"  # "v1" | "v0" (legacy engine, ≤0.10)
    default_gpu_memory_utilization: float = 0.9  # §3.1: 0.92 from 0.20
    tier_160gib: bool = False  # §3.2: ≥160 GiB tier (16384/1024) from 0.28
    # §3.2: GB10 (DGX Spark, compute capability 12.1) kept on the small tier despite its
    # unified 121 GiB (vllm 0.33 engine/arg_utils.py get_batch_defaults ``is_gb10``)
    gb10_small_tier: bool = False
    # §2.1: integrated GPUs read their free memory from the OS (psutil available, page cache
    # included) since 0.12; before, cudaMemGetInfo's free figure (page cache counted as used)
    uma_free_from_os: bool = True
    clamp_seqs_to_tokens: bool = False  # §3.2: max_num_seqs ≤ max_num_batched_tokens from 0.12
    performance_mode: bool = False  # §3.2: --performance-mode throughput from 0.17
    requested_ceil: bool = False  # §2.1: requested = ceil(total·util) from 0.14
    cudagraph_estimate_exists: bool = False  # §2.6: profile_cudagraph_memory from 0.18
    cudagraph_estimate_default: bool = False  # §2.6: applied by default from 0.20
    profiling_era: str = "A"  # §2.4: A ≤0.17, B 0.18–0.26, C 0.27+
    snapshot_before_nccl: bool = False  # §2.1: 0.10.x measures NCCL init inside non-torch
    sliding_bound: str = "batched"  # §4.3: "batched" ≤0.25, "in_flight" 0.26+
    tokens_formula: str = "blocks_per_group"  # §6: ≤0.20; "concurrency" int(B/n·L) from 0.21
    fit_check_null_block: bool = False  # §7.1: subtract one block from 0.29
    fit_check_groups: str = "layers"  # §7.1: "layers" ≤0.13, "global" 0.14–0.16, "worker" 0.17+
    format_gib: bool = False  # number formatting of logs/errors from 0.14
    kv_line_form: str = "two_lines"  # §6: "two_lines" ≤0.27, "combined" 0.28–0.29, "device" 0.30+
    fit_error_form: str = "v10"  # §7.2: "v10" ≤0.12, "v13", "v14" 0.14–0.21, "v22" 0.22+
    no_memory_error_form: str = "v10"  # §7.2: "v10" ≤0.12, "v13" 0.13–0.21, "v22" 0.22+
    free_memory_error_form: str = "v10"  # §2.1: "v10" ≤0.13, "v14" (device named) 0.14+
    auto_fit: bool = False  # §7.3: max_model_len -1 from 0.14
    auto_fit_log_form: str = "v14"  # §7.3: "v14" 0.14–0.31, "v32" 0.32+
    kv_cache_memory_bytes_flag: bool = True  # §2.5: from 0.10.2 (0.10 row: assume a late patch)
    uniform_type_groups: bool = False  # §5.1: one UniformType group for same-type layers from 0.11
    strided_grouping: bool = True  # §5.1: 0.10 contiguous slices
    group_rule_1_5: bool = False  # §5.1: group_size = max when max < 1.5·min, from 0.18
    hybrid_prefix_caching_default: bool = False  # §3.4: hybrid models default-on from 0.26
    mamba_cache_mode_all_default: bool = (
        False  # §3.4: 'all' for SupportsMambaPrefixCaching 0.26–0.27
    )
    mamba_align_16: bool = True  # §4.6: page-unification alignment 16 up to 0.19
    mamba_separate_dtypes: bool = True  # §4.6: 0.10.0 used one dtype for Mamba states
    new_kv_dtypes: bool = False  # §4.1: nvfp4, int8/fp8_per_token_head from 0.20
    int4_kv_dtype: bool = False  # §4.1: int4_per_token_head from 0.25
    # §2.3: the sampler warm-up's top-k/top-p implementation: "sort_or_flashinfer" (0.10–0.11:
    # FlashInfer when installed, else the full sort), "sort" (0.12–0.16: FlashInfer opt-in),
    # "triton" (0.17+: apply_top_k_top_p_triton for 8 rows or more). V0 always sorts.
    sampler_path: str = "sort"
    cpu_kv_budget: str = "util"  # §9: "space_4gib" ≤0.12, "half_numa" 0.13–0.19, "util" 0.20+
    cpu_block_size_128: bool = True  # §3.3: CPU 128 unconditionally from 0.12
    mla_block_blackwell: int = 128  # §3.3: CUTLASS MLA 0.11–0.14, FlashInfer MLA 64 from 0.15
    # §4.2: DeepSeek-V3.2 caches its latent in the 656-byte fp8_ds_mla layout by default up to
    # 0.13 (DeepseekV32ForCausalLM.verify_and_update_config: "auto" too); from 0.14 only when
    # an fp8 KV cache is asked for, else in the model dtype
    ds_mla_fp8_default: bool = False
    model_loading_form: str = "v14"  # §2.2: "v10" (%.4f GiB), "v12" (%.4f GiB memory), "v14"
    # V0 engine only: max_num_batched_tokens when chunked prefill is on and the user set none.
    # SchedulerConfig used 512 up to 0.6.4.post1 and 2048 from 0.6.5 (vllm PR #10544, merged
    # 2024-11-21: "Update default max_num_batch_tokens for chunked prefill to 2048").
    v0_chunked_prefill_tokens: int = 2048
    cpu_mla_block_16: bool = False  # §3.3: MLA models take 16-token blocks on CPU from 0.28
    hopper_mla_block: int = 16  # §3.3: FlashMLA (64) up to 0.17, FlashAttention-MLA (16) after
    # §3.4: Mamba prefix caching when enabled explicitly: "all" (per block) 0.12–0.14, "align"
    mamba_prefix_mode: str = "align"
    refuses_removed_architectures: bool = True  # V1 refuses V0-only architectures after 0.10
    cpu_hybrid_kv_manager: bool = True  # §5.1: 0.10's CPU backend disables the hybrid manager
    non_torch_form: str = "late"  # §2.4: "v1" snapshot growth 0.11–0.17, "late" 0.18+
    rocm_cudagraph_profiled: bool = True  # §2.6: ROCm graph memory subtracted from 0.26
    mxfp4_pad_intermediate: bool = True  # §8: mxfp4 MoE intermediate rounded to 128 from 0.13
    full_attention_page_padding: bool = False  # §5.1: attention pages padded to Mamba's, 0.30+
    # §4.6: Mamba variants whose layers keep one prefill checkpoint block per request in align
    # mode (MambaSpec.num_prefill_checkpoint_blocks, set by MambaMixer2.get_kv_cache_spec in
    # model_executor/layers/mamba/mamba_mixer2.py): Mamba2 from 0.32; none before (0.31 has no
    # such field in v1/kv_cache_interface.py)
    mamba_checkpoint_variants: frozenset[str] = frozenset()
    # §14.1: DCP enters the per-request block count (0.21+); before, the "KV cache size" line
    # was multiplied by the CP sizes: "dcp" (0.10–0.11) or "pcp_dcp" (0.12–0.20)
    cp_in_spec: bool = True
    cp_log_factor: str = "dcp"
    # §14.5: FULL CUDA graphs on a Mamba model refuse max_num_seqs above num_blocks (vllm
    # config/compilation.py, the fix for vllm issue #34094; present in 0.32, taken from 0.17)
    mamba_seqs_check: bool = True

    @property
    def version(self) -> str:
        """The version as ``0.N`` (minor granularity: patch releases share their minor's row)."""
        return self.label


def _era_for_minor(minor: int) -> VllmEra:
    """Build the era row for 0.<minor> from the change log (docs/memory-model.md §0)."""
    m = minor
    return VllmEra(
        minor=m,
        label=f"0.{m}",
        default_gpu_memory_utilization=0.92 if m >= 20 else 0.9,
        tier_160gib=m >= 28,
        gb10_small_tier=m >= 33,
        uma_free_from_os=m >= 12,
        clamp_seqs_to_tokens=m >= 12,
        performance_mode=m >= 17,
        requested_ceil=m >= 14,
        cudagraph_estimate_exists=m >= 18,
        cudagraph_estimate_default=m >= 20,
        profiling_era="A" if m <= 17 else ("B" if m <= 26 else "C"),
        snapshot_before_nccl=m <= 10,
        sliding_bound="batched" if m <= 25 else "in_flight",
        tokens_formula="blocks_per_group" if m <= 20 else "concurrency",
        fit_check_null_block=m >= 29,
        fit_check_groups="layers" if m <= 13 else ("global" if m <= 16 else "worker"),
        format_gib=m >= 14,
        kv_line_form="two_lines" if m <= 27 else ("combined" if m <= 29 else "device"),
        fit_error_form="v10" if m <= 12 else ("v13" if m == 13 else ("v14" if m <= 21 else "v22")),
        no_memory_error_form="v10" if m <= 12 else ("v13" if m <= 21 else "v22"),
        free_memory_error_form="v10" if m <= 13 else "v14",
        auto_fit=m >= 14,
        auto_fit_log_form="v14" if m <= 31 else "v32",
        uniform_type_groups=m >= 11,
        strided_grouping=m >= 11,
        group_rule_1_5=m >= 18,
        hybrid_prefix_caching_default=m >= 26,
        mamba_cache_mode_all_default=26 <= m <= 27,
        mamba_align_16=m <= 19,
        mamba_separate_dtypes=True,
        new_kv_dtypes=m >= 20,
        int4_kv_dtype=m >= 25,
        # v1/sample/ops/topk_topp_sampler.py of each wheel: FlashInfer used when importable up
        # to 0.11 (``VLLM_USE_FLASHINFER_SAMPLER is not False``), opt-in from 0.12; the Triton
        # kernel (``apply_top_k_top_p_triton``) first ships in 0.17.
        sampler_path="sort_or_flashinfer" if m <= 11 else ("sort" if m <= 16 else "triton"),
        cpu_kv_budget="space_4gib" if m <= 12 else ("half_numa" if m <= 19 else "util"),
        cpu_block_size_128=m >= 12,
        mla_block_blackwell=128 if m <= 14 else 64,
        ds_mla_fp8_default=m <= 13,
        model_loading_form="v10" if m <= 11 else ("v12" if m <= 13 else "v14"),
        cp_in_spec=m >= 21,
        cp_log_factor="dcp" if m <= 11 else "pcp_dcp",
        mamba_seqs_check=m >= 17,
        cpu_mla_block_16=m >= 28,
        hopper_mla_block=64 if m <= 17 else 16,
        mamba_prefix_mode="all" if m < 15 else "align",
        refuses_removed_architectures=m > 10,
        cpu_hybrid_kv_manager=m != 10,
        non_torch_form="v1" if m <= 17 else "late",
        rocm_cudagraph_profiled=m >= 26,
        mxfp4_pad_intermediate=m >= 13,
        full_attention_page_padding=m >= 30,
        mamba_checkpoint_variants=frozenset({"mamba2"}) if m >= 32 else frozenset(),
    )


ERAS: dict[int, VllmEra] = {m: _era_for_minor(m) for m in range(OLDEST_MINOR, NEWEST_MINOR + 1)}
"""One row per supported minor release, 0.10 … 0.33."""

LATEST: VllmEra = ERAS[NEWEST_MINOR]

_VERSION_RE = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?(?:[.\w+-]*)$")


def parse_version(text: str) -> tuple[int, int, int]:
    """Parse ``0.11.2``, ``v0.19.0``, ``0.20.1rc1.dev16+g7a1eb8ac2`` into (major, minor, patch).

    Raises :class:`BadInput` for anything that is not a version number.
    """
    cleaned = text.strip()
    match = _VERSION_RE.match(cleaned)
    if not match:
        raise BadInput(
            f"vLLM version {text!r} is not a version number",
            "pass a release such as 0.19.0, v0.11.2 or 'latest'",
        )
    major, minor, patch = match.group(1), match.group(2), match.group(3)
    return int(major), int(minor), int(patch or 0)


def resolve_era(version: str | None, engine: str = "v1") -> VllmEra:
    """The era row for a vLLM version string (``None``/``"latest"`` → newest).

    ``engine="v0"`` selects the legacy engine's accounting (vLLM ≤ 0.10, where ``VLLM_USE_V1=0``
    still existed); older 0.x releases are accepted only with the V0 engine. Unknown or
    malformed versions raise :class:`BadInput`.
    """
    if engine not in ("v1", "v0"):
        raise BadInput(f"engine {engine!r} is not a vLLM engine", "use 'v1' (default) or 'v0'")
    if version is None or version.strip().lower() in ("latest", "", "newest"):
        if engine == "v0":
            return replace(ERAS[OLDEST_MINOR], engine="v0", label="0.10")
        return LATEST
    major, minor, _patch = parse_version(version)
    if major != 0:
        raise BadInput(
            f"vLLM version {version!r} is unknown (this release knows "
            f"0.{OLDEST_MINOR} … 0.{NEWEST_MINOR})",
            "pass a version in that range or 'latest'",
        )
    if engine == "v0":
        if minor > OLDEST_MINOR:
            raise BadInput(
                f"vLLM {version} has no V0 engine (removed in 0.11)",
                "drop the V0 engine setting or pass a version ≤ 0.10",
            )
        return replace(
            ERAS[OLDEST_MINOR],
            engine="v0",
            label=f"0.{minor}",
            v0_chunked_prefill_tokens=v0_chunked_prefill_tokens(minor, _patch),
        )
    if minor < OLDEST_MINOR or minor > NEWEST_MINOR:
        raise BadInput(
            f"vLLM version {version!r} is outside the supported range "
            f"0.{OLDEST_MINOR} … 0.{NEWEST_MINOR}",
            "pass a version in that range or 'latest'",
        )
    return ERAS[minor]


def v0_chunked_prefill_tokens(minor: int, patch: int) -> int:
    """V0 SchedulerConfig's default ``max_num_batched_tokens`` with chunked prefill on.

    512 through 0.6.4.post1, 2048 from 0.6.5 (vllm PR #10544); V0 releases only (≤ 0.10).
    """
    return 512 if (minor, patch) < (6, 5) else 2048


@dataclass(frozen=True)
class BatchDefaults:
    """Default scheduler limits vLLM picks when the user sets none (§3.2)."""

    max_num_batched_tokens: int
    max_num_seqs: int
    tier: str  # which row of the table applied


def batch_defaults(
    era: VllmEra,
    *,
    platform: str,
    usage_context: str,
    device_total_bytes: int,
    device_name: str,
    world_size: int = 1,
    compute_capability: str = "",
) -> BatchDefaults:
    """Default ``max_num_batched_tokens`` / ``max_num_seqs`` by GPU memory, name and context.

    ``usage_context`` is "server" (``vllm serve``), "llm" (``LLM(...)``) or "other" (engine used
    directly: SchedulerConfig defaults 2048/128). ``world_size`` = TP × PP (CPU rows scale by it).
    ``compute_capability`` "12.1" is the GB10, which 0.33 keeps on the small tier.
    """
    if usage_context not in ("server", "llm", "other"):
        raise BadInput(
            f"usage context {usage_context!r} is unknown",
            "use 'server' (vllm serve) or 'llm' (LLM(...))",
        )
    if usage_context == "other":
        return BatchDefaults(2048, 128, "scheduler")
    server = usage_context == "server"
    if platform == "cpu":
        if server:
            return BatchDefaults(2048 * world_size, 128 * world_size, "cpu")
        return BatchDefaults(4096 * world_size, 256 * world_size, "cpu")
    memory_gib = device_total_bytes / GIB
    name = device_name.lower()
    if era.tier_160gib and memory_gib >= 160:
        return BatchDefaults(16384, 1024, ">=160GiB")
    gb10 = era.gb10_small_tier and compute_capability == "12.1"
    if memory_gib >= 70 and "a100" not in name and not gb10:
        return BatchDefaults(8192 if server else 16384, 1024, ">=70GiB")
    return BatchDefaults(2048 if server else 8192, 256, "default")
