"""Per-term errors of the memory model's estimates, by vLLM era (``planner_accuracy --terms``).

For every log that prints the term itself (activation peak, non-torch growth, the 0.18+
"Estimated CUDA graph memory" line), the estimate with its range is set beside the observed
value. Nothing here is fitted: the sampler's bytes are counted from vLLM's code, and the other
constants are the built-in ones. The ranges in ``oomguard.memory.activation`` are set so that
these observed values fall inside them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

from oomguard.errors import OomguardError
from oomguard.memory.activation import Estimate, activation_peak, cudagraph_estimate
from oomguard.memory.engine import predict
from oomguard.memory.versions import resolve_era

if TYPE_CHECKING:
    from planner_accuracy import Prepared

GIB = 2**30


@dataclass
class TermCase:
    term: str
    era: str
    label: str
    observed: float
    estimate: Estimate

    @property
    def rel_err(self) -> float:
        return (self.estimate.value_bytes / GIB - self.observed) / max(self.observed, 0.01)

    @property
    def covered(self) -> bool:
        return self.estimate.low_bytes / GIB - 0.005 <= self.observed <= self.estimate.high_bytes / GIB + 0.005


def term_cases(prepared: list[Prepared]) -> list[TermCase]:
    """One case per (row, observed term)."""
    from planner_accuracy import era_label

    out: list[TermCase] = []
    for p in prepared:
        obs = p.raw_observed
        try:
            pred = predict(p.model, p.gpu, p.settings, strict=False)
        except OomguardError:
            continue
        era = era_label(p.settings, pred.vllm_version)
        label = f"{p.dataset} {p.row} {p.model.name[:30]}"
        if obs.get("activation_peak_gib") is not None:
            s = pred.settings
            ep = s.tensor_parallel_size * s.data_parallel_size if s.enable_expert_parallel else 1
            first = activation_peak(  # the logged rank is the first pipeline stage
                p.model, era=pred.era, max_num_batched_tokens=int(s.max_num_batched_tokens or 0),
                max_num_seqs=int(s.max_num_seqs or 0), tp=s.tensor_parallel_size,
                dtype_bytes=2 if (pred.weights.basis and s.dtype != "float32") else 4,
                has_sampler=s.pipeline_parallel_size == 1, ep=ep,
            )  # fmt: skip
            out.append(TermCase("activation", era, label, obs["activation_peak_gib"], first))
        if obs.get("non_torch_gib") is not None:
            out.append(TermCase("non_torch", era, label, obs["non_torch_gib"], pred.non_torch))
        if obs.get("cudagraph_estimated_gib") is not None:
            s = pred.settings
            g = cudagraph_estimate(
                p.model, resolve_era("0.20"), stage_layers=pred.stages[0].num_layers,
                max_num_seqs=int(s.max_num_seqs or 256),
                max_num_batched_tokens=int(s.max_num_batched_tokens or 2048), enforce_eager=False,
                compute_capability=p.gpu.compute_capability, tp=s.tensor_parallel_size,
            )  # fmt: skip
            out.append(TermCase("cudagraph (0.20+ formula)", era, label, obs["cudagraph_estimated_gib"], g))
    return out


def print_terms(prepared: list[Prepared]) -> None:
    """Median and spread of each term's relative error, and how many fall in the range."""
    cases = term_cases(prepared)
    print("\nper-term errors (estimate vs the value the log prints), by era:")
    for term in dict.fromkeys(c.term for c in cases):
        for era in dict.fromkeys(c.era for c in cases if c.term == term):
            mine = [c for c in cases if c.term == term and c.era == era]
            errs = sorted(c.rel_err * 100 for c in mine)
            inside = sum(c.covered for c in mine)
            print(f"  {term:26s} {era:10s} n={len(mine):3d}  median {statistics.median(errs):+6.1f}%  "
                  f"min {errs[0]:+6.1f}%  max {errs[-1]:+6.1f}%  in range {inside}/{len(mine)}")
            for c in mine:
                if not c.covered:
                    e = c.estimate
                    print(f"      outside: {c.label:44s} obs {c.observed:5.2f} est {e.value_bytes / GIB:5.2f} "
                          f"[{e.low_bytes / GIB:.2f}, {e.high_bytes / GIB:.2f}]")
