"""Context parallelism: which ranks a deployment takes and which KV it shards (§14.1).

Facts from vllm 0.32 ``config/parallel.py`` (``ParallelConfig``): the process world of one
engine is ``PP × TP × PCP``; DCP "does not expand the process world size" and, without PCP,
reuses the TP ranks (``tp % dcp == 0``); with PCP it is 1, PCP or TP × PCP. PCP "does not
increase the KV-cache shard count". MoE layers are sharded over TP × PCP × DP.
"""

from __future__ import annotations

from oomguard.errors import BadInput


def check_context_parallel(tp: int, pcp: int, dcp: int) -> None:
    """Refuse the CP sizes vLLM refuses, with its reason (one line)."""
    if pcp < 1 or dcp < 1:
        raise BadInput(
            "--decode-context-parallel-size and --prefill-context-parallel-size must be ≥ 1",
            "pass a positive integer (1 turns context parallelism off)",
        )
    if pcp == 1 and tp % dcp:
        raise BadInput(
            f"tp_size={tp} must be divisible by dcp_size={dcp}",
            "DCP reuses the tensor-parallel ranks: pick a DCP size that divides "
            "--tensor-parallel-size",
        )
    if pcp > 1 and dcp not in (1, pcp, tp * pcp):
        raise BadInput(
            f"with PCP={pcp}, DCP={dcp} must be disabled, span the PCP axis or span TP × PCP",
            "use --decode-context-parallel-size "
            f"{' or '.join(map(str, sorted({1, pcp, tp * pcp})))}",
        )


def engine_world_size(tp: int, pp: int, pcp: int) -> int:
    """GPUs one engine takes: PP × TP × PCP (DCP reuses them; each DP rank is one more)."""
    return pp * tp * pcp


def expert_parallel_size(tp: int, pcp: int, dp: int) -> int:
    """Ranks the MoE experts are split over with expert parallelism: TP × PCP × DP."""
    return tp * pcp * dp
