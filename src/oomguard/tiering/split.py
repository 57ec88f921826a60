"""The largest llama.cpp split that fits a GPU budget with a margin, and what it costs.

The budget of each GPU is its total less ``CUDA_CONTEXT_BYTES`` (the CUDA context and cuBLAS
workspace llama.cpp does not print; an estimate) and ``MARGIN_BYTES`` (the free margin
llama.cpp's own ``--fit`` keeps by default, ``common.h`` ``fit_params_target`` = 1024 MiB), less
any headroom for co-tenants. A split fits when every GPU's predicted buffers, compute at the
top of its range, stay inside it. Dense models put whole layers on the GPU (``-ngl``, the last
layers first); MoE models first keep every layer's attention on the GPU and move the experts
of the first layers to the CPU (``--n-cpu-moe``), the usual fastest layout, and fall back to a
layer split with all experts on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from oomguard.tiering.bandwidth import HOST_RAM_GBPS
from oomguard.tiering.memory import LlamaCppMemory, predict_llama_cpp
from oomguard.tiering.model import GGUFModel
from oomguard.tiering.placement import CPU
from oomguard.tiering.settings import LlamaCppSettings
from oomguard.units import GIB, MIB

CUDA_CONTEXT_BYTES = 512 * MIB  # CUDA context + cuBLAS workspace per GPU (estimate)
MARGIN_BYTES = GIB  # llama.cpp --fit-target default
HOST_MARGIN_BYTES = 2 * GIB  # the OS and the server process itself


@dataclass(frozen=True)
class SplitPlan:
    """One llama.cpp configuration and its prediction against the GPU and host budgets."""

    memory: LlamaCppMemory
    gpu_budget_bytes: int  # per GPU
    gpu_need_bytes: int  # the fullest GPU, compute at the top of its range
    host_need_bytes: int
    host_budget_bytes: int | None

    @property
    def settings(self) -> LlamaCppSettings:
        return self.memory.settings

    @property
    def fits_gpu(self) -> bool:
        """Every GPU's predicted buffers fit its budget."""
        return self.gpu_need_bytes <= self.gpu_budget_bytes

    @property
    def fits_host(self) -> bool | None:
        """Host memory suffices (None: the host's memory is not known)."""
        return (
            None
            if self.host_budget_bytes is None
            else self.host_need_bytes <= self.host_budget_bytes
        )

    def read_bytes_per_token(self, on_gpu: bool) -> float:
        """Weight bytes one decoded token reads on the GPUs (or the CPU): every dense weight, and
        of the expert tensors the share of experts a token uses."""
        model = self.memory.model
        share = model.n_expert_used / model.n_expert if model.n_expert else 1.0
        seen: dict[str, float] = {}
        for p in self.memory.placement.tensors:
            if (p.device != CPU) == on_gpu and p.tensor.role != "input":  # the embedding: one row
                seen[p.tensor.name] = p.tensor.nbytes * (share if p.tensor.is_expert else 1.0)
        return sum(seen.values())

    def decode_tokens_per_s(
        self, gpu_gbps: float | None, host_gbps: float = HOST_RAM_GBPS
    ) -> float | None:
        """Single-sequence decode bound: the weights a token uses, read once (estimate)."""
        on_gpu = self.read_bytes_per_token(True)
        if gpu_gbps is None and on_gpu:
            return None
        seconds = self.read_bytes_per_token(False) / (host_gbps * 1e9)
        if on_gpu and gpu_gbps:
            seconds += on_gpu / (gpu_gbps * 1e9)
        return 1 / seconds if seconds else None


def price_split(
    model: GGUFModel,
    settings: LlamaCppSettings,
    gpu_total_bytes: int,
    headroom_bytes: int = 0,
    host_total_bytes: int | None = None,
) -> SplitPlan:
    """Predict ``settings`` and compare it with the budgets."""
    memory = predict_llama_cpp(model, settings)
    budget = max(0, gpu_total_bytes - CUDA_CONTEXT_BYTES - MARGIN_BYTES - headroom_bytes)
    gpu_need = max((memory.device_bytes(d, "high") for d in memory.gpu_devices()), default=0)
    host_need = memory.device_bytes(CPU, "high")
    host_budget = None if host_total_bytes is None else max(0, host_total_bytes - HOST_MARGIN_BYTES)
    return SplitPlan(memory, budget, gpu_need, host_need, host_budget)


def _largest(lo: int, hi: int, plan_at: Callable[[int], SplitPlan]) -> int | None:
    """The largest n in [lo, hi] whose plan fits the GPU budget (GPU need grows with n).

    The need is close to linear in n (whole layers), so the first guess interpolates between
    the ends and a few steps settle it: a handful of predictions instead of a bisection's eight.
    """
    low = plan_at(lo)
    if not low.fits_gpu:
        return None
    high = plan_at(hi)
    if high.fits_gpu:
        return hi
    per_step = (high.gpu_need_bytes - low.gpu_need_bytes) / max(1, hi - lo)
    guess = lo + int((low.gpu_budget_bytes - low.gpu_need_bytes) / per_step) if per_step > 0 else lo
    n = min(max(guess, lo), hi - 1)
    if plan_at(n).fits_gpu:
        while n + 1 < hi and plan_at(n + 1).fits_gpu:
            n += 1
        return n
    while n > lo and not plan_at(n - 1).fits_gpu:
        n -= 1
    return max(lo, n - 1)


def _smallest(lo: int, hi: int, plan_at: Callable[[int], SplitPlan]) -> int | None:
    """The smallest n in [lo, hi] whose plan fits (GPU need falls as n grows)."""
    found = _largest(-hi, -lo, lambda m: plan_at(-m))
    return None if found is None else -found


def best_split(
    model: GGUFModel,
    base: LlamaCppSettings,
    gpu_total_bytes: int,
    headroom_bytes: int = 0,
    host_total_bytes: int | None = None,
    at_least: int = 0,
) -> SplitPlan:
    """The split that keeps the most on the GPUs and fits (``-ngl 0`` when nothing does).

    ``at_least``: a layer count known to fit (from a split that needs more memory), where the
    search starts.
    """

    seen: dict[LlamaCppSettings, SplitPlan] = {}  # the search ends on a split it has priced

    def plan(s: LlamaCppSettings) -> SplitPlan:
        if s not in seen:
            seen[s] = price_split(model, s, gpu_total_bytes, headroom_bytes, host_total_bytes)
        return seen[s]

    n = model.n_layer
    if model.n_expert:
        all_gpu = replace(base, n_gpu_layers=n + 1, cpu_moe=False)
        moe = _smallest(0, n, lambda m: plan(replace(all_gpu, n_cpu_moe=m)))
        if moe is not None:
            return plan(replace(all_gpu, n_cpu_moe=moe))
        base = replace(base, cpu_moe=True)
    ngl = _largest(min(at_least, n + 1), n + 1, lambda m: plan(replace(base, n_gpu_layers=m)))
    return plan(replace(base, n_gpu_layers=ngl or 0))


def after_allocation_failure(
    model: GGUFModel,
    failed: LlamaCppSettings,
    gpu_total_bytes: int,
    short_bytes: int,
    headroom_bytes: int = 0,
) -> SplitPlan | None:
    """The split to retry with after llama-server could not allocate ``short_bytes`` more on a GPU.

    The GPU had less room than predicted (another process, a larger compute buffer): the budget
    shrinks by the shortfall and the largest split under it is searched again, always at least
    one layer (or one layer's experts) fewer than the split that failed. None when nothing is
    left to move to the CPU.
    """
    smaller = gpu_total_bytes - max(short_bytes, 0)
    n = model.n_layer
    if model.n_expert and not failed.cpu_moe and failed.n_cpu_moe < n:
        found = best_split(model, replace(failed, n_cpu_moe=0), smaller, headroom_bytes)
        if not found.settings.cpu_moe:
            k = max(found.settings.n_cpu_moe, failed.n_cpu_moe + 1)
            return price_split(model, replace(failed, n_cpu_moe=k), smaller, headroom_bytes)
    ngl = n + 1 if failed.n_gpu_layers < 0 else failed.n_gpu_layers
    if ngl == 0:
        return None
    base = replace(
        failed,
        cpu_moe=failed.cpu_moe or bool(model.n_expert),
        n_cpu_moe=0 if model.n_expert else failed.n_cpu_moe,
    )
    found = best_split(model, replace(base, n_gpu_layers=0), smaller, headroom_bytes)
    return price_split(
        model,
        replace(base, n_gpu_layers=min(found.settings.n_gpu_layers, ngl - 1)),
        smaller,
        headroom_bytes,
    )
