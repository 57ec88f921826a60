"""Estimated terms of vLLM's budget: activation peak, non-torch growth, CUDA-graph estimate.

These are runtime measurements in vLLM (§2.3–2.6); here they are mechanisms with coefficients
calibrated on published startup logs (the project's vllm-startup-logs data set: vLLM 0.11 and
0.19 on H100, V0 logs on L40S/T4/3090). Each function returns an :class:`Estimate` with a range
and the basis of the number, so callers can show that it is an estimate and replace it with an
observation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from oomguard.memory.spec import ModelSpec
from oomguard.memory.versions import VllmEra

GIB = 2**30
MIB = 2**20

# Sampler dummy run (§2.3): bytes per logit element [R, V]. Full-sort PyTorch top-k/top-p keeps
# logits (model dtype + fp32), sorted fp32 values, int64 indices, softmax/cumsum and masks;
# calibrated 38.5 B on vLLM 0.11 logs (Llama-3.1-8B 4.76 GiB, gpt-oss-20b 7.38 GiB, Qwen3 5.56 GiB
# at R=1024) and V0 logs (Qwen2.5-Math-1.5B 1.40 GiB at R=256). The Triton kernel path keeps
# logits and probabilities only: 15 B (vLLM 0.19: 1.89 GiB Llama-3.1-8B, 3.62–3.99 GiB Gemma).
SAMPLER_BYTES_PER_LOGIT = {"pytorch": 38.5, "triton": 15.0}
# Forward pass at T tokens (§2.3), per token: gate/up output + activation (≈4 × I) and a few
# hidden-size tensors (≈3 × h), in model dtype. Calibrated on PP first-stage peaks (no sampler,
# 1.05–1.10 GiB for Llama-3.1-8B at T=8192) and small-vocabulary models (CodeLlama, phi-2).
FORWARD_INTERMEDIATE_FACTOR = 4.0
FORWARD_HIDDEN_FACTOR = 3.0
# Non-torch growth during profiling (§2.4), GiB, by (era group, parallel kind).
NON_TORCH_GIB = {
    ("v0", "single"): 0.10,
    ("v0", "tp"): 2.0,
    ("early", "single"): 0.13,  # 0.10–0.17: 0.13–0.14 GiB TP=1, 0.54–0.55 GiB TP=2 (0.11 logs)
    ("early", "tp"): 0.55,
    ("early", "pp"): 0.07,
    ("late", "single"): 0.25,  # 0.18+: 0.24–0.27 TP=1, 2.07–2.21 TP≥2, 0.07 PP-only (0.19 logs)
    ("late", "tp"): 2.0,
    ("late", "pp"): 0.07,
    # TP over PCIe-only cards (GPUSpec.nvlink False): vLLM's custom all-reduce is off for world
    # size > 2 without full NVLink and for 2 without P2P (vllm custom_all_reduce.py), and NCCL
    # has no NVLink/NVSwitch paths to set up buffers for. Priors, not fits (the development logs
    # hold no PCIe TP run): V0 (which measures NCCL init) and 0.18+ (whose ~2 GiB TP growth
    # appears on NVLink machines) fall to the single-GPU figure of the era; 0.11–0.17 keeps
    # its TP figure, as nothing shows that growth depends on the link (the conservative side).
    ("v0", "tp_pcie"): 0.10,
    ("early", "tp_pcie"): 0.55,
    ("late", "tp_pcie"): 0.25,
}
# CUDA-graph estimate (§2.6), fitted on 0.19 "Estimated CUDA graph memory" lines: a fixed pool
# part plus a per-layer part per captured size (51 sizes up to 512 by default).
GRAPH_BASE_GIB = 0.33
GRAPH_PER_LAYER_GIB = 0.016
GRAPH_MOE_GIB = 0.35
GRAPH_REFERENCE_CAPTURES = 51


@dataclass(frozen=True)
class Coefficients:
    """The calibrated constants of the estimated terms, as one replaceable value.

    Defaults are the module constants above (fitted on the startup-log data set). A caller that
    refits them (the accuracy bench's held-out view) passes its own value to ``predict``.
    """

    sampler_bytes_per_logit: dict[str, float] = field(
        default_factory=lambda: dict(SAMPLER_BYTES_PER_LOGIT), hash=False
    )
    forward_intermediate_factor: float = FORWARD_INTERMEDIATE_FACTOR
    forward_hidden_factor: float = FORWARD_HIDDEN_FACTOR
    non_torch_gib: dict[tuple[str, str], float] = field(
        default_factory=lambda: dict(NON_TORCH_GIB), hash=False
    )
    graph_base_gib: float = GRAPH_BASE_GIB
    graph_per_layer_gib: float = GRAPH_PER_LAYER_GIB
    graph_moe_gib: float = GRAPH_MOE_GIB


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


def _range(value: float, rel: float, abs_bytes: float) -> tuple[int, int]:
    spread = max(value * rel, abs_bytes)
    return max(0, int(value - spread)), int(value + spread)


def padded_vocab(vocab_size: int) -> int:
    """Vocabulary rows after vLLM's padding to a multiple of 64."""
    return -(-vocab_size // 64) * 64


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
) -> int:
    """Transient peak of one eager forward at ``tokens`` tokens (dense MLP or shared experts)."""
    inter = model.intermediate_size
    if model.moe is not None and model.moe.shared_expert_intermediate_size:
        inter = max(inter, model.moe.shared_expert_intermediate_size)
    per_token = (
        coef.forward_intermediate_factor * inter / tp
        + coef.forward_hidden_factor * model.hidden_size
    )
    return int(tokens * per_token * dtype_bytes)


def sampler_peak_bytes(
    model: ModelSpec,
    requests: int,
    era: VllmEra,
    dtype_bytes: int,
    coef: Coefficients = DEFAULT_COEFFICIENTS,
) -> int:
    """Sampler warm-up on ``requests`` last-token rows: logits ``[R, V]`` and top-k/top-p temporaries."""
    per_logit = coef.sampler_bytes_per_logit[era.sampler_path]
    if dtype_bytes == 4:
        per_logit += 2  # logits already fp32: one wider copy
    return int(requests * padded_vocab(model.vocab_size) * per_logit)


def encoder_cache_bytes(model: ModelSpec, max_num_batched_tokens: int, dtype_bytes: int) -> int:
    """Multimodal encoder outputs kept during the profile (§2.3 budget × text hidden size)."""
    if model.vision is None:
        return 0
    budget = max(max_num_batched_tokens, model.vision.max_tokens_per_item)
    return budget * model.hidden_size * dtype_bytes


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
    coef: Coefficients = DEFAULT_COEFFICIENTS,
) -> Estimate:
    """Torch peak increase of the profile run on one rank (§2.3): ``max(forward, sampler) + kept``.

    ``has_sampler`` is False for pipeline stages other than the last (no logits there). Kept
    buffers (fused-MoE workspace, encoder cache) add to whichever phase peaks.
    """
    t = max_num_batched_tokens
    r = min(max_num_seqs, t)
    forward = forward_peak_bytes(model, t, tp, dtype_bytes, coef)
    sampler = sampler_peak_bytes(model, r, era, dtype_bytes, coef) if has_sampler else 0
    kept = moe_workspace_bytes(model, t, tp, dtype_bytes, ep) + encoder_cache_bytes(
        model, t, dtype_bytes
    )
    value = max(forward, sampler) + kept
    phase = "sampler" if sampler >= forward else "forward"
    basis = (
        f"estimate: {phase} peak at T={t}, R={r} ({era.sampler_path} sampler, "
        f"{coef.sampler_bytes_per_logit[era.sampler_path]:.1f} B/logit)"
    )
    if kept:
        basis += f" + {kept / GIB:.2f} GiB kept buffers"
    low, high = _range(value, 0.15, 0.15 * GIB)
    return Estimate(int(value), low, high, basis)


def non_torch(
    era: VllmEra,
    *,
    tp: int,
    pp: int,
    platform: str = "cuda",
    nvlink: bool = True,
    coef: Coefficients = DEFAULT_COEFFICIENTS,
) -> Estimate:
    """Non-torch memory growth measured by the profile (cuBLAS workspaces, NCCL buffers) (§2.4).

    ``nvlink`` is the GPU's interconnect (:attr:`GPUSpec.nvlink`): the calibrated TP figures
    come from NVLink/NVSwitch machines; PCIe-only cards use the ``tp_pcie`` row instead.
    """
    if platform == "cpu":
        return Estimate.exact(0, "CPU backend: no device profiling")
    group = (
        "v0"
        if era.engine == "v0" or era.snapshot_before_nccl
        else ("early" if era.minor <= 17 else "late")
    )
    kind = "tp" if tp > 1 else ("pp" if pp > 1 else "single")
    if kind == "tp" and not nvlink:
        kind = "tp_pcie"
    table = coef.non_torch_gib
    gib = table.get((group, kind), table[(group, "single")])
    if kind == "tp" and group == "late":
        gib += 0.04 * tp
    value = gib * GIB
    low, high = _range(value, 0.3, 0.1 * GIB)
    basis = "calibrated" if kind != "tp_pcie" else "PCIe-only interconnect: no NVLink buffers"
    return Estimate(
        int(value), low, high, f"estimate: non-torch growth, {group} versions, {kind} ({basis})"
    )


def capture_sizes(
    max_num_seqs: int, max_num_batched_tokens: int, compute_capability: str = ""
) -> list[int]:
    """Default CUDA-graph capture sizes (§2.6): up to min(2·seqs, 512; 1024 on Blackwell)."""
    limit = 1024 if compute_capability.startswith("10") else 512
    largest = min(max_num_seqs * 2, limit, max_num_batched_tokens)
    grid = [1, 2, 4, *range(8, 256, 8), *range(256, limit + 1, 16)]
    return [s for s in grid if s <= largest]


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
    coef: Coefficients = DEFAULT_COEFFICIENTS,
) -> Estimate:
    """The CUDA-graph memory vLLM subtracts from the KV budget (0.20+ by default; §2.6).

    Zero with ``enforce_eager``, on CPU, and before 0.20 (the estimate is not applied then;
    graphs come out of the (1 − util) slack).
    """
    if enforce_eager:
        return Estimate.exact(0, "enforce_eager: no CUDA graphs")
    if platform == "cpu":
        return Estimate.exact(0, "CPU backend: no CUDA graphs")
    if era.engine == "v0" or not era.cudagraph_estimate_default:
        return Estimate.exact(
            0, f"not subtracted in vLLM {era.label} (graph memory comes from the 1 − util slack)"
        )
    if platform == "rocm" and era.minor < 26:
        return Estimate.exact(0, f"not profiled on ROCm in vLLM {era.label}")
    n = len(capture_sizes(max_num_seqs, max_num_batched_tokens, compute_capability))
    gib = (
        coef.graph_base_gib + coef.graph_per_layer_gib * stage_layers * n / GRAPH_REFERENCE_CAPTURES
    )
    if model.moe is not None:
        gib += coef.graph_moe_gib
    value = gib * GIB
    low, high = _range(value, 0.35, 0.2 * GIB)
    return Estimate(
        int(value), low, high, f"estimate: {n} captured sizes × {stage_layers} layers (calibrated)"
    )
