"""Estimated terms of vLLM's budget: activation peak, non-torch growth, CUDA-graph estimate.

These are runtime measurements inside vLLM (§2.3–2.6). Each is modelled from what vLLM's own
code allocates in the version at hand, and carries a range: the band its out-of-sample errors
on real startup logs of the same era showed (``oomguard.memory.bands``, derived by
``bench/planner_accuracy.py --bands``). Section numbers refer to docs/memory-model.md;
"observed" figures cite the startup-log data sets (``shared/data/vllm-startup-logs.jsonl``
as *dev*, ``bench/data/startup-logs-holdout.jsonl`` as *holdout*).

The three mechanisms:

* **Activation peak** (§2.3): the profile run executes one batch of ``T =
  max_num_batched_tokens`` tokens over ``R = min(max_num_seqs, T)`` requests, then the sampler
  on ``R`` rows of logits. The peak is the larger of the forward pass and the sampler, plus
  buffers kept across both (fused-MoE workspace, encoder outputs). The sampler's bytes per
  logit are counted from the tensors its implementation holds at its peak; which
  implementation runs is a fact of the release (``VllmEra.sampler_path``).
* **Non-torch growth** (§2.1, §2.4): what the device lost outside PyTorch's allocator between
  the init snapshot and the end of profiling. Up to 0.10 the snapshot precedes NCCL's
  communicator set-up, so it includes NCCL's buffers; from 0.11 it follows it, and only
  buffers NCCL creates lazily at the first large collective count. vLLM up to 0.10 forced
  ``NCCL_CUMEM_ENABLE=0`` (``env_override.py``), which rules out NVLink SHARP (NVLS); from 0.11
  it no longer does, so on NVSwitch Hopper/Blackwell systems NCCL's NVLS buffers appear too.
* **CUDA-graph estimate** (§2.6, subtracted from 0.20): vLLM captures the first two capture
  sizes and extrapolates ``first + second × (n − 1)``; here a pool part plus a per-layer part
  per captured size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from oomguard.memory.bands import (
    SHIPPED_BANDS,
    TermBands,
    activation_group,
    graph_group,
    non_torch_group,
)
from oomguard.memory.compilation import GraphSettings, capture_sizes
from oomguard.memory.spec import ModelSpec
from oomguard.memory.versions import VllmEra
from oomguard.units import GIB

FP32_BYTES = 4
INT64_BYTES = 8

# --------------------------------------------------------------------------------------------
# The sampler (§2.3): bytes held per logit [R, V] at its peak, by implementation.
#
# Every path starts from the model-dtype logits ``compute_logits`` returns (still referenced by
# the caller) and the fp32 copy ``Sampler.forward`` makes (``logits.to(torch.float32)``).
# * "sort" — ``apply_top_k_top_p_pytorch`` (V0's ``_apply_top_k_top_p`` is the same): a full
#   ``logits.sort(dim=-1)`` returns fp32 values and int64 indices; while it runs, torch's
#   segmented sort holds an int64 iota of the input positions and CUB's double buffers for
#   keys and values. 2 + 4 + (4 + 8) + 8 + (4 + 8) = 38 B in bf16; the logs show 38.4–38.6 B
#   (dev rows 5, 9–12 on 0.11; V0 rows 59, 61; holdout 14).
# * "triton" — ``apply_top_k_top_p_triton`` (0.17+, for R ≥ 8) works in place; then
#   ``random_sample`` holds the softmax probabilities and the exponential noise: 2 + 4 + 4 + 4 =
#   14 B, plus a per-SM scratch row of V fp32 values. The 0.19 logs show 14.5–15.4 B.
# * "flashinfer" — ``top_k_top_p_sampling_from_logits`` (0.10–0.11 when flashinfer is
#   installed): a masked copy and its softmax, 2 + 4 + 4 + 4 = 14 B.
SORT_TEMPORARY_BYTES = (FP32_BYTES + INT64_BYTES) + INT64_BYTES + (FP32_BYTES + INT64_BYTES)
KERNEL_TEMPORARY_BYTES = FP32_BYTES + FP32_BYTES
TRITON_SCRATCH_ROWS = 132  # one row per SM program (H100 SXM: 132 SMs; capped at R)
TRITON_MIN_ROWS = 8  # apply_top_k_top_p uses the Triton kernel only for R >= 8
# The forward pass at T tokens holds, per token, the MLP's gate/up output (2·I) and its
# SiluAndMul output (I) together, plus three hidden-sized tensors (residual, normed input,
# output), in model dtype: 3·I + 3·h. That is the eager V0 engine; observed 2.07 GiB for
# Llama-3.1-8B at T = 20,000 (2.06 computed, dev row 0), 0.74 for Qwen3-4B at 10,000 (0.69,
# holdout 13), 2.02 for Qwen2.5-1.5B at 32,768 (1.92, holdout 15). The V1 engine runs the
# profile through torch.compile's graph, which keeps one more intermediate-sized buffer alive
# across the MLP: 4·I + 3·h, observed 1.05–1.10 GiB on first pipeline stages that run no sampler
# (Llama-3.1-8B at 8,192, dev rows 36 and 37; 1.06 computed).
FORWARD_INTERMEDIATE_FACTOR = 4.0
FORWARD_INTERMEDIATE_FACTOR_EAGER_V0 = 3.0
FORWARD_HIDDEN_FACTOR = 3.0

# --------------------------------------------------------------------------------------------
# Non-torch growth (§2.4), GiB, by snapshot era, parallelism and interconnect (the bands are in
# ``oomguard.memory.bands``, by snapshot era and TP).
#
# eras: "v0" — the V0 engine and V1 0.10, whose snapshot precedes NCCL's set-up (its whole
#       communicator and vLLM's custom all-reduce buffers count); "v1" 0.11–0.17 and "late"
#       0.18+, whose snapshot follows it (only NCCL's lazily created buffers count).
# links: "pcie" — no NVLink; "nvlink" — NVLink without NVLS (pre-Hopper SXM, NVL bridges,
#       AMD xGMI, and every V0/0.10 system since cuMem, which NVLS needs, was off); "nvls" —
#       NVSwitch Hopper/Blackwell (H100/H200/H20/H800 SXM, B200) from 0.11.
# One NCCL communicator's ring/tree buffers on NVLink take 0.53 GiB for 2 ranks and 0.67 GiB
# for more (NVIDIA/nccl#964); NVLS initialisation is the known large one (NeMo-Framework-
# Launcher#127 and JAX-Toolbox#383 turn it off "for memory saving").
NON_TORCH_GIB: dict[tuple[str, str], float] = {
    # V0 / 0.10, one GPU: cuBLAS and attention workspaces. Observed 0.01–0.35 (11 V0 logs).
    ("v0", "single"): 0.10,
    # V0 / 0.10 with TP over NVLink: the communicators themselves. Observed 2.10 (A100 TP 8,
    # dev 60), 5.21–5.68 (H200 TP 8, holdout 9), 1.79 (H100 TP 2 over its TP 1 run, vllm#10511).
    ("v0", "nvlink"): 2.0,
    ("v0", "nvls"): 2.0,
    # V0 / 0.10 with TP over PCIe: observed 0.25 (RTX 4090 TP 2, holdout 7): without P2P, NCCL's
    # shared-memory transport stages through host memory and keeps few device buffers.
    ("v0", "pcie"): 0.25,
    ("v0", "pp"): 0.20,
    # 0.11–0.17, one GPU: observed 0.13–0.14 (0.11, dev 5, 6, 8–11, 13).
    ("v1", "single"): 0.13,
    # 0.11–0.17, TP: one communicator's lazily connected buffers. Observed 0.54–0.55 (H100 TP 2,
    # dev 7, 12). NVSwitch systems may add NVLS (as 0.18+ shows).
    ("v1", "pcie"): 0.25,
    ("v1", "nvlink"): 0.55,
    ("v1", "nvls"): 0.55,
    ("v1", "pp"): 0.07,
    # 0.18+, one GPU: observed 0.24–0.27 in 33 logs, 0.46 in two (0.19, dev 17–58).
    ("late", "single"): 0.25,
    # 0.18+ TP over PCIe: not logged in the development set (holdout 22, L4 TP 2 without P2P on
    # 0.28, implies about 0.2 once graphs and activations are taken out); as 0.11–0.17.
    ("late", "pcie"): 0.25,
    ("late", "nvlink"): 0.55,
    # 0.18+ on NVSwitch Hopper: observed 2.07–2.10 at TP 2, 2.13–2.21 at TP 4 (0.19 H100 HBM3,
    # dev 19, 20, 38, 39, 41, 45, 46, 49, 52, 54, 58): ring buffers plus NVLS (machines where
    # NVLS stays off, NCCL_NVLS_ENABLE=0 or NCCL_CUMEM_ENABLE=0, keep about a quarter of it).
    ("late", "nvls"): 2.08,
    # pipeline stages only: point-to-point send/receive buffers. Observed 0.07 (dev 36, 37).
    ("late", "pp"): 0.07,
}
NVLS_PER_EXTRA_RANK_GIB = 0.035  # 0.19: +0.035 GiB per rank beyond 2 (TP 4 vs TP 2 logs)

# --------------------------------------------------------------------------------------------
# CUDA-graph estimate (§2.6), applied from 0.20: a pool part, a per-layer part per captured
# size (51 sizes up to 512 by default) and a fused-MoE part. Fitted on the 37 "Estimated CUDA
# graph memory" lines of the 0.19 logs (printed there, applied from 0.20); with TP the
# profiling also captures NCCL's first buffers (0.84 vs 1.69 GiB for the same model at TP 2).
GRAPH_BASE_GIB = 0.33
GRAPH_PER_LAYER_GIB = 0.016
GRAPH_MOE_GIB = 0.35
GRAPH_REFERENCE_CAPTURES = 51


@dataclass(frozen=True)
class Coefficients:
    """The few fitted constants of the estimated terms and their bands, as one replaceable value.

    The sampler's bytes are counted from vLLM's code and not listed here; the forward factors,
    the non-torch table and the graph estimate come from logs (see the module constants), the
    bands from out-of-sample errors (``oomguard.memory.bands``). A caller that refits them (the
    accuracy bench's leave-one-source-out view) passes its own.
    """

    forward_intermediate_factor: float = FORWARD_INTERMEDIATE_FACTOR
    forward_hidden_factor: float = FORWARD_HIDDEN_FACTOR
    non_torch_gib: dict[tuple[str, str], float] = field(
        default_factory=lambda: dict(NON_TORCH_GIB), hash=False
    )
    graph_base_gib: float = GRAPH_BASE_GIB
    graph_per_layer_gib: float = GRAPH_PER_LAYER_GIB
    graph_moe_gib: float = GRAPH_MOE_GIB
    bands: TermBands = field(default=SHIPPED_BANDS, hash=False)


DEFAULT_COEFFICIENTS = Coefficients()


@dataclass(frozen=True)
class Estimate:
    """A byte count with its range; ``estimated`` is False when it was measured or exact."""

    value_bytes: int
    low_bytes: int
    high_bytes: int
    basis: str
    estimated: bool = True

    @property
    def gib(self) -> float:
        return self.value_bytes / GIB

    @staticmethod
    def measured(value_bytes: int, source: str) -> Estimate:
        """An observed number (calibration store or parsed log)."""
        return Estimate(value_bytes, value_bytes, value_bytes, f"measured ({source})", False)

    @staticmethod
    def exact(value_bytes: int, basis: str) -> Estimate:
        return Estimate(value_bytes, value_bytes, value_bytes, basis, False)


def padded_vocab(vocab_size: int) -> int:
    """Vocabulary rows after vLLM's padding to a multiple of 64."""
    return -(-vocab_size // 64) * 64


# --------------------------------------------------------------------------------------------
# activation peak


def moe_workspace_bytes(
    model: ModelSpec, tokens: int, tp: int, dtype_bytes: int, ep: int = 1
) -> int:
    """Fused-MoE intermediate caches for ``tokens`` tokens (kept allocated across the profile).

    ``[T, top_k, 2·I] + [T·top_k, I] + [T, top_k, h]`` in model dtype, I per rank. mxfp4 MoE
    backends allocate per call and release before the sampler runs, so they add nothing.
    """
    moe = model.moe
    if moe is None or (model.quant.method or "").lower() == "mxfp4":
        return 0
    inter = moe.expert_intermediate_size // (1 if ep > 1 else tp)
    return tokens * moe.experts_per_token * (3 * inter + model.hidden_size) * dtype_bytes


def forward_peak_bytes(
    model: ModelSpec,
    tokens: int,
    tp: int,
    dtype_bytes: int,
    coef: Coefficients = DEFAULT_COEFFICIENTS,
    engine: str = "v1",
) -> int:
    """Transient peak of one forward pass at ``tokens`` tokens (dense MLP or shared experts).

    ``engine`` "v0" prices the eager V0 engine (one intermediate-sized buffer fewer).
    """
    inter = model.intermediate_size
    if model.moe is not None and model.moe.shared_expert_intermediate_size:
        inter = max(inter, model.moe.shared_expert_intermediate_size)
    factor = coef.forward_intermediate_factor
    if engine == "v0":
        factor -= FORWARD_INTERMEDIATE_FACTOR - FORWARD_INTERMEDIATE_FACTOR_EAGER_V0
    per_token = factor * inter / tp + coef.forward_hidden_factor * model.hidden_size
    return int(tokens * per_token * dtype_bytes)


def sampler_bytes_per_logit(path: str, dtype_bytes: int) -> float:
    """Bytes the sampler holds per logit at its peak for implementation ``path`` (see above)."""
    held = dtype_bytes + FP32_BYTES  # model-dtype logits and the sampler's fp32 copy
    if path == "sort":
        return held + SORT_TEMPORARY_BYTES
    return held + KERNEL_TEMPORARY_BYTES


def sampler_path_for(era: VllmEra, requests: int) -> tuple[str, str | None]:
    """(implementation the sampler warm-up runs, the other one it may run instead or None).

    0.10–0.11 use FlashInfer's sampler when flashinfer is installed (the images that bundle it)
    and the full sort otherwise; 0.12–0.16 the sort (FlashInfer opt-in); 0.17+ the Triton kernel
    from 8 rows. The V0 engine always sorts.
    """
    path = "sort" if era.engine == "v0" else era.sampler_path
    if path == "sort_or_flashinfer":
        return "sort", "flashinfer"
    if path == "triton" and requests < TRITON_MIN_ROWS:
        return "sort", None
    return path, None


def sampler_peak_bytes(
    model: ModelSpec, requests: int, era: VllmEra, dtype_bytes: int, tokens: int = 0
) -> tuple[int, int, int, str]:
    """Sampler warm-up on ``requests`` rows: (value, low, high, implementation).

    Adds the profile batch's hidden states ``[T, h]``, still referenced while the sampler runs.
    ``low``–``high`` spans the implementations the release may run (equal to the value where
    only one can); the error band is added by :func:`activation_peak`.
    """
    vocab = padded_vocab(model.vocab_size)
    logits = requests * vocab
    path, alternative = sampler_path_for(era, requests)
    kept = tokens * model.hidden_size * dtype_bytes

    def cost(which: str) -> float:
        extra = 0
        if which == "triton":
            extra = min(TRITON_SCRATCH_ROWS, requests) * vocab * FP32_BYTES
        return logits * sampler_bytes_per_logit(which, dtype_bytes) + extra + kept

    value = cost(path)
    low = high = value
    if alternative is not None:
        other = cost(alternative)
        low, high = min(value, other), max(value, other)
        path = f"{path} (or {alternative})"
    return int(value), int(low), int(high), path


def encoder_cache_bytes(
    model: ModelSpec, max_num_batched_tokens: int, dtype_bytes: int, tokens: int | None = None
) -> int:
    """Multimodal encoder outputs kept during the profile (§2.3): ``tokens`` encoder output
    tokens (``oomguard.memory.multimodal.encoder_profile``) × text hidden size; without
    ``tokens``, the whole budget."""
    if model.vision is None:
        return 0
    if tokens is None:
        tokens = max(max_num_batched_tokens, model.vision.max_tokens_per_item)
    return tokens * model.hidden_size * dtype_bytes


def activation_peak(
    model: ModelSpec,
    *,
    era: VllmEra,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    tp: int,
    dtype_bytes: int,
    has_sampler: bool = True,
    ep: int = 1,
    dp: int = 1,
    coef: Coefficients = DEFAULT_COEFFICIENTS,
    encoder_tokens: int | None = None,
) -> Estimate:
    """Torch peak increase of the profile run on one rank (§2.3): ``max(forward, sampler) + kept``.

    ``has_sampler`` is False for pipeline stages other than the last (no logits there). Kept
    buffers (fused-MoE workspace, encoder cache) add to whichever phase peaks. The range spans
    what the mechanism leaves open — which sampler the release runs, and with expert parallelism
    over ``dp`` > 1 data-parallel ranks a MoE workspace at ``T × dp`` (the default all-gather
    dispatch can hand a rank every rank's tokens) — widened by the era's relative error band.
    """
    t = max_num_batched_tokens
    r = min(max_num_seqs, t)
    forward = forward_peak_bytes(model, t, tp, dtype_bytes, coef, era.engine)
    if has_sampler:
        sampler, s_low, s_high, path = sampler_peak_bytes(model, r, era, dtype_bytes, t)
    else:
        sampler, s_low, s_high, path = 0, 0, 0, "none (not the last pipeline stage)"
    moe_kept = moe_workspace_bytes(model, t, tp, dtype_bytes, ep)
    kept = moe_kept + encoder_cache_bytes(model, t, dtype_bytes, encoder_tokens)
    k_high = kept
    if ep > 1 and dp > 1 and moe_kept:
        k_high += moe_workspace_bytes(model, min(t * dp, 32768), tp, dtype_bytes, ep) - moe_kept
    value = max(forward, sampler) + kept
    group = activation_group(era.engine, era.sampler_path, model.vision is not None)
    low, high = coef.bands.activation[group].around_relative(
        max(forward, s_low) + kept, max(forward, s_high) + k_high
    )
    phase = "sampler" if sampler >= forward else "forward"
    per_logit = sampler_bytes_per_logit(path.split()[0], dtype_bytes) if has_sampler else 0.0
    basis = f"estimate: {phase} peak at T={t}, R={r} ({path} sampler, {per_logit:.0f} B/logit)"
    if kept:
        basis += f" + {kept / GIB:.2f} GiB kept buffers"
    return Estimate(int(value), max(0, int(low)), int(high), basis)


# --------------------------------------------------------------------------------------------
# non-torch growth


def non_torch_era(era: VllmEra) -> str:
    """Which snapshot era sizes the non-torch term: "v0", "v1" (0.11–0.17) or "late" (0.18+)."""
    if era.engine == "v0" or era.snapshot_before_nccl:
        return "v0"
    return era.non_torch_form


def link_kind(nvlink: bool, nvls: bool) -> str:
    """The interconnect class of a GPU for NCCL's buffers: "pcie", "nvlink" or "nvls"."""
    if nvls:
        return "nvls"
    return "nvlink" if nvlink else "pcie"


def non_torch_cell(
    era: VllmEra, *, tp: int, pp: int, nvlink: bool = True, nvls: bool = False
) -> tuple[str, str]:
    """The row of :data:`NON_TORCH_GIB` that sizes a rank: (snapshot era, kind)."""
    group = non_torch_era(era)
    if tp > 1:
        return group, link_kind(nvlink, nvls and group != "v0")
    return group, "pp" if pp > 1 else "single"


def non_torch(
    era: VllmEra,
    *,
    tp: int,
    pp: int,
    platform: str = "cuda",
    nvlink: bool = True,
    nvls: bool = False,
    coef: Coefficients = DEFAULT_COEFFICIENTS,
) -> Estimate:
    """Non-torch memory growth measured by the profile (workspaces, NCCL buffers) (§2.4).

    ``nvlink`` / ``nvls`` describe the GPU's interconnect (:class:`GPUSpec`); NVLS needs vLLM
    0.11+ (cuMem on) and an NVSwitch Hopper/Blackwell system.
    """
    if platform == "cpu":
        return Estimate.exact(0, "CPU backend: no device profiling")
    group, kind = non_torch_cell(era, tp=tp, pp=pp, nvlink=nvlink, nvls=nvls)
    table = coef.non_torch_gib
    value = table.get((group, kind), table[(group, "single")])
    if kind == "nvls" and group == "late" and tp > 2:
        value += NVLS_PER_EXTRA_RANK_GIB * (tp - 2)
    low, high = coef.bands.non_torch_gib[non_torch_group(group, tp)].around(value)
    what = {
        "single": "one GPU: library workspaces",
        "pp": "pipeline stages: send/receive buffers",
        "pcie": "TP over PCIe: NCCL ring buffers",
        "nvlink": "TP over NVLink: NCCL buffers",
        "nvls": "TP over NVSwitch: NCCL buffers incl. NVLS",
    }[kind]
    if group == "v0":
        what += " (measured from before NCCL's set-up in this version)"
    return Estimate(
        int(value * GIB), int(low * GIB), int(high * GIB), f"estimate: non-torch growth, {what}"
    )


# --------------------------------------------------------------------------------------------
# CUDA graphs


def cudagraph_estimate(
    model: ModelSpec,
    era: VllmEra,
    *,
    stage_layers: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    enforce_eager: bool,
    platform: str = "cuda",
    compute_capability: str = "",
    tp: int = 1,
    coef: Coefficients = DEFAULT_COEFFICIENTS,
    graph_variants: int = 1,
    graphs: GraphSettings = GraphSettings(),
    estimate_applied: bool | None = None,
    capture_count: int | None = None,
) -> Estimate:
    """The CUDA-graph memory vLLM subtracts from the KV budget (0.20+ by default; §2.6).

    Zero with ``enforce_eager`` or ``cudagraph_mode`` NONE, on CPU, and where the estimate is
    not applied: before 0.18, in 0.18–0.19 unless ``estimate_applied``
    (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1``), and from 0.20 when it is set to 0 (the
    graphs then come out of the (1 − util) slack). The count of captured sizes follows
    ``graphs`` (``--compilation-config`` and the capture-size flags) unless ``capture_count``
    replaces it (speculative decoding's default sizes add its uniform-decode sizes);
    ``graph_variants`` graphs are captured per size (2 with LoRA: with and without adapters,
    vllm 0.32 ``v1/cudagraph_dispatcher.py``).
    """
    if enforce_eager:
        return Estimate.exact(0, "enforce_eager: no CUDA graphs")
    if platform == "cpu":
        return Estimate.exact(0, "CPU backend: no CUDA graphs")
    if not graphs.captures:
        return Estimate.exact(0, "cudagraph_mode NONE: no CUDA graphs")
    applied = era.cudagraph_estimate_default if estimate_applied is None else estimate_applied
    if estimate_applied is False and era.cudagraph_estimate_exists:
        return Estimate.exact(
            0, "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0: not subtracted (the 1 − util slack)"
        )
    if era.engine == "v0" or not era.cudagraph_estimate_exists or not applied:
        return Estimate.exact(
            0, f"not subtracted in vLLM {era.label} (graph memory comes from the 1 − util slack)"
        )
    if platform == "rocm" and not era.rocm_cudagraph_profiled:
        return Estimate.exact(0, f"not profiled on ROCm in vLLM {era.label}")
    if capture_count is None:
        capture_count = len(
            capture_sizes(graphs, max_num_seqs, max_num_batched_tokens, compute_capability)
        )
    n = capture_count * graph_variants
    gib = (
        coef.graph_base_gib + coef.graph_per_layer_gib * stage_layers * n / GRAPH_REFERENCE_CAPTURES
    )
    if model.moe is not None:
        gib += coef.graph_moe_gib
    low, high = coef.bands.graph_gib[graph_group(tp)].around(gib)
    return Estimate(
        int(gib * GIB),
        int(low * GIB),
        int(high * GIB),
        f"estimate: {n} captured sizes × {stage_layers} layers",
    )
