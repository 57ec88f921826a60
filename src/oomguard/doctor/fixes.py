"""Every fix of a memory failure, computed from the numbers with a margin, and checked by the
memory model. ``oomguard doctor`` prints them; ``oomguard serve`` runs the first its checks
accept (:mod:`oomguard.serve.heal`) and computes none of its own.

Margins (never a fix at the exact edge):

- a utilization sized to the free memory leaves ``margin_gib(total)`` = max(1 GiB, 2 % of the
  device) unrequested, so the start-up check still passes when free memory moves by half a
  GiB between the failure and the restart; the free memory is the log's, or the memory free
  now when the caller measured less (``Context.free_gib``);
- a ``--max-model-len`` from the KV capacity the log states keeps ``KV_MARGIN`` (10 %) of it
  spare;
- a ``--kv-cache-memory-bytes`` holds 25 % more than one max_model_len request needs.

When the model and the device are known, every flag fix of a start-up failure is run through
the memory model with the log's measurements and with 0.5 GiB less free memory; a fix it
predicts to fail is dropped. For a start-up failure the first fix is always a flag change when
one exists (``oomguard serve`` applies it), actions follow.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from oomguard.doctor.findings import Fix
from oomguard.doctor.mechanisms import Verdict, explicit_kv_bytes
from oomguard.doctor.outcome import apply_fix, current_settings, predict_run
from oomguard.doctor.situation import Situation, ceil2, floor2, nice_max_model_len
from oomguard.doctor.weights import weights_fixes
from oomguard.logs.parsed import Phase
from oomguard.memory.kv import KV_MARGIN

# The one margin rule of every fix that sizes memory, the doctor's and serve's alike: twice the
# drift of free memory between a failure and its restart (FREE_DRIFT_GIB), so a fix sized at
# the failure still starts when half a GiB less is free; 2 % on large devices, whose free
# memory moves more in absolute terms.
MARGIN_MIN_GIB = 1.0
MARGIN_SHARE = 0.02
LENGTH_KEEP = 1 - KV_MARGIN
KV_BYTES_FACTOR = 1.25
# free memory may move by this much between the failure and the restart
FREE_DRIFT_GIB = 0.5
MAX_UTIL = 0.95
# vllm 0.32 cpu_worker: "… less than requested memory for kv (-0.37/0.25 GiB)"
_CPU_KV_REQUEST = re.compile(r"requested memory for kv \((-?[\d.]+)(?:/([\d.]+))? GiB\)")
_STARTUP_PHASES = (
    Phase.STARTUP,
    Phase.WEIGHT_LOADING,
    Phase.PROFILING,
    Phase.KV_ALLOCATION,
    Phase.SAMPLER_WARMUP,
    Phase.CUDA_GRAPH_CAPTURE,
)


def margin_gib(total_gib: float) -> float:
    """Memory a utilization fix leaves unrequested: max(1 GiB, 2 % of the device)."""
    return max(MARGIN_MIN_GIB, MARGIN_SHARE * total_gib)


def free_gib(s: Situation) -> float | None:
    """The free memory a fix is sized to: the log's start-up figure, or the memory free now
    when the caller measured less (None when the log states none)."""
    logged = s.get("startup_free_gib")
    if logged is None:
        return None
    now = s.context.free_gib
    return float(logged) if now is None else min(float(logged), float(now))


def util_within_free(free_gib: float, total_gib: float) -> float:
    """The largest utilization (two decimals) whose request leaves the margin free (0 when
    the free memory is within the margin: no utilization does)."""
    return max(floor2((free_gib - margin_gib(total_gib)) / total_gib), 0.0)


def is_startup_failure(s: Situation) -> bool:
    """Whether the engine failed before serving (the case ``oomguard serve`` heals)."""
    p = s.parsed
    if any(
        p.has(n)
        for n in (
            "startup_check_failed",
            "kv_too_small",
            "no_cache_blocks",
            "cpu_kv_allocation_failed",
            "mamba_blocks_exceeded",
        )
    ):
        return True
    return p.failure_phase is not None and p.failure_phase.value in _STARTUP_PHASES


def fixes_for(s: Situation, cause: str, verdict: Verdict | None) -> list[Fix]:
    """The fixes for ``cause`` in the order to try them; for a start-up failure, those the
    memory model predicts to fail are dropped."""
    fixes = _BUILDERS.get(cause, _other_fixes)(s, verdict)
    return _checked(s, fixes) if is_startup_failure(s) else fixes


def _checked(s: Situation, fixes: list[Fix]) -> list[Fix]:
    """Keep the flag fixes the memory model predicts to start (with free memory 0.5 GiB
    lower); a fix that then fails only the length check gets the fitting ``--max-model-len``
    as its companion. When every flag fix fails, an action says what the model predicts."""
    free = free_gib(s)
    drifted = free - FREE_DRIFT_GIB if free is not None else None
    out: list[Fix] = []
    dropped: list[str] = []
    for fix in fixes:
        checked, problem = _check_one(s, fix, drifted)
        if checked is not None:
            out.append(checked)
        elif problem:
            dropped.append(f"{fix.as_text}: {problem}")
    if dropped and not any(f.is_flag for f in out):
        out.insert(
            0,
            Fix(
                "action",
                "no setting of this engine starts on what this device has "
                "free (the memory model predicts " + "; ".join(dropped) + "): free the "
                "GPU, or use a smaller or quantized model",
                "",
            ),
        )
    return out


def _check_one(s: Situation, fix: Fix, free_gib: float | None) -> tuple[Fix | None, str]:
    """``fix`` (or it with a length companion) if predicted to start, else (None, why)."""
    settings = apply_fix(current_settings(s), fix) if fix.is_flag else None
    prediction = predict_run(s, settings, free_gib) if settings is not None else None
    if prediction is None or prediction.fits:
        return fix, ""
    codes = {p.code for p in prediction.problems}
    estimate = prediction.estimated_max_model_len
    if codes == {"max_len_exceeds_kv"} and estimate and "--max-model-len" not in fix.flags():
        length = nice_max_model_len(max(int(estimate * LENGTH_KEEP), 1), prediction.block_size)
        joined = Fix(
            fix.flag,
            fix.value,
            f"{fix.why}; with --max-model-len {length:,}, 90 % of "
            f"the {estimate:,} tokens the smaller KV cache holds",
            also=(*fix.also, ("--max-model-len", str(length))),
        )
        return _check_one(s, joined, free_gib) if length > 0 else (None, "")
    return None, "; ".join(p.message.split(". ")[0] for p in prediction.problems)


# --- per cause ------------------------------------------------------------------------------------


def _kv_fixes(s: Situation, verdict: Verdict | None) -> list[Fix]:
    """The KV cache cannot hold one max_model_len request: shorten it, give the pool more
    memory, or store KV more compactly."""
    if verdict is not None and verdict.mechanism == "cpu_kv_budget":
        return _cpu_budget_fixes(s)
    if verdict is not None and verdict.mechanism == "budget_arithmetic":
        return _low_util_fixes(s, verdict)
    # a shorter length never needs more memory: it comes before a larger pool
    fixes: list[Fix] = []
    kv_bytes = _kv_bytes_fix(s)
    capacity = s.get("estimated_max_model_len") or s.get("kv_capacity_tokens")
    if verdict is not None:
        capacity = int(verdict.numbers.get("kv_capacity_tokens", capacity or 0)) or capacity
    if capacity:
        keep = int(int(capacity) * LENGTH_KEEP)
        length = nice_max_model_len(max(keep, 1), s.block_size)
        fixes.append(
            Fix(
                "--max-model-len",
                str(length),
                f"the KV cache holds about {int(capacity):,} tokens; {length:,} keeps "
                f"{1 - LENGTH_KEEP:.0%} of it spare (a multiple of the "
                f"{s.block_size}-token block)",
            )
        )
    if kv_bytes is not None:
        fixes.append(kv_bytes)
    raise_util = _kv_util_raise(s)
    if raise_util is not None and kv_bytes is None:
        fixes.append(raise_util)
    if not capacity and kv_bytes is None:
        what = (
            "raise --kv-cache-memory-bytes until it holds one request of max_model_len, or "
            if explicit_kv_bytes(s)
            else ""
        )
        fixes.append(
            Fix(
                "action",
                what + "lower --max-model-len to the longest prompt + output "
                "you serve (the log does not state the KV cache's capacity)",
                "",
            )
        )
    if str(s.get("kv_cache_dtype") or "auto") in ("auto", "bfloat16", "float16"):
        fixes.append(
            Fix(
                "--kv-cache-dtype",
                "fp8",
                "halves the KV bytes per token: the same memory holds twice the tokens",
            )
        )
    return fixes


def _kv_bytes_fix(s: Situation) -> Fix | None:
    """With ``--kv-cache-memory-bytes`` the pool is exactly that size: make it hold a request."""
    given = explicit_kv_bytes(s)
    if not given:
        return None
    need = s.get("kv_needed_gib")
    needed_bytes = int(float(need) * 2**30) if need and float(need) >= 0.1 else None
    needed_bytes = needed_bytes or _bytes_for_length(s)
    if not needed_bytes:
        return None
    value = math.ceil(needed_bytes * KV_BYTES_FACTOR / 2**20)
    return Fix(
        "--kv-cache-memory-bytes",
        f"{value}M",
        f"the pool is exactly --kv-cache-memory-bytes ({given:,} bytes); one request of "
        f"max_model_len needs {needed_bytes / 2**20:.1f} MiB, this gives 25 % more",
    )


def _bytes_for_length(s: Situation) -> int | None:
    """KV bytes of one max_model_len request by the memory model (None when unknown)."""
    settings = current_settings(s)
    prediction = predict_run(s, settings)
    return int(prediction.needed_bytes_for_max_len) if prediction is not None else None


def _kv_util_raise(s: Situation) -> Fix | None:
    """Raise the utilization by the missing KV (with 20 % and the margin), when the device
    has that memory free."""
    util, total = s.util, s.total_gib
    need, avail = s.get("kv_needed_gib"), s.get("kv_available_gib")
    if util is None or not total or need is None or avail is None:
        return None
    missing = (float(need) - float(avail)) * 1.2
    new = ceil2(float(util) + missing / float(total))
    ceiling = MAX_UTIL
    free = free_gib(s)
    if free is not None:
        ceiling = min(ceiling, util_within_free(free, float(total)))
    if new > ceiling or new <= float(util):
        return None
    return Fix(
        "--gpu-memory-utilization",
        f"{new:.2f}",
        f"adds {missing:.2f} GiB (the missing KV and 20 %) to the budget: {float(util):g} "
        f"+ {missing:.2f} ÷ {float(total):.1f} GiB, if nothing else needs that memory",
    )


def _cpu_budget_fixes(s: Situation) -> list[Fix]:
    """CPU backend: utilization × node memory must exceed the worker's resident memory plus
    the KV cache it asks for."""
    total = s.get("startup_total_gib") or s.total_gib
    util = s.util
    text = s.parsed.signatures["cpu_kv_allocation_failed"].text
    m = _CPU_KV_REQUEST.search(text)
    if not (m and total and util is not None):
        return [
            Fix(
                "action",
                "raise --gpu-memory-utilization: on the CPU backend it is the "
                "share of node memory, and it must exceed what the worker already holds",
                "",
            )
        ]
    kv = float(m.group(1))
    wanted = max(float(m.group(2) or 0.5), 0.5)
    resident = float(util) * float(total) - kv
    new = min(ceil2((resident + wanted + margin_gib(float(total)) / 2) / float(total)), 0.9)
    return [
        Fix(
            "--gpu-memory-utilization",
            f"{new:.2f}",
            f"on the CPU backend the flag is the share of node memory: {float(util):g} × "
            f"{float(total):.2f} GiB is below the {resident:.2f} GiB the worker holds; "
            f"{new:.2f} leaves room for {wanted:g} GiB of KV cache and a margin",
        )
    ]


def _low_util_fixes(s: Situation, verdict: Verdict) -> list[Fix]:
    """The utilization is too low for the weights plus a KV cache."""
    total = verdict.numbers.get("total_gib") or float(s.total_gib or 0)
    weights = verdict.numbers.get("weights_gib", 0.0)
    act = float(s.get("activation_gib") or 1.0)
    kv = (_bytes_for_length(s) or 2**30) / 2**30
    need = weights + act + float(s.get("non_torch_gib") or 0.5) + kv * 1.2 + margin_gib(total)
    new = ceil2(need / total) if total else None
    if new is None or new > MAX_UTIL:
        return weights_fixes(s, weights * s.tp, total * float(s.util or 0.9))
    return [
        Fix(
            "--gpu-memory-utilization",
            f"{new:.2f}",
            f"weights {weights:.1f} + activations {act:.1f} + non-torch + the KV of one "
            f"request ({kv:.2f}) and a margin = {need:.1f} GiB of {total:.1f}",
        )
    ]


def _util_fixes(s: Situation, verdict: Verdict | None) -> list[Fix]:
    """Utilization asks for more than the device has free."""
    free, total = free_gib(s), s.get("startup_total_gib") or s.total_gib
    if free is not None and total:
        new = util_within_free(free, float(total))
        if new < 0.01:
            return [
                Fix(
                    "action",
                    f"free GPU memory: {free:.2f} of {float(total):.2f} GiB "
                    f"{_were_free(s, free)}, less than the {margin_gib(float(total)):.1f} GiB "
                    "a start must leave unrequested",
                    "",
                )
            ]
        return [
            Fix(
                "--gpu-memory-utilization",
                f"{new:.2f}",
                f"{free:.2f} of {float(total):.2f} GiB {_were_free(s, free)}; {new:.2f} × "
                f"{float(total):.2f} leaves {margin_gib(float(total)):.1f} GiB of them "
                "unrequested, so the check passes if free memory moves a little",
            )
        ]
    util = s.util
    if util is not None and s.util_stated and util >= 0.93:
        return [
            Fix(
                "--gpu-memory-utilization",
                "0.90",
                f"{util:g} leaves no room for the CUDA context, NCCL buffers and what "
                "vLLM does not account for",
            )
        ]
    return [
        Fix(
            "action",
            "lower --gpu-memory-utilization below (free memory − 1 GiB) ÷ total "
            "memory, as nvidia-smi shows them before the start",
            "",
        )
    ]


def _were_free(s: Situation, free: float) -> str:
    """How the free memory a fix was sized to is said: at the failure, or now."""
    logged = s.get("startup_free_gib")
    return "were free" if logged is not None and float(logged) <= free else "are free now"


def _other_process_fixes(s: Situation, verdict: Verdict | None) -> list[Fix]:
    """Another process (or a leak) holds the memory: stop it, or budget around it."""
    find = Fix(
        "action",
        "find what holds the GPU (nvidia-smi --query-compute-apps=pid,"
        "used_memory --format=csv) and stop it, or give each engine its own GPU "
        "(CUDA_VISIBLE_DEVICES)",
        "a leftover engine or a trainer is not a co-tenant to budget for",
    )
    fixes = [find]
    budget = _util_fixes(s, verdict)
    if budget and budget[0].is_flag:
        beside = Fix(
            budget[0].flag, budget[0].value, budget[0].why + " (to start beside the other process)"
        )
        # a start-up failure is healed by a flag change; stopping the process comes next
        fixes.insert(0 if is_startup_failure(s) else 1, beside)
    if s.sleep_mode or s.parsed.has("memory_growth"):
        fixes.append(
            Fix(
                "action",
                "upgrade vLLM or restart the engine periodically: memory it "
                "does not release grows until allocations fail",
                "",
            )
        )
    return fixes


def _graph_fixes(s: Situation, verdict: Verdict | None) -> list[Fix]:
    """CUDA graphs are captured after the KV cache took its share."""
    eager = Fix(
        "--enforce-eager",
        None,
        "no CUDA graphs, so no capture memory (decoding is "
        "slower; try a smaller capture size next to get them back)",
    )
    smaller = Fix(
        "--max-cudagraph-capture-size",
        "128",
        "captures fewer, smaller graphs (older releases: --cudagraph-capture-sizes)",
    )
    graphs = s.get("cudagraph_actual_gib") or s.get("cudagraph_estimate_gib")
    util, total = s.util, s.total_gib
    if graphs and util is not None and total:
        step = ceil2((float(graphs) + margin_gib(float(total)) / 2) / float(total))
        new = round(float(util) - step, 2)
        if new > 0.1:
            lower = Fix(
                "--gpu-memory-utilization",
                f"{new:.2f}",
                f"the graphs take {float(graphs):.2f} GiB outside the budget: "
                f"{float(util):g} − {step:.2f} leaves them room with a margin",
            )
            return [lower, smaller, eager]
    return [eager, smaller]


def _batch_fixes(s: Situation, verdict: Verdict | None) -> list[Fix]:
    """Too many sequences or too large a batch for the memory left."""
    if verdict is not None and verdict.mechanism == "state_blocks":
        blocks = int(verdict.numbers["state_blocks"])
        target = max(int(blocks * LENGTH_KEEP), 1)
        return [
            Fix(
                "--max-num-seqs",
                str(target),
                f"each running sequence holds one of the {blocks} state blocks; "
                f"{target} keeps 10 % spare",
            )
        ]
    seqs = int(s.get("sampler_warmup_oom_seqs") or s.get("max_num_seqs") or _default_seqs(s))
    target = power_of_two_at_most(seqs // 4)
    fixes = [
        Fix(
            "--max-num-seqs",
            str(target),
            f"the sampler warm-up and profiling batch are sized for {seqs} sequences; "
            f"{target} needs a quarter of that",
        )
    ]
    tokens = s.get("max_num_batched_tokens")
    oom = s.parsed.first_oom
    if tokens and oom is not None and oom.tried_gib and oom.free_gib is not None:
        keep = max(oom.free_gib / oom.tried_gib, 0.1)
        if keep < 1:
            new_tokens = max(power_of_two_at_most(int(int(tokens) * keep * 0.8)), 256)
            fixes.append(
                Fix(
                    "--max-num-batched-tokens",
                    str(new_tokens),
                    f"the activation peak grows with the tokens per batch: {int(tokens)} "
                    f"× {keep:.2f} (free ÷ requested) with a margin",
                )
            )
    return fixes


def power_of_two_at_most(n: int) -> int:
    """The largest power of two ≤ n (1 for n < 2)."""
    return 1 << (max(n, 1).bit_length() - 1)


def _default_seqs(s: Situation) -> int:
    """vLLM's default max_num_seqs (V1 on ≥ 70 GiB devices: 1024, else 256)."""
    if s.get("engine") == "v0":
        return 256
    total = s.total_gib
    return 1024 if total is None or float(total) >= 70 else 256


def _multimodal_fixes(s: Situation, verdict: Verdict | None) -> list[Fix]:
    """The encoder's profiling run on maximal items: fewer items, smaller items."""
    seqs = int(s.get("max_num_seqs") or _default_seqs(s))
    target = power_of_two_at_most(seqs // 4)
    return [
        Fix(
            "--limit-mm-per-prompt",
            '{"image": 1}',
            "vLLM profiles the encoder on the most items a prompt may carry; one image per "
            "prompt bounds that run (raise it to what your prompts need)",
        ),
        Fix(
            "--max-num-seqs",
            str(target),
            f"the encoder profile covers up to max_num_seqs × items ({seqs} sequences now)",
        ),
        Fix(
            "--mm-processor-kwargs",
            '{"max_pixels": 1003520}',
            "caps the image size the encoder is profiled at (Qwen-VL style processors)",
        ),
    ]


def _fragmentation_fixes(s: Situation, verdict: Verdict | None) -> list[Fix]:
    """The allocator's cache held the memory in pieces."""
    if s.sleep_mode:
        return [
            Fix(
                "action",
                "lower --gpu-memory-utilization by the reserved-but-unallocated "
                "memory: sleep mode's pool does not allow expandable segments",
                "",
            )
        ]
    return [
        Fix(
            "PYTORCH_CUDA_ALLOC_CONF",
            "expandable_segments:True",
            "lets the allocator grow segments instead of needing one free block of the "
            "requested size",
        )
    ]


def _weights_fixes(s: Situation, verdict: Verdict | None) -> list[Fix]:
    total = s.total_gib
    weights = s.get("weights_total_gib")
    if verdict is not None and "weights_gib" in verdict.numbers:
        weights = verdict.numbers["weights_gib"] * s.tp
    if weights and total:
        fixes = weights_fixes(s, float(weights), float(total) * float(s.util or 0.9))
        if fixes:
            return fixes
    return [
        Fix(
            "action",
            "use a quantized checkpoint (AWQ/GPTQ/fp8) or more GPUs "
            "(--tensor-parallel-size): the weights per GPU must leave room for the KV cache",
            "",
        )
    ]


def _host_fixes(s: Situation, verdict: Verdict | None) -> list[Fix]:
    p = s.parsed
    fixes: list[Fix] = []
    if p.has("shm_exhausted"):
        fixes.append(
            Fix(
                "action",
                "give the container more shared memory (docker run --shm-size 16g, or --ipc=host)",
                "/dev/shm is 64 MiB by default",
            )
        )
    swap = s.get("swap_space_gib")
    if p.has("cpu_swap_too_large") or p.has("cpu_swap_exhausted") or swap:
        fixes.append(
            Fix(
                "--swap-space",
                "0" if not p.has("cpu_swap_exhausted") else "16",
                "the CPU swap space is pinned host memory for each GPU",
            )
        )
    if s.get("cpu_offload_gib"):
        fixes.append(
            Fix(
                "--cpu-offload-gb",
                str(max(int(float(s.get("cpu_offload_gib")) // 2), 0)),
                "offloaded weights live in host memory",
            )
        )
    fixes.append(
        Fix(
            "action",
            "give the host or container more memory, or run fewer "
            "engines/workers on it (free -g and dmesg show what was killed)",
            "",
        )
    )
    return fixes


def _other_fixes(s: Situation, verdict: Verdict | None) -> list[Fix]:
    if verdict is not None and verdict.mechanism == "allocator_conflict":
        return [
            Fix(
                "PYTORCH_CUDA_ALLOC_CONF",
                "expandable_segments:False",
                "expandable segments are refused here (sleep mode's pool, WSL2): turn them "
                "off wherever they are set",
            )
        ]
    return [
        Fix(
            "action",
            "read the first error of the log: the failure is not one of vLLM's "
            "memory mechanisms (a bug, a driver, a version)",
            "",
        )
    ]


_BUILDERS: dict[str, Callable[[Situation, Verdict | None], list[Fix]]] = {
    "kv_too_small_for_max_len": _kv_fixes,
    "util_overshoot": _util_fixes,
    "leak_or_other_process": _other_process_fixes,
    "cuda_graph": _graph_fixes,
    "concurrency_or_batch": _batch_fixes,
    "multimodal_encoder": _multimodal_fixes,
    "fragmentation": _fragmentation_fixes,
    "weights_dont_fit": _weights_fixes,
    "cpu_ram": _host_fixes,
    "other": _other_fixes,
}
