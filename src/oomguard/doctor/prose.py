"""The doctor on prose: a memory failure stated in words (an issue title, a one-line summary,
a description) rather than shown by a log line.

Such text is weaker evidence, so every finding here has a moderate confidence, and the rule
runs only when no log line, error or traceback gave a finding. The cause is read from what the
text states, strongest first: the fix the writer says worked ("works with enforce-eager"),
figures it quotes (GiB reserved but unallocated, an engine's memory still in use after sleep,
a utilization, a model and GPU whose weights do not fit), a vLLM upgrade across a release that
changed where memory goes, then the mechanisms and settings it names (CUDA graphs, images,
fragmentation, host RAM, a co-located trainer, another process, the context length, the batch).
With none of these it says so, with a low confidence and the checklist's first questions.
"""

from __future__ import annotations

import re

from oomguard.doctor.findings import (
    CAUSES,
    STEP_ACTION,
    STEP_BATCHED_TOKENS,
    STEP_CUDAGRAPH,
    STEP_ENV,
    STEP_MAX_MODEL_LEN,
    STEP_MAX_NUM_SEQS,
    STEP_MULTIMODAL,
    STEP_OFFLOAD,
    STEP_SWAP,
    STEP_TP,
    STEP_UTIL,
    Fix,
)
from oomguard.doctor.rules import (
    Findings,
    budget_gib,
    default_max_num_seqs,
    fewer_seqs,
    is_multimodal_model,
    lower_util,
    tp_step,
    weights_fixes,
)
from oomguard.doctor.situation import Situation
from oomguard.logs import prose
from oomguard.logs.parsed import Evidence

# How much a statement weighs, strongest first (all below what a log line earns).
CONF_WORKAROUND = 0.62  # "works with X", "I have to reduce X"
CONF_SLEEP_RESIDUAL = 0.6  # the engine's memory after sleep keeps rising
CONF_UNALLOCATED = 0.58  # GiB reserved but unallocated, quoted
CONF_WEIGHTS = 0.56  # the named model's weights exceed the named GPU
WEIGHTS_SHARE_NO_ROOM = 0.85  # weights per GPU above this share of it leave no room to start
CONF_HOST = 0.52  # host RAM, swap, pinned memory named
CONF_FRAGMENTATION = 0.52  # fragmentation named as the cause
CONF_KV_SHORT = 0.52  # the KV cache said to be too small / insufficient
CONF_BOUNDARY = 0.5  # an upgrade across a release that changed where memory goes
CONF_MULTIMODAL = 0.5
CONF_UTIL_HIGH = 0.5  # utilization ≥ 0.95 stated
CONF_SAMPLER = 0.5  # the sampler warm-up named
# the failure traced to one vLLM change (bisected, "introduced by"): below a mechanism the text
# names, which says what the change allocates
CONF_CODE_REGRESSION = 0.47
CONF_CAPTURE = 0.48
CONF_LOGPROBS = 0.46
CONF_COLOCATED = 0.45
CONF_WAKE_UP_CACHED = 0.5  # sleep-mode wake-up beside a trainer (its cached blocks)
CONF_NOT_FREED = 0.5  # memory said not to be released / freed
CONF_OTHER_PROCESS = 0.44
CONF_UTIL_LOW = 0.42
CONF_SINGLE_GPU = 0.4
CONF_STARTUP_SMALL_WEIGHTS = 0.4  # start-up failed with weights well within the GPU
CONF_SETTING = 0.35  # a setting merely named (max_model_len, max_num_seqs)
CONF_RUNTIME = 0.3
CONF_NOTHING = 0.2

_HIGH_UTIL = 0.95
_LOW_UTIL = 0.6


def rule_prose(s: Situation, out: Findings) -> None:
    """A memory failure stated only in words: rank the causes the text names."""
    p = s.parsed
    said = p.evidence("said_oom") or (p.ooms[0].evidence if p.ooms else None)
    if said is None:
        return
    if out.by_cause:
        # the log's own lines came first; the words weigh in only when those lines are an
        # out-of-memory message without any figure and left the cause open
        bare = all(o.tried_gib is None and o.free_gib is None for o in p.ooms)
        if not bare or max(f.confidence for f in out.by_cause.values()) > CONF_RUNTIME:
            return
    before = len(out.by_cause)
    _workarounds(s, out, said)
    _quoted_figures(s, out, said)
    _version_boundary(s, out, said)
    _mechanisms(s, out, said)
    _settings(s, out, said)
    if len(out.by_cause) == before:
        _nothing_to_go_on(s, out, said)


def _ev(s: Situation, *names: str) -> list[Evidence | None]:
    return [s.parsed.evidence(n) for n in names]


_NOT_FREED = re.compile(prose.NOT_FREED, re.IGNORECASE)


# --- fixes per cause, when the text gives no numbers -----------------------------------------


def _graph_fixes() -> list[Fix]:
    return [
        Fix(
            "--max-cudagraph-capture-size",
            "128",
            "captures fewer, smaller graphs (older releases: --max-seq-len-to-capture / "
            "--cudagraph-capture-sizes)",
            STEP_CUDAGRAPH,
        ),
        Fix(
            "--enforce-eager",
            None,
            "no CUDA graphs at all (slower decoding, no capture memory)",
            STEP_CUDAGRAPH + 0.1,
        ),
    ]


def _batch_fixes(s: Situation) -> list[Fix]:
    seqs = s.get("max_num_seqs")
    current = int(seqs) if seqs else default_max_num_seqs(s)
    return [
        Fix(
            "--max-num-seqs",
            str(fewer_seqs(current)),
            f"fewer sequences per step ({current} now"
            + ("" if seqs else ", vLLM's default")
            + "): their activations, sampler logits and any prompt logprobs shrink with them",
            STEP_MAX_NUM_SEQS,
        ),
        Fix(
            "--max-num-batched-tokens",
            "2048",
            "bounds the tokens one forward pass processes (a first step: the text gives no "
            "numbers to size it)",
            STEP_BATCHED_TOKENS,
        ),
    ]


def _max_len_fixes(s: Situation) -> list[Fix]:
    length = s.get("max_model_len")
    if length and int(length) > 2048:
        value = str(max(int(length) // 2, 2048))
        why = f"half of the {int(length):,} in force, as a first step"
    else:
        value = "8192"
        why = (
            "max_model_len defaults to the model's full context; 8192 is a first step (the "
            "text states neither the length nor the KV capacity)"
        )
    return [
        Fix(
            "--max-model-len",
            value,
            why + ": cap it to the real P99 prompt + output length",
            STEP_MAX_MODEL_LEN,
        ),
        Fix(
            "--kv-cache-dtype",
            "fp8",
            "halves the KV bytes per token",
            STEP_MAX_MODEL_LEN + 2,
        ),
    ]


def _util_fix(s: Situation, extra_gib: float, reason: str, fallback: str) -> Fix:
    return lower_util(s, extra_gib, reason) or Fix(
        "--gpu-memory-utilization", fallback, reason, STEP_UTIL
    )


def _stated_util_fix(s: Situation) -> Fix:
    """The utilization the text says it lowered to, else one that leaves a GiB more room."""
    changed = s.parsed.get("said_changed_util")
    if changed is not None:
        return Fix(
            "--gpu-memory-utilization",
            f"{float(changed):.2f}",
            "the value the text says avoided the out-of-memory",
            STEP_UTIL,
        )
    return _util_fix(s, 1.0, "the text says a lower utilization worked", "0.85")


def _host_fixes(s: Situation) -> list[Fix]:
    p = s.parsed
    fixes: list[Fix] = []
    if p.has("pinned_host_memory") or s.get("swap_space_gib") or p.has("swap_space_large"):
        fixes.append(
            Fix(
                "--swap-space",
                "0" if not p.has("cpu_swap_exhausted") else "2",
                "vLLM (V0) pins swap_space GiB of host RAM per GPU at start-up for preempted "
                "sequences without checking what is free",
                STEP_SWAP - 8.5,
            )
        )
    if s.get("cpu_offload_gib"):
        fixes.append(
            Fix("--cpu-offload-gb", "0", "offloaded weights live in host RAM", STEP_OFFLOAD)
        )
    if s.sleep_mode:
        fixes.append(
            Fix(
                "action",
                "with sleep mode level 1 each engine keeps its weights in host RAM while "
                "asleep: count engines × weights against the node's RAM, or sleep at level 2",
                "sleep mode moves GPU memory to the host",
                STEP_ACTION + 0.5,
            )
        )
    fixes.append(
        Fix(
            "action",
            "give the host/container more RAM or stop other memory users; check "
            "`dmesg | grep -i oom` and `free -h` while vLLM starts",
            "host RAM, not GPU memory, ran out",
            STEP_ACTION + 9,
        )
    )
    return fixes


# --- what the text states ---------------------------------------------------------------------


def _workarounds(s: Situation, out: Findings, said: Evidence) -> None:
    """The fix the writer says worked names the mechanism it relieved."""
    p = s.parsed
    builders = {
        "cuda_graph": _graph_fixes,
        "concurrency_or_batch": lambda: _batch_fixes(s),
        "kv_too_small_for_max_len": lambda: _max_len_fixes(s),
        "util_overshoot": lambda: [_stated_util_fix(s)],
        "weights_dont_fit": lambda: [
            Fix(
                "--tensor-parallel-size",
                str(max(s.tp * 2, 2)),
                "split the weights over more GPUs",
                tp_step(s, max(s.tp * 2, 2)),
            )
        ],
        "cpu_ram": lambda: _host_fixes(s),
        "fragmentation": lambda: _fragmentation_fixes(s),
        "multimodal_encoder": lambda: _multimodal_fixes(s),
    }
    for cause, build in builders.items():
        ev = p.evidence("said_fix_" + cause)
        if ev is None:
            continue
        out.add(
            cause,
            CONF_WORKAROUND,
            f"the text says changing {_LEVER_WORDS[cause]} avoided the out-of-memory",
            [said, ev],
            build(),
            "A workaround that helps names the memory it freed: "
            + _LEVER_WHY[cause]
            + " The text gives no log figures, so the values are first steps.",
        )


_LEVER_WORDS = {
    "cuda_graph": "CUDA-graph capture (--enforce-eager)",
    "concurrency_or_batch": "the number of sequences / the batch",
    "kv_too_small_for_max_len": "the context length",
    "util_overshoot": "gpu_memory_utilization",
    "weights_dont_fit": "the parallelism / weight placement",
    "cpu_ram": "vLLM's host swap space",
    "fragmentation": "the allocator configuration",
    "multimodal_encoder": "the multimodal limits",
}
_LEVER_WHY = {
    "cuda_graph": "eager mode removes the captured graphs' memory, which lives outside the "
    "KV budget.",
    "concurrency_or_batch": "fewer sequences per step shrink the activations, sampler logits "
    "and prompt logprobs that the start-up profile did not cover.",
    "kv_too_small_for_max_len": "a shorter max_model_len lets one request's KV cache fit.",
    "util_overshoot": "a lower utilization leaves room outside vLLM's budget.",
    "weights_dont_fit": "more GPUs hold fewer weights each.",
    "cpu_ram": "the swap space is pinned host RAM.",
    "fragmentation": "expandable segments let the allocator reuse fragmented blocks.",
    "multimodal_encoder": "the encoder's worst-case profile scales with the items per prompt.",
}


def _fragmentation_fixes(s: Situation) -> list[Fix]:
    fixes: list[Fix] = []
    if s.sleep_mode or s.parsed.has("said_colocated"):
        fixes.append(
            Fix(
                "action",
                "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the trainer's "
                "processes only (a vLLM engine with sleep mode cannot use it)",
                "the co-located trainer's offload/reload churn fragments its cached blocks",
                STEP_ACTION + 0.5,
            )
        )
        fixes.append(
            _util_fix(
                s,
                float(s.parsed.get("said_unallocated_gib") or 2.0),
                "leaves the fragmented amount outside vLLM's budget",
                "0.8",
            )
        )
    else:
        fixes.append(
            Fix(
                "PYTORCH_CUDA_ALLOC_CONF",
                "expandable_segments:True",
                "lets the caching allocator grow segments in place instead of leaving unusable "
                "remainders",
                STEP_ENV,
            )
        )
        util_fix = _util_fix(s, 1.0, "headroom for what fragmentation wastes", "0.85")
        fixes.append(Fix(util_fix.flag, util_fix.value, util_fix.why, STEP_ENV + 0.5))
    return fixes


def _multimodal_fixes(s: Situation) -> list[Fix]:
    return [
        Fix(
            "--limit-mm-per-prompt",
            '{"image": 0, "video": 0}',
            "for text-only use: no dummy images/videos are profiled and no encoder cache is "
            'reserved (otherwise {"image": 1} profiles one image per prompt)',
            STEP_MULTIMODAL,
        ),
        Fix(
            "--mm-processor-kwargs",
            '{"max_pixels": 1003520}',
            "caps the image size the vision encoder is profiled with (Qwen-VL style processors)",
            STEP_MULTIMODAL + 0.1,
        ),
        Fix(
            "--max-num-seqs",
            str(fewer_seqs(int(s.get("max_num_seqs") or default_max_num_seqs(s)))),
            "the encoder profile runs up to one maximal item per sequence",
            STEP_MAX_NUM_SEQS,
        ),
    ]


def _quoted_figures(s: Situation, out: Findings, said: Evidence) -> None:
    p = s.parsed
    # the engine's memory after sleep keeps rising: it no longer releases it
    growth = p.evidence("sleep_residual_growth")
    if growth is not None:
        first = p.get("sleep_residual_first_gib")
        last = p.get("sleep_residual_gib")
        out.add(
            "leak_or_other_process",
            CONF_SLEEP_RESIDUAL,
            f"the engine keeps more memory after each sleep ({first:g} → {last:g} GiB still in "
            "use): the co-located process runs out of what is left",
            [said, growth, p.evidence("sleep_residual_gib")],
            [
                Fix(
                    "action",
                    "compare the 'still in use' figure after each sleep across steps; upgrade "
                    "vLLM (or pin the release where it stayed flat) and report the growth",
                    "sleep mode should return the engine to its first residual; growth is "
                    "memory the engine no longer releases",
                    STEP_ACTION,
                ),
                _util_fix(
                    s,
                    max(float(last) - float(first), 1.0),
                    "while the growth is fixed, leave the residual outside the budget the "
                    "trainer plans with",
                    "0.8",
                ),
            ],
            "With sleep mode the trainer plans with the GPU minus the engine's residual; a "
            "residual that grows step by step (weights or buffers not released) eats the "
            "trainer's share until it runs out.",
        )
    # GiB reserved but unallocated, quoted: memory the allocator holds but cannot use
    unalloc = p.get("said_unallocated_gib")
    if unalloc is not None and float(unalloc) >= 1.0:
        out.add(
            "fragmentation",
            CONF_UNALLOCATED,
            f"{float(unalloc):.1f} GiB were reserved but unallocated when memory ran out: the "
            "allocator's cached blocks were too fragmented to serve the request",
            [said, p.evidence("said_unallocated_gib")],
            _fragmentation_fixes(s),
            "Reserved-but-unallocated memory belongs to the process yet cannot serve a large "
            "contiguous request; offload/reload and sleep/wake churn leaves such remainders.",
        )
    # utilization stated: at the top it leaves nothing outside the budget; low, nothing inside
    util = p.get("said_util")
    if util is not None and float(util) >= _HIGH_UTIL:
        out.add(
            "util_overshoot",
            CONF_UTIL_HIGH,
            f"gpu_memory_utilization {float(util):g} leaves almost nothing outside vLLM's budget",
            [said, p.evidence("said_util")],
            [
                Fix(
                    "--gpu-memory-utilization",
                    "0.90",
                    f"{float(util):g} hands the KV cache all the memory the profile did not "
                    "see used; CUDA graphs, non-torch memory and runtime allocations need the rest",
                    STEP_UTIL,
                )
            ],
            "vLLM's profile is approximate: at utilization ≥ 0.95 any allocation outside it "
            "(graphs, NCCL, a larger batch than profiled) has no room.",
        )
    elif util is not None and float(util) <= _LOW_UTIL:
        new = min(round(float(util) + 0.2, 2), 0.9)
        out.add(
            "kv_too_small_for_max_len",
            CONF_UTIL_LOW,
            f"gpu_memory_utilization {float(util):g} may leave too little for weights plus KV cache",
            [said, p.evidence("said_util")],
            [
                Fix(
                    "--gpu-memory-utilization",
                    f"{new:.2f}",
                    "utilization is the fraction for everything vLLM holds, weights included",
                    STEP_UTIL,
                ),
                *_max_len_fixes(s),
            ],
        )
    _weights_vs_gpu(s, out, said)


def _weights_vs_gpu(s: Situation, out: Findings, said: Evidence) -> None:
    """The named model's weights against the named GPU (the memory model or the name's
    parameter count; the GPU from the text or the user)."""
    w = s.weights_per_gpu_gib
    total = s.total_gib
    p = s.parsed
    if w is None or not total or p.has("said_runtime"):
        return  # a server that was serving had its weights loaded
    per_gpu = float(w.value)
    # at the default utilization (0.9) weights above 0.85 × the GPU leave under 5 % of it for
    # the activation peak and the KV cache together: not a configuration that starts
    if per_gpu < WEIGHTS_SHARE_NO_ROOM * float(total):
        return
    count = s.get("gpu_count")
    tp_known = s.known("tensor_parallel_size") is not None
    if (
        count
        and int(count) > s.tp
        and not tp_known
        and not p.has("said_single_gpu")
        and float(s.get("weights_total_gib") or per_gpu) / int(count)
        < WEIGHTS_SHARE_NO_ROOM * float(total)
    ):
        return  # the machine's GPUs hold it; the text does not say how many were used
    budget = budget_gib(s) or 0.9 * float(total)
    wt = float(s.get("weights_total_gib") or per_gpu * s.tp)
    origin = " (from the model's name)" if w.origin == "name" else ""
    out.add(
        "weights_dont_fit",
        CONF_WEIGHTS,
        (
            f"the weights (~{wt:.1f} GiB{origin}; {wt / int(count):.1f} GiB on each of "
            f"{int(count)} GPUs) leave no room in {float(total):.1f} GiB per GPU"
            if count and int(count) > s.tp and not tp_known
            else f"the weights (~{per_gpu:.1f} GiB per GPU{origin}) do not fit in "
            f"{float(total):.1f} GiB"
            + (f" with tensor parallelism {s.tp}" if s.tp > 1 else " on one GPU")
        ),
        [
            said,
            w.evidence,
            s.parsed.evidence("said_gpu_name"),
            s.parsed.evidence("said_single_gpu"),
        ],
        weights_fixes(s, wt, budget)
        or [
            Fix(
                "--tensor-parallel-size",
                str(max(s.tp * 2, 2)),
                "split the weights over more GPUs",
                STEP_TP,
            )
        ],
        "vLLM loads the whole checkpoint onto each tensor-parallel rank's share; with the "
        "default --tensor-parallel-size 1 it uses one GPU whatever the machine has.",
    )


def _version_boundary(s: Situation, out: Findings, said: Evidence) -> None:
    p = s.parsed
    old, new = p.get("said_version_old"), p.get("said_version_new")
    if not old or not new:
        return
    before, after = prose.version_tuple(str(old)), prose.version_tuple(str(new))
    for boundary, cause, what in prose.VERSION_BOUNDARIES:
        if before < boundary <= after:
            if boundary == V1_DEFAULT and _v1_default_seqs(s):
                # the V1 default also raised max_num_seqs to 1024 on ≥ 70 GiB GPUs (§3.2): the
                # start-up profile and the sampler warm-up run that many sequences, so with the
                # setting left at its default that is the likelier cost; graphs come second
                out.add(
                    "concurrency_or_batch",
                    CONF_BOUNDARY,
                    f"works on {old} but runs out of memory on {new}: vLLM 0.8's V1 engine "
                    "raised the default max_num_seqs to 1024 on large GPUs, and its profile "
                    "and sampler warm-up run that many sequences",
                    [said, p.evidence("said_version_old")],
                    _batch_fixes(s),
                    "An upgrade that starts to fail at the same settings points at what the new "
                    "release allocates that the old one did not; max_num_seqs was not set, so "
                    "the new default applies.",
                )
                out.add(
                    cause,
                    CONF_BOUNDARY - 0.05,
                    f"or: {what}",
                    [said, p.evidence("said_version_old")],
                    _graph_fixes(),
                )
                return
            out.add(
                cause,
                CONF_BOUNDARY,
                f"works on {old} but runs out of memory on {new}: {what}",
                [said, p.evidence("said_version_old")],
                _graph_fixes()
                + [
                    _util_fix(
                        s,
                        1.0,
                        "or leave the graphs' memory outside the budget (vLLM's 1–3 GiB rule, "
                        "low end)",
                        "0.85",
                    )
                ],
                "An upgrade that starts to fail at the same settings points at what the new "
                "release allocates that the old one did not.",
            )
            return


# the release that made the V1 engine the default (with its larger max_num_seqs default)
V1_DEFAULT = (0, 8, 0)


def _v1_default_seqs(s: Situation) -> bool:
    """Whether max_num_seqs was left at its default on a GPU where V1 makes that 1024 (≥ 70
    GiB, or not known)."""
    if s.get("max_num_seqs") is not None:
        return False
    total = s.total_gib
    return total is None or total >= 70


def _mechanisms(s: Situation, out: Findings, said: Evidence) -> None:
    p = s.parsed
    if p.has("said_kv_short"):
        out.add(
            "kv_too_small_for_max_len",
            CONF_KV_SHORT,
            "the text says the KV cache is too small: it cannot hold the context length asked for",
            [said, p.evidence("said_kv_short"), p.evidence("said_max_len")],
            _max_len_fixes(s),
            "vLLM refuses to start unless one request of max_model_len tokens fits the KV "
            "cache, and max_model_len defaults to the model's whole context: cap it to the "
            "real prompt + output length, or give the KV cache more room.",
        )
    if p.has("said_host_ram") or p.has("pinned_host_memory") or p.has("said_gpu_not_full"):
        out.add(
            "cpu_ram",
            CONF_HOST,
            "the text places the failure in host memory (RAM, swap, pinned or mapped memory, "
            "a container's limit), or says the GPU was not full when memory ran out",
            [said, *_ev(s, "said_host_ram", "pinned_host_memory", "said_gpu_not_full")],
            _host_fixes(s),
            "vLLM also needs host RAM: checkpoints are read (often memory-mapped) through it, "
            "V0 pins --swap-space GiB per GPU, --cpu-offload-gb and sleep mode park weights in "
            "it, and each API-server process holds its own copy of the tokenizer and buffers.",
        )
    if p.has("said_wake_up") and (p.has("said_colocated") or p.has("said_empty_cache")):
        # the trainer frees its tensors, but PyTorch's caching allocator keeps the blocks
        # reserved; sleep mode's wake-up maps memory through its own allocator and finds none
        out.add(
            "fragmentation",
            CONF_WAKE_UP_CACHED,
            "vLLM's wake-up ran out of memory beside a trainer: memory the trainer freed stays "
            "reserved in PyTorch's cache, where vLLM's sleep-mode allocator cannot reach it",
            [said, *_ev(s, "said_wake_up", "said_empty_cache", "said_colocated")],
            [
                Fix(
                    "action",
                    "call torch.cuda.empty_cache() (after gc.collect()) in the trainer before "
                    "wake_up, so its cached blocks go back to the driver",
                    "blocks reserved but unallocated by the trainer are invisible to vLLM's "
                    "cumem allocator; expandable_segments does not apply with sleep mode",
                    STEP_ACTION,
                ),
                _util_fix(
                    s,
                    0.1 * float(s.total_gib or 80.0),
                    "if the trainer's live tensors, not its cache, fill the rest",
                    "0.8",
                ),
            ],
            "Sleep mode releases vLLM's memory through its own allocator; on wake-up it maps "
            "it back. Whatever the trainer's caching allocator still holds, even unused, is "
            "not free for that.",
        )
    if p.has("said_fragmentation"):
        out.add(
            "fragmentation",
            CONF_FRAGMENTATION,
            "the text names allocator fragmentation as the cause",
            [said, p.evidence("said_fragmentation")],
            _fragmentation_fixes(s),
            "Fragmentation leaves free memory in pieces too small for the next large "
            "allocation (weight post-processing, graph capture, a trainer's reload).",
        )
    if p.has("said_multimodal") or is_multimodal_model(s):
        out.add(
            "multimodal_encoder",
            CONF_MULTIMODAL,
            "the text involves images/video: the vision encoder's worst-case profile (or a "
            "large image) needs memory outside the KV cache",
            [said, p.evidence("said_multimodal")],
            _multimodal_fixes(s),
            "Before sizing the KV cache vLLM profiles the encoder on maximal dummy images and "
            "videos for many sequences and reserves an encoder cache, even for a checkpoint "
            "used only for text.",
        )
    if p.has("said_sampler"):
        out.add(
            "concurrency_or_batch",
            CONF_SAMPLER,
            "the text places the failure in the sampler warm-up",
            [said, p.evidence("said_sampler")],
            _batch_fixes(s),
            "vLLM warms up the sampler with one dummy request per max_num_seqs; their logits "
            "(sequences × vocabulary) come on top of the profiled peak.",
        )
    if p.has("said_capture"):
        out.add(
            "cuda_graph",
            CONF_CAPTURE,
            "the text places the failure in CUDA-graph capture",
            [said, p.evidence("said_capture")],
            _graph_fixes()
            + [
                _util_fix(
                    s,
                    1.0,
                    "or leave the graphs' memory outside the budget (vLLM's 1–3 GiB rule, low end)",
                    "0.85",
                )
            ],
            "Graphs are captured after the KV cache took its share; their memory must fit in "
            "what gpu_memory_utilization leaves outside vLLM's budget.",
        )
    if p.has("said_code_regression"):
        out.add(
            "other",
            CONF_CODE_REGRESSION,
            "the text traces the failure to a change in the code (a regression, or a bug a "
            "patch fixed), not to a setting",
            [said, p.evidence("said_code_regression")],
            [
                Fix(
                    "action",
                    "run a vLLM release that carries the fix (or pin the last one before the "
                    "change that broke it); lowering --gpu-memory-utilization or --max-num-seqs "
                    "only works around it",
                    "the settings were not what changed",
                    STEP_ACTION,
                ),
                _util_fix(s, 1.0, "a stop-gap until the fix is released", "0.85"),
            ],
            "When the failure comes and goes with a code change at unchanged settings, the "
            "memory the code takes is the cause; the fix is in the code, the settings only buy "
            "room.",
        )
    if p.has("said_logprobs"):
        out.add(
            "other",
            CONF_LOGPROBS,
            "requests with prompt logprobs / full-vocabulary logits allocate memory the start-up "
            "profile never measured",
            [said, p.evidence("said_logprobs")],
            [
                Fix(
                    "action",
                    "cap or reject prompt_logprobs (and large logprobs) in requests, or send "
                    "such requests with fewer prompts at once",
                    "prompt logprobs materialise prompt length × vocabulary floats per request",
                    STEP_ACTION,
                ),
                _util_fix(s, 1.0, "headroom outside the budget for the logits", "0.85"),
            ],
            "vLLM profiles the sampler without logprobs; a request asking for prompt logprobs "
            "computes logits for every prompt token, outside the KV budget.",
        )
    if p.has("said_colocated"):
        out.add(
            "util_overshoot",
            CONF_COLOCATED,
            "vLLM shares the GPU with a trainer: its utilization must leave the trainer's share",
            [said, p.evidence("said_colocated")],
            [
                _util_fix(
                    s,
                    0.2 * float(s.total_gib or 80.0),
                    "vLLM takes utilization × total whatever else runs; the policy/trainer "
                    "needs the rest (a first step: the text gives no trainer figures)",
                    "0.7",
                )
            ],
            "In co-located RL (GRPO/PPO) the engine and the trainer share each GPU; vLLM's "
            "default 0.9 leaves the trainer almost nothing.",
        )
    if p.has("said_other_process"):
        held = p.evidence("said_other_process")
        # memory said not to be freed names the mechanism itself; a process merely mentioned
        # is weaker than co-location with a trainer
        named = held is not None and _NOT_FREED.search(held.text) is not None
        out.add(
            "leak_or_other_process",
            CONF_NOT_FREED if named else CONF_OTHER_PROCESS,
            "another process or an earlier engine still holds GPU memory",
            [said, p.evidence("said_other_process")],
            [
                Fix(
                    "action",
                    "free the previous engine before creating the next (del llm; "
                    "gc.collect(); torch.cuda.empty_cache()) or run each in its own process; "
                    "check nvidia-smi for leftovers",
                    "memory held elsewhere is not available to the new engine",
                    STEP_ACTION,
                )
            ],
        )


def _settings(s: Situation, out: Findings, said: Evidence) -> None:
    p = s.parsed
    count = s.get("gpu_count")
    if p.has("said_single_gpu") and count and int(count) > s.tp:
        out.add(
            "weights_dont_fit",
            CONF_SINGLE_GPU,
            f"vLLM used one GPU of the {int(count)} the machine has",
            [said, p.evidence("said_single_gpu")],
            [
                Fix(
                    "--tensor-parallel-size",
                    str(min(int(count), 8)),
                    "vLLM uses only --tensor-parallel-size GPUs (default 1)",
                    tp_step(s, min(int(count), 8)),
                )
            ],
        )
    w, total = s.weights_per_gpu_gib, s.total_gib
    if p.has("said_startup") and w is not None and total and float(w.value) < 0.5 * float(total):
        out.add(
            "concurrency_or_batch",
            CONF_STARTUP_SMALL_WEIGHTS,
            f"start-up ran out of memory although the weights (~{float(w.value):.1f} GiB) take "
            f"under half of the {float(total):.1f} GiB GPU: the profiling batch for vLLM's "
            "default number of sequences is the usual consumer",
            [said, p.evidence("said_startup"), w.evidence],
            _batch_fixes(s),
            "After the weights vLLM profiles one batch of max_num_batched_tokens over "
            "max_num_seqs sequences (an encoder's dummy inputs included) and warms the sampler "
            "up for every sequence; with small weights that peak, not the weights, fills the GPU.",
        )
    if p.has("said_max_len"):
        out.add(
            "kv_too_small_for_max_len",
            CONF_SETTING,
            "the text names the context length",
            [said, p.evidence("said_max_len")],
            _max_len_fixes(s),
        )
    if p.has("said_batch"):
        out.add(
            "concurrency_or_batch",
            CONF_SETTING,
            "the text names the batch / number of sequences",
            [said, p.evidence("said_batch")],
            _batch_fixes(s),
        )
    if p.has("said_runtime"):
        out.add(
            "util_overshoot",
            CONF_RUNTIME,
            "memory ran out while serving: what allocates at runtime lives outside the KV "
            "budget, and the utilization left it too little",
            [said, p.evidence("said_runtime")],
            [
                _util_fix(
                    s,
                    1.0,
                    "leaves room outside the budget for CUDA graphs, non-torch memory and "
                    "runtime allocations",
                    "0.85",
                ),
                *_batch_fixes(s)[:1],
            ],
            "At runtime the KV pool is already allocated; anything that still allocates must "
            "fit in (1 − utilization) × total.",
        )


def _nothing_to_go_on(s: Situation, out: Findings, said: Evidence) -> None:
    out.add(
        "util_overshoot",
        CONF_NOTHING,
        "a memory failure is stated, but the text gives nothing to tell its cause apart",
        [said],
        [
            Fix(
                "action",
                "keep the whole log from start-up and run the doctor on it: the lines "
                "'Model loading took', 'Available KV cache memory' / '# GPU blocks', the error "
                "and its traceback tell the phase and the numbers; say which GPU, model and "
                "flags were used (--gpu, --model, --command)",
                "the checklist starts by measuring",
                STEP_ACTION,
            ),
            _util_fix(
                s,
                1.0,
                "the checklist's first lever: headroom outside vLLM's budget",
                "0.85",
            ),
        ],
        "Without the log the doctor can only offer the checklist's order: measure, then "
        "utilization, max_model_len, max_num_seqs, the batch tokens, fp8 KV, a quantized "
        "checkpoint, more GPUs.",
    )


# the settings the checklist turns before the weights: each addresses one cause
_SETTING_CAUSES = (
    "kv_too_small_for_max_len",
    "cuda_graph",
    "concurrency_or_batch",
    "util_overshoot",
)
CONF_ELIMINATED = 0.58  # the failure outlived the settings that shrink everything but weights
_TRIED_DEMOTION = 0.6


def rule_tried_in_vain(s: Situation, out: Findings) -> None:
    """Settings the text says were changed without avoiding the failure rule their causes
    down; when two or more of the checklist's settings (context length, CUDA graphs, batch,
    utilization) did not help, what is left is the weights themselves."""
    p = s.parsed
    if not (p.has("said_oom") or p.ooms) or not out.by_cause:
        return
    if any(p.has("said_fix_" + cause) for cause in CAUSES):
        return  # something the writer changed did help: that names the cause
    tried = {cause for cause in _SETTING_CAUSES if p.has("said_tried_" + cause)}
    if p.has("said_tried_all"):
        # "tried combinations of the above parameters, all of which fail": every setting named
        if p.has("said_max_len"):
            tried.add("kv_too_small_for_max_len")
        if p.has("said_batch"):
            tried.add("concurrency_or_batch")
        if p.has("said_capture") or s.get("enforce_eager"):
            tried.add("cuda_graph")
        if p.get("said_util") is not None or s.util_stated:
            tried.add("util_overshoot")
    if len(tried) < 2:
        return
    for cause in tried:
        finding = out.by_cause.get(cause)
        if finding is not None:
            finding.confidence *= _TRIED_DEMOTION
    evidence = [
        p.evidence("said_oom") or (p.ooms[0].evidence if p.ooms else None),
        p.evidence("said_tried_all"),
        *(p.evidence("said_tried_" + cause) for cause in _SETTING_CAUSES),
    ]
    w = s.weights_per_gpu_gib
    budget = budget_gib(s)
    fixes: list[Fix] = []
    if w is not None and budget:
        wt = float(s.get("weights_total_gib") or float(w.value) * s.tp)
        fixes = weights_fixes(s, wt, budget)
        evidence.append(w.evidence)
    if not fixes:
        fixes = [
            Fix(
                "action",
                "a quantized checkpoint of the model (AWQ/GPTQ 4-bit, or --quantization fp8 on "
                "GPUs that support it)",
                "halves to quarters the weights on each GPU",
                STEP_ACTION,
            ),
            Fix(
                "--tensor-parallel-size",
                str(max(s.tp * 2, 2)),
                "splits the weights over more GPUs",
                STEP_TP,
            ),
        ]
    names = {
        "kv_too_small_for_max_len": "the context length",
        "cuda_graph": "CUDA graphs",
        "concurrency_or_batch": "the batch",
        "util_overshoot": "the utilization",
    }
    changed = [names[c] for c in _SETTING_CAUSES if c in tried]
    listed = ", ".join(changed[:-1]) + " and " + changed[-1]
    out.add(
        "weights_dont_fit",
        CONF_ELIMINATED,
        f"the failure outlived changes to {listed}: the weights, which none of them shrink, "
        "leave no room",
        evidence,
        fixes,
        "Lowering max_model_len, disabling CUDA graphs and shrinking the batch each cut one "
        "term of vLLM's memory; when the failure stays at the same point through all of them, "
        "the weights (plus the fixed non-torch overhead) are what fills the GPU.",
    )
