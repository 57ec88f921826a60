"""The one catalogue of vLLM / PyTorch log and error texts that oomguard understands.

Each :class:`Pattern` names the message it matches, a cheap lower-case trigger (the regex runs
only on records containing one of its triggers), the fields its named groups set, the
signature it raises and the startup phase it marks. Texts and their version ranges are those
of ``docs/memory-model.md`` §2, §5.4, §7.2, §9, §11 (read from the published vLLM wheels 0.9.2 …
0.33.0 and the installed 0.32.0 CPU build), plus PyTorch's allocator messages (old
``(GPU 0; X total capacity; …)`` and new ``GPU 0 has a total capacity of …`` forms). Number
formats differ by version (``%.2f``, ``format_gib`` without trailing zeros, ``%.4f``, thousands
separators), so every number group accepts all of them.

Group names are field names of :data:`oomguard.logs.parsed.FIELD_RULES`; a group ``X_unit``
next to a ``*_gib`` group gives the unit of ``X`` (GiB when absent).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from oomguard.logs import prose
from oomguard.logs.parsed import Evidence, Phase

NUM = r"-?\d[\d,]*(?:\.\d+)?"
UNIT = r"(?:[KMGT]i?B|B|bytes)"


def _mem(name: str) -> str:
    return rf"(?P<{name}>{NUM})\s?(?P<{name}_unit>{UNIT})"


@dataclass(frozen=True)
class Pattern:
    """One message shape: run ``regex`` on records containing any of ``triggers``."""

    name: str
    triggers: tuple[str, ...]
    regex: re.Pattern[str]
    signature: str | None = None
    phase: Phase | None = None  # the log reached this phase
    frame_phase: Phase | None = None  # a traceback frame inside this phase
    failure_phase: Phase | None = None  # the failure happened in this phase (explicit)
    handler: str | None = None  # special handling in the parser
    first_only: bool = False  # run once per log (costly patterns on common words)
    # inside a traceback, a frame of this kind of code ("mm_encoder": a vision/audio encoder,
    # "activation": an op whose memory grows with the batch); the parser remembers the kinds
    # the failing traceback ran through
    frame_kind: str | None = None
    # the tolerant form of the message (see :func:`tolerant`): tried when ``regex`` does not
    # match, and on this record joined with the next ones when the message was wrapped
    loose: re.Pattern[str] | None = None
    # the words ``loose`` cannot match without (lower case): a cheap test before running it
    loose_words: tuple[str, ...] = ()

    def loose_search(self, text: str, lower: str) -> re.Match[str] | None:
        """Search ``text`` (``lower`` its lower-case form) with the tolerant form, if any."""
        if self.loose is None or not all(w in lower for w in self.loose_words):
            return None
        return self.loose.search(text)


# --- tolerant forms of the known messages --------------------------------------------------------
# Reporters quote vLLM's and PyTorch's messages condensed, re-wrapped, with parentheses and
# punctuation dropped, numbers elided ("(...)", "N GiB") and connectives paraphrased ("<" for "is
# less than"), inside Markdown quotes and backticks. A template names a message by its core words;
# :func:`tolerant` compiles it so that anything but letters and digits may separate the words.
#
# Template syntax: ``word`` a literal word (case-insensitive); ``[words]`` optional words;
# ``{field}`` an optional number (absent, or elided as ``...``/``…``/``N``/``X``/``?``);
# ``{field:mem}`` the same with its unit (GiB, GB, MiB … into ``field_unit``); ``<less>``,
# ``<larger>`` a comparison in words or symbols; ``*`` a short run of anything (a device name).
_GAP = r"[\W_]{0,12}"
_ELIDED = r"(?:\.{2,}|…|\b[NnXx]\b|\?+)"
_LOOSE_UNIT = r"(?:[KMGT]i?B|[KMGT]\b|bytes)"
_CONNECTIVES = {
    "less": r"(?:(?:is|are|was)[\W_]+)?(?:less|smaller|lower|fewer)[\W_]+than|<|below",
    "larger": r"(?:(?:is|are|was)[\W_]+)?(?:larger|greater|bigger|more)[\W_]+than|>|exceeds?|above",
}
_TEMPLATE_TOKEN = re.compile(r"\{(\w+)(?::(mem))?\}|<(\w+)>|\[([^\]]*)\]|(\*)|([A-Za-z0-9]+)")


def _tolerant_parts(template: str) -> str:
    out: list[str] = []
    for m in _TEMPLATE_TOKEN.finditer(template):
        field, mem, conn, optional, star, word = m.groups()
        if field:
            unit = rf"(?:[\W_]{{0,4}}(?P<{field}_unit>{_LOOSE_UNIT}))?" if mem else ""
            # with a unit, the number may be gone and its unit left ("( / GiB)")
            number = rf"(?:(?P<{field}>{NUM})|{_ELIDED})" + ("?" if mem else "")
            out.append(rf"(?:{number}{unit}{_GAP})?")
        elif conn:
            out.append(rf"(?:{_CONNECTIVES[conn]}){_GAP}")
        elif optional is not None:
            out.append(rf"(?:{_tolerant_parts(optional)})?")
        elif star:
            # whole words that are not numbers ("device", "cuda:0"), or a device index ("cuda 0")
            word_or_index = r"(?:(?![\d.…])[^\s()]{1,24}(?![^\s()])|\d{1,2}(?![\d./,]))"
            out.append(rf"(?:{word_or_index}{_GAP}){{0,3}}")
        else:
            out.append(rf"{re.escape(word)}{_GAP}")
    return "".join(out)


def required_words(template: str) -> tuple[str, ...]:
    """The literal words of a template outside its optional parts, lower-cased."""
    outside = re.sub(r"\[[^\]]*\]|\{[^}]*\}|<\w+>", " ", template)
    return tuple(dict.fromkeys(w.lower() for w in re.findall(r"[A-Za-z0-9]+", outside)))


def tolerant(template: str) -> re.Pattern[str]:
    """Compile a message template into a regex tolerant of quoting and paraphrase.

    Words must appear in order, separated by anything but letters and digits (punctuation,
    parentheses, backticks, Markdown ``>``, a line break joined into a space); number slots are
    optional and take elisions; a number group is None when the text omits the number.
    """
    # no word boundary before the first word: a wrap joined without a space ("model'smax seq")
    return re.compile(_tolerant_parts(template), re.IGNORECASE)


def _p(
    name: str,
    triggers: str | tuple[str, ...],
    regex: str,
    *,
    flags: int = 0,
    loose: str | None = None,
    loose_triggers: tuple[str, ...] = (),
    **kwargs: Any,
) -> Pattern:
    trig = ((triggers,) if isinstance(triggers, str) else triggers) + loose_triggers
    return Pattern(
        name=name,
        triggers=tuple(dict.fromkeys(t.lower() for t in trig)),
        regex=re.compile(regex, flags),
        loose=tolerant(loose) if loose else None,
        loose_words=required_words(loose) if loose else (),
        **kwargs,
    )


# An answered generation request, as the engine logs it: uvicorn's access log (vLLM's API server)
# and llama-server's request log. serve counts them to place a crash before or after the first
# request the engine answered.
REQUEST_ANSWERED = re.compile(
    r'"POST /v1/(?:chat/)?completions HTTP/[\d.]+" 200\b'
    r"|request: POST /v1/(?:chat/)?completions \S+ 200\b"
)

PATTERNS: tuple[Pattern, ...] = (
    # --- version and engine -----------------------------------------------------------------
    _p(
        "version_api_server",
        "server version",
        r"vLLM API server version v?(?P<vllm_version>\d+\.\d+[\w.+-]*)",
    ),
    _p(
        "version_engine_init",
        "llm engine (v",
        r"LLM engine \(v(?P<vllm_version>\d+\.\d+[\w.+-]*)\)",
    ),
    _p(
        "version_generic",
        ("vllm version", "vllm==", "vllm_version", "vllm-version"),
        r"(?i:vllm)[ _=-]{1,2}(?:version)?\s*[:=]?\s*v?(?P<vllm_version>\d+\.\d+\.\d+[\w.+-]*)",
    ),
    _p("version_bare", "version ", r"^\s*version:? v?(?P<vllm_version>\d+\.\d+\.\d+[\w.+-]*)\s*$"),
    _p(
        "version_egg",
        "site-packages/vllm-",
        r"site-packages/vllm-(?P<vllm_version>\d+\.\d+\.\d+[\w.]*?)-py\d",
    ),
    _p("version_image", "vllm-openai:v", r"vllm-openai:v(?P<vllm_version>\d+\.\d+\.\d+[\w.+-]*)"),
    _p(
        "engine_v0",
        ("v0 llm engine", "falling back to v0", "vllm_use_v1=0"),
        r"Initializing a V0 LLM engine|Falling back to V0|VLLM_USE_V1=0",
        handler="engine_v0",
    ),
    _p(
        "engine_v0_frames",
        ("vllm/worker/", "raise_if_cache_size_invalid", "determine_num_available_blocks"),
        # code only the V0 engine has: its worker package (V1's lives under vllm/v1/worker/)
        # and the V0 cache-size check
        r"(?<!v1)/vllm/worker/\w+\.py|\braise_if_cache_size_invalid\b"
        r"|\bdetermine_num_available_blocks\b",
        handler="engine_v0",
    ),
    _p(
        "engine_v1",
        ("v1 llm engine", "vllm/v1/", "enginecore"),
        r"Initializing a V1 LLM engine|vllm/v1/|EngineCore",
        handler="engine_v1",
    ),
    # --- arguments --------------------------------------------------------------------------
    _p(
        "non_default_args",
        "non-default args",
        r"non-default args: (?P<payload>\{.*\})",
        handler="args_dict",
    ),
    _p("engine_config", "with config:", r"with config: (?P<payload>.*)", handler="args_pairs"),
    _p(
        "namespace_args",
        "namespace(",
        r"args: Namespace\((?P<payload>.*?)\)?\s*$",
        handler="args_namespace",
    ),
    _p(
        "command_line",
        ("vllm serve", "vllm.entrypoints", "docker run", "podman run"),
        r"(?P<payload>(?:vllm serve|-m\s+vllm\.entrypoints\.[\w.]+"
        r"|(?:docker|podman)\s+run\s.*)(?:\s.*)?)$",
        handler="args_cmdline",
    ),
    _p("llm_constructor", "llm(", r"\bLLM\((?P<payload>.*)\)", handler="args_kwargs"),
    _p(
        "load_model_start",
        "starting to load model",
        r"Starting to load model (?P<model>\S+?)(?:\.\.\.)?\s*$",
        phase=Phase.WEIGHT_LOADING,
    ),
    _p("max_model_len_used", "using max model len", r"Using max model len (?P<max_model_len>\d+)"),
    _p(
        "chunked_prefill",
        "max_num_batched_tokens=",
        r"Chunked prefill is enabled with max_num_batched_tokens=(?P<max_num_batched_tokens>\d+)",
        signature="chunked_prefill_on",
    ),
    _p(
        "block_size_forced",
        ("block size to",),
        r"(?:Forcing|Setting) (?:kv cache|attention) block size to (?P<block_size>\d+)",
    ),
    # --- GPU --------------------------------------------------------------------------------
    _p(
        "nvidia_smi_row",
        ("nvidia", "tesla", "quadro"),
        r"^\|\s+\d+\s+(?P<gpu_name>(?:NVIDIA|Tesla|Quadro)[\w -]*?)\s+(?:On|Off)\s+\|",
    ),
    _p(
        "gpu_listing",
        ("gpu 0:", "gpu 1:", "gpu 2:", "gpu 3:"),
        r"\bGPU \d+: (?P<gpu_name>(?:NVIDIA|Tesla|Quadro|AMD|Instinct)[\w .-]*?)\s*(?:\(UUID|$)",
    ),
    _p(
        "device_name",
        ("device name", "device_name"),
        r"(?i:device[_ ]name)\s*[:=]\s*['\"]?"
        r"(?P<gpu_name>(?:NVIDIA|Tesla|Quadro|AMD|Intel)[\w .-]*?)['\"]?\s*(?:,|\)|$)",
    ),
    _p(
        "nvidia_smi_process",
        ("mib",),
        # a row of nvidia-smi's process table: "|  0   N/A  N/A   1234   C   python3   20000MiB |"
        # (older drivers omit the GI/CI columns)
        r"^\|\s+(?P<gpu>\d+)\s+(?:N/A\s+N/A\s+|\d+\s+\d+\s+)?(?P<pid>\d+)\s+(?:C|G|C\+G|M|M\+C)\s+"
        r"(?P<name>\S.*?)\s+(?P<mib>\d+)\s?MiB\s*\|",
        handler="gpu_process",
    ),
    _p(
        "compute_apps_csv",
        ("mib",),
        # nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv
        r"^(?P<pid>\d+),\s*(?P<name>[^,]+?),\s*(?P<mib>\d+)\s?MiB\s*$",
        handler="gpu_process",
    ),
    _p(
        "ps_engine_row",
        ("vllm",),
        # a `ps aux` row of a running vLLM server or engine (not the grep that found it):
        # USER PID %CPU %MEM VSZ RSS TTY STAT START TIME COMMAND
        r"^\S+\s+(?P<pid>\d+)\s+\d+(?:\.\d+)?\s+"
        r"\d+(?:\.\d+)?\s+\d+\s+\d+\s+\S+\s+\S+\s+\S+\s+\S+\s+"
        r"(?!grep\b)(?P<name>\S*(?:python\S*\s+(?:-m\s+)?vllm|vllm\s+serve|VLLM::)\S*.*)$",
        handler="ps_engine",
    ),
    # --- startup snapshot and the free-memory check (§2.1) ----------------------------------
    _p(
        "startup_check_gpu",
        "on startup is less",
        r"Free memory on device(?: \S+)? "
        rf"\((?P<startup_free_gib>{NUM})/(?P<startup_total_gib>{NUM}) GiB\) on startup is less"
        rf"(?: than desired GPU memory utilization \((?P<gpu_memory_utilization>{NUM}), "
        rf"(?P<requested_gib>{NUM}) GiB\))?",
        signature="startup_check_failed",
        phase=Phase.STARTUP,
        failure_phase=Phase.STARTUP,
        loose="free memory on * ({startup_free_gib}/{startup_total_gib:mem}) [on startup] <less>"
        " [the] desired [gpu] [memory] utilization ({gpu_memory_utilization}, {requested_gib:mem})",
        loose_triggers=("free memory", "desired"),
    ),
    _p(
        "startup_check_cpu",
        "on startup is less than desired cpu",
        rf"Available memory on node \d+ \((?P<startup_free_gib>{NUM})/(?P<startup_total_gib>{NUM}) "
        r"GiB\) on startup is less than desired CPU memory utilization"
        rf"(?: \((?P<gpu_memory_utilization>{NUM}), (?P<requested_gib>{NUM}) GiB\))?",
        signature="startup_check_failed",
        phase=Phase.STARTUP,
        failure_phase=Phase.STARTUP,
        handler="platform_cpu",
        loose="available memory on node {n} ({startup_free_gib}/{startup_total_gib:mem})"
        " [on startup] <less> [the] desired cpu [memory] utilization",
        loose_triggers=("available memory", "desired"),
    ),
    _p(
        "startup_external_weights",
        "externally held weights on device",
        r"Externally held weights on device \S+ "
        rf"\((?P<ext>{NUM})/(?P<startup_total_gib>{NUM}) GiB\)",
        signature="startup_check_failed",
        phase=Phase.STARTUP,
        failure_phase=Phase.STARTUP,
    ),
    _p(
        "cpu_kv_allocation_failed",
        "on kv cache allocation is less",
        rf"Available memory on node \d+ \((?P<startup_free_gib>{NUM})/(?P<startup_total_gib>{NUM}) "
        r"GiB\) on kv cache allocation is less"
        # the pool it asked for, and (auto-sized) the worker's request it was taken from:
        # requested − the pool is the worker's resident memory outside the KV cache
        r"(?: than requested memory for kv "
        rf"\((?P<cpu_kv_request_gib>{NUM})(?:/(?P<requested_gib>{NUM}))? GiB\))?",
        signature="cpu_kv_allocation_failed",
        failure_phase=Phase.KV_ALLOCATION,
        handler="platform_cpu",
    ),
    _p(
        "startup_suggestion",
        "on startup. desired",
        r"Free memory on device(?: \S+)? "
        rf"\((?P<startup_free_gib>{NUM})/(?P<startup_total_gib>{NUM}) GiB\) on startup\. "
        rf"Desired GPU memory utilization is \((?P<gpu_memory_utilization>{NUM}), "
        rf"(?P<requested_gib>{NUM}) GiB\)",
        phase=Phase.CUDA_GRAPH_CAPTURE,
    ),
    _p(
        "usage_suggestion_old",
        "for weight,",
        rf"Actual usage is (?P<weights_gib>{NUM}) GiB for weight, (?P<activation_gib>{NUM}) GiB "
        rf"for peak activation, (?P<non_torch_gib>{NUM}) GiB for non-torch memory, and "
        rf"(?P<cudagraph_actual_gib>{NUM}) GiB for CUDAGraph memory",
    ),
    _p(
        "usage_suggestion_new",
        "for consumed memory",
        rf"Actual usage is (?P<total_consumed_gib>{NUM}) GiB for consumed memory \(weights \+ "
        rf"non-torch\), (?P<activation_gib>{NUM}) GiB for peak activation, and "
        rf"(?P<cudagraph_actual_gib>{NUM}) GiB for CUDAGraph memory",
    ),
    _p(
        # V0 0.6.x: "Memory profiling results: total_gpu_memory=79.15GiB
        # initial_memory_usage=68.01GiB peak_torch_memory=…": what the GPU held before this
        # engine loaded anything
        "profiling_results_v06",
        "initial_memory_usage",
        rf"total_gpu_memory=(?P<startup_total_gib>{NUM}) ?GiB,? "
        rf"initial_memory_usage=(?P<initial_used_gib>{NUM}) ?GiB",
    ),
    _p(
        "debug_initial_free",
        "requested memory:",
        rf"Initial free memory: (?P<startup_free_gib>{NUM}) ?GiB; Requested memory: "
        rf"(?P<gpu_memory_utilization>{NUM}) \(util\), (?P<requested_gib>{NUM}) ?GiB",
    ),
    # --- weights (§2.2) -----------------------------------------------------------------------
    _p(
        "model_loading_took",
        "model loading took",
        rf"Model loading took (?P<weights_gib>{NUM})\s?(?P<weights_gib_unit>GiB|GB)",
        handler="weights_done",
    ),
    _p(
        "loading_weights_took_old",
        "loading model weights took",
        rf"Loading model weights took (?P<weights_gib>{NUM})\s?(?P<weights_gib_unit>GiB|GB)",
        handler="weights_done",
    ),
    _p(
        "weights_v0_profile",
        "model weights take",
        rf"model weights take (?P<weights_gib>{NUM})\s?GiB",
    ),
    _p("weights_debug", "weights memory:", rf"weights memory: (?P<weights_gib>{NUM})\s?GiB"),
    _p(
        "weight_load_oom",
        ("failed to load model - not enough", "failed to load model — not enough"),
        r"Failed to load model [-—–] not enough GPU memory",
        signature="weight_load_oom",
        failure_phase=Phase.WEIGHT_LOADING,
        loose="failed to load model not enough gpu memory",
        loose_triggers=("not enough", "failed to load"),
    ),
    # --- profiling (§2.3, §2.4, §11 DEBUG lines, V0) ----------------------------------------
    _p(
        "activation_v0",
        "activation peak memory takes",
        rf"PyTorch activation peak memory takes (?P<activation_gib>{NUM})\s?GiB",
        phase=Phase.PROFILING,
    ),
    _p(
        "activation_debug",
        "torch peak memory increase",
        rf"torch peak memory increase: (?P<activation_gib>{NUM})\s?GiB",
        phase=Phase.PROFILING,
    ),
    _p(
        "peak_torch_v0_table",
        "peak_torch_memory=",
        rf"peak_torch_memory=(?P<peak_torch_gib>{NUM})\s?GiB",
        phase=Phase.PROFILING,
    ),
    _p(
        "non_torch_v0",
        "non_torch_memory",
        rf"non_torch_memory(?: takes|=| )\s?(?P<non_torch_gib>{NUM})\s?GiB",
    ),
    _p(
        "non_torch_debug",
        "non-torch forward increase",
        rf"non-torch forward increase memory: (?P<non_torch_gib>{NUM})\s?GiB",
    ),
    _p(
        "total_consumed_debug",
        "total consumed",
        rf"total consumed \(from mem_get_info\): (?P<total_consumed_gib>{NUM})\s?GiB",
    ),
    _p(
        "non_kv_total_debug",
        "total non kv cache memory",
        rf"Total non KV cache memory: (?P<non_kv_total_gib>{NUM})\s?GiB",
        phase=Phase.PROFILING,
    ),
    _p(
        "requested_v0",
        "total_gpu_memory (",
        rf"total_gpu_memory \((?P<gpu_total_gib>{NUM})\s?GiB\) x "
        rf"(?:gpu_memory_utilization )?\(?(?P<gpu_memory_utilization>{NUM})\)? = "
        rf"(?P<requested_gib>{NUM})\s?GiB",
        phase=Phase.PROFILING,
    ),
    _p("total_v0_table", "total_gpu_memory=", rf"total_gpu_memory=(?P<gpu_total_gib>{NUM})\s?GiB"),
    _p(
        "util_v0_table",
        "gpu_memory_utilization=",
        rf"\bgpu_memory_utilization=(?P<gpu_memory_utilization>{NUM})\b",
    ),
    _p(
        "kv_v0_table",
        "kv_cache_size=",
        rf"\bkv_cache_size=(?P<available_kv_gib>{NUM})\s?GiB",
        phase=Phase.KV_ALLOCATION,
    ),
    _p(
        "kv_v0",
        "reserved for kv cache is",
        rf"the rest (?:of the memory )?reserved for KV Cache is (?P<available_kv_gib>{NUM})\s?GiB",
        phase=Phase.KV_ALLOCATION,
    ),
    _p(
        "kv_available",
        "available kv cache memory:",
        rf"Available KV cache memory: (?P<available_kv_gib>{NUM})\s?GiB",
        phase=Phase.KV_ALLOCATION,
    ),
    _p(
        "kv_override",
        "as specified by kv_cache_memory_bytes",
        rf"Initial free memory (?P<startup_free_gib>{NUM}) GiB, reserved "
        rf"(?P<available_kv_gib>{NUM}) GiB memory for KV Cache",
        phase=Phase.KV_ALLOCATION,
    ),
    _p(
        "cpu_auto_set",
        ("gib for kv cache on node",),
        rf"(?:Auto|Explicitly) set \((?P<available_kv_gib>{NUM})/(?P<gpu_total_gib>{NUM})\) GiB "
        r"for KV cache on node"
        # auto-sized: the worker's request (utilization × node RAM) and its resident memory
        rf"(?: \d+, with (?P<requested_gib>{NUM}) GiB requested memory for the worker\. "
        rf"(?P<cpu_non_kv_gib>{NUM}) GiB memory was consumed by non-kv usages)?",
        phase=Phase.KV_ALLOCATION,
        handler="platform_cpu",
    ),
    _p(
        "cpu_kvcache_space",
        "vllm_cpu_kvcache_space",
        r"VLLM_CPU_KVCACHE_SPACE",
        handler="platform_cpu",
    ),
    _p(
        "profiling_free_increase",
        "error in memory profiling",
        rf"Error in memory profiling\. Initial free memory (?P<a>{NUM}) GiB, current free "
        rf"memory (?P<b>{NUM}) GiB",
        signature="profiling_free_increase",
        failure_phase=Phase.PROFILING,
        handler="free_increase",
    ),
    _p(
        "free_memory_grew",
        "free memory grew by",
        rf"Free memory grew by (?P<profiling_free_increase>{NUM}) GiB during profiling",
        signature="free_memory_grew",
    ),
    # --- CUDA graphs (§2.6) -------------------------------------------------------------------
    _p(
        "cudagraph_estimated",
        "estimated cuda graph memory",
        rf"Estimated CUDA graph memory: (?P<cudagraph_estimate_gib>{NUM}) ?GiB",
        phase=Phase.PROFILING,
    ),
    _p(
        "cudagraph_pool",
        "cuda graph pool memory",
        rf"CUDA graph pool memory: (?P<cudagraph_actual_gib>{NUM}) GiB \(actual\), "
        rf"(?P<cudagraph_estimate_gib>{NUM}) GiB \(estimated\)",
        phase=Phase.CUDA_GRAPH_CAPTURE,
    ),
    _p(
        "graph_capturing_finished",
        "graph capturing finished",
        rf"Graph capturing finished in {NUM} secs?, took "
        rf"(?P<cudagraph_actual_gib>{NUM})\s?(?P<cudagraph_actual_gib_unit>GiB|GB|MiB|G|M)?",
        phase=Phase.CUDA_GRAPH_CAPTURE,
    ),
    _p(
        "cudagraph_util_hint",
        "is equivalent to --gpu-memory-utilization",
        rf"--gpu-memory-utilization=(?P<u>{NUM}) is equivalent to "
        rf"--gpu-memory-utilization=(?P<e>{NUM})",
        handler="cudagraph_hint",
    ),
    _p(
        # §14.4: VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0 (vllm 0.32 v1/worker/gpu_worker.py):
        # the estimate G is still profiled but not subtracted; suggested = min(util + G/total, 1)
        "cudagraph_estimate_disabled",
        "cuda graph memory profiling is disabled",
        r"CUDA graph memory profiling is disabled "
        r"\(VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0\).*?--gpu-memory-utilization from "
        rf"(?P<u>{NUM}) to (?P<s>{NUM})",
        handler="cudagraph_hint_disabled",
    ),
    _p(
        "capture_start",
        (
            "capturing cudagraphs",
            "capturing cuda graph",
            "capturing the model for cuda graphs",
            "cuda graphs can take additional",
            "cudagraph_capture_sizes",
        ),
        # ``cudagraph_capture_sizes`` starts a capture only as a line of its own (V0's
        # "cudagraph_capture_sizes [2,1]"), not as a key of the engine's configuration dump
        # (``'cudagraph_capture_sizes': []``), which vLLM prints before the weights load.
        r"Capturing (?:cudagraphs|CUDA graphs?|the model for CUDA graphs)"
        r"|CUDA graphs can take additional|(?<![\w'\"])cudagraph_capture_sizes(?![\w'\"])",
        phase=Phase.CUDA_GRAPH_CAPTURE,
    ),
    _p(
        "cudagraph_oom_hint",
        "vllm_memory_profiler_estimate_cudagraphs=0",
        r"(?:try setting|persists)[^.]{0,80}VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0",
        signature="cudagraph_oom_hint",
        failure_phase=Phase.CUDA_GRAPH_CAPTURE,
    ),
    _p(
        "capture_frames",
        ("capture", "cudagraph", "cuda/graphs.py", "cuda.graph("),
        # vLLM's capture helpers (V0 CUDAGraphRunner / capture_model, V1 _capture_cudagraphs /
        # capture_model / CUDAGraphWrapper, the compilation backend's ``with
        # torch.cuda.graph(...)``) and PyTorch's own capture frames (torch/cuda/graphs.py
        # __enter__/__exit__, capture_begin/capture_end); ``replay`` is serving, not capture.
        r"\b(?:capture_model|_capture_cudagraphs|capture_graph|cudagraph_capture|CUDAGraphRunner"
        r"|graph_capture|_warmup_and_capture|CUDAGraphWrapper|_capture_graph"
        r"|_capture_\w*cudagraphs?\w*|capture_(?:begin|end))\b|torch\.cuda\.graph\("
        r"|torch/cuda/graphs\.py\", line \d+, in (?!replay\b)",
        frame_phase=Phase.CUDA_GRAPH_CAPTURE,
    ),
    # --- KV capacity (§5.4, §6) ---------------------------------------------------------------
    _p(
        "kv_cache_size",
        "kv cache size:",
        r"(?:(?P<device_label>GPU \+ host|GPU|CPU|XPU|HPU|TPU) )?KV cache size: "
        r"(?P<kv_tokens>[\d,]+) tokens",
        phase=Phase.KV_ALLOCATION,
        handler="kv_device",
    ),
    _p(
        "max_concurrency",
        "maximum concurrency for",
        r"Maximum concurrency for (?P<concurrency_max_model_len>[\d,]+)"
        rf"(?:[ -]tokens?(?: per request|/request| requests)?)?: (?P<max_concurrency>{NUM})\s?x",
    ),
    _p(
        "blocks_v0",
        " blocks:",
        r"(?:^|#|\s)(?:GPU|CUDA|cuda|gpu|XPU|xpu|HPU|hpu) blocks: "
        r"(?P<gpu_blocks>\d+)(?:, # CPU blocks: (?P<cpu_blocks>\d+))?",
        phase=Phase.KV_ALLOCATION,
    ),
    _p(
        "auto_fit_reduced",
        "auto-fit max_model_len: reduced",
        r"Auto-fit max_model_len: reduced from \d+ to (?P<auto_fit_reduced_to>\d+)",
    ),
    # --- the fit errors (§7.2) ------------------------------------------------------------
    _p(
        "kv_needed",
        "kv cache is needed",
        # early V1 releases (0.8.x) print the same bytes / 2**30 figures with a "GB" unit
        rf"max seq len \((?P<kv_error_max_model_len>\d+)\),\s*\((?P<kv_needed_gib>{NUM}) Gi?B KV "
        r"cache is needed, which is larger than the available KV cache memory "
        rf"\((?P<kv_available_gib>{NUM}) Gi?B\)",
        signature="kv_too_small",
        failure_phase=Phase.KV_ALLOCATION,
        loose="[max seq len ({kv_error_max_model_len})] {kv_needed_gib:mem} kv cache is needed"
        " [which] <larger> [the] available kv cache memory ({kv_available_gib:mem})",
        loose_triggers=("needed", "max seq len"),
    ),
    _p(
        # the same message abridged by a reporter: "1.75 GiB KV cache is needed, available
        # 0.13 GiB"
        "kv_needed_abridged",
        "kv cache is needed",
        rf"(?P<kv_needed_gib>{NUM})\s?Gi?B KV cache is "
        r"needed\W{1,4}(?:but\s+)?(?:only\s+)?available:?\s+(?:is\s+)?"
        rf"(?P<kv_available_gib>{NUM})\s?Gi?B",
        signature="kv_too_small",
        failure_phase=Phase.KV_ALLOCATION,
        flags=re.IGNORECASE,
    ),
    _p(
        "kv_estimated_len",
        "estimated maximum model length",
        r"estimated maximum model length is (?P<estimated_max_model_len>\d+)",
    ),
    _p(
        "kv_tokens_v0_error",
        "stored in kv cache",
        r"max seq len \((?P<kv_error_max_model_len>\d+)\) is larger than the maximum number of "
        r"tokens that can be stored in KV cache \((?P<kv_capacity_tokens>\d+)\)",
        signature="kv_too_small",
        failure_phase=Phase.KV_ALLOCATION,
        # (the leading words may be mistyped, "max sew len": the comparison carries the message)
        loose="[max seq len ({kv_error_max_model_len})] <larger> [the] maximum number of tokens"
        " [that] can be stored in [the] kv cache ({kv_capacity_tokens})",
        loose_triggers=("stored", "max seq len"),
    ),
    _p(
        # the same message cut after its first figure (an issue title: "ValueError: The model's
        # max seq len (32768)"): only the fit check starts this way
        "kv_error_cut",
        "max seq len",
        r"model'?s max seq len \((?P<kv_error_max_model_len>\d+)\)[.,:]?\s*$",
        signature="kv_too_small",
        failure_phase=Phase.KV_ALLOCATION,
    ),
    _p(
        # V0's scheduler refusing a prompt longer than the whole KV cache (the request is
        # dropped; old releases did not check max_model_len against the cache at start-up)
        "prompt_exceeds_kv",
        "capacity of block_manager",
        r"Input prompt \((?P<kv_refused_prompt_tokens>\d+) tokens\) is too long and exceeds "
        r"(?:the )?capacity of block_manager",
        signature="kv_too_small",
        failure_phase=Phase.SERVING,
    ),
    _p(
        "no_cache_blocks",
        "no available memory for the cache blocks",
        r"No available memory for the cache blocks",
        signature="no_cache_blocks",
        failure_phase=Phase.KV_ALLOCATION,
        loose="no available memory for [the] cache blocks",
        loose_triggers=("cache blocks", "available memory", "no available"),
    ),
    _p(
        "auto_fit_failed",
        "cannot auto-fit max_model_len",
        r"Cannot auto-fit max_model_len",
        signature="auto_fit_failed",
        failure_phase=Phase.KV_ALLOCATION,
    ),
    _p(
        "mamba_blocks",
        "mamba cache blocks",
        r"max_num_seqs \((?P<mamba_max_num_seqs>\d+)\) exceeds available Mamba cache blocks "
        r"\((?P<mamba_cache_blocks>\d+)\)",
        signature="mamba_blocks_exceeded",
        failure_phase=Phase.KV_ALLOCATION,
    ),
    # --- sampler warm-up ------------------------------------------------------------------------
    _p(
        "sampler_warmup_oom",
        "warming up sampler with",
        r"CUDA out of memory occurred when warming up sampler with "
        r"(?P<sampler_warmup_oom_seqs>\d+) dummy requests",
        signature="sampler_warmup_oom",
        failure_phase=Phase.SAMPLER_WARMUP,
        loose="out of memory occurred when warming up [the] sampler with {sampler_warmup_oom_seqs}"
        " dummy requests",
        loose_triggers=("warming up", "sampler", "dummy requests"),
    ),
    _p(
        "sampler_frames",
        ("_dummy_sampler_run", "warming up sampler"),
        r"_dummy_sampler_run|warming up sampler",
        frame_phase=Phase.SAMPLER_WARMUP,
    ),
    # --- out-of-memory reports --------------------------------------------------------------------
    _p(
        "torch_oom",
        ("out of memory", "outofmemoryerror", "tried to allocate"),
        r"(?:torch\.(?:cuda\.)?OutOfMemoryError|(?:CUDA|HIP|XPU) out of memory|Tried to allocate)"
        r"(?! occurred when warming up sampler)",
        signature="cuda_oom",
        handler="oom_torch",
        loose="[out of memory] tried to allocate {tried:mem}",
        loose_triggers=("allocate",),
    ),
    _p(
        # the same error cut by the excerpt in the middle of its message ("RuntimeError: CUDA
        # out of" as the line's end): a failure stated, with none of its numbers
        "torch_oom_cut",
        ("cuda out of", "hip out of", "xpu out of", "outofmemoryerror"),
        r"(?:Error:\s*(?:CUDA|HIP|XPU) out of|OutOfMemoryError:?)\s*$",
        signature="cuda_oom",
        handler="oom_torch",
    ),
    _p(
        "driver_oom",
        (
            "error: out of memory",
            "cuda_error_out_of_memory",
            "cudaerrormemoryallocation",
            "out_of_device_memory",
            "out of device memory",
            "hiperroroutofmemory",
            "hsa_status_error_out_of_resources",
        ),
        # (ROCm's: hipErrorOutOfMemory, and the HSA runtime's "out of resources" with "Available
        # Free mem : 0 MB")
        r"(?i:cuda error: out of memory|CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation"
        r"|OUT_OF_DEVICE_MEMORY|out of device memory|hipErrorOutOfMemory"
        r"|HSA_STATUS_ERROR_OUT_OF_RESOURCES)",
        signature="driver_oom",
        handler="oom_driver",
    ),
    _p(
        "cumem_allocator",
        ("cumem_allocator", "cumemallocator"),
        r"(?i:cumem_allocator|CuMemAllocator)",
        signature="cumem_allocator",
    ),
    _p(
        "model_execution_error",
        "error in model execution",
        r"Error in model execution",
        phase=Phase.SERVING,
        failure_phase=Phase.SERVING,
    ),
    # --- host memory --------------------------------------------------------------------------
    _p(
        "host_ram_kill",
        ("killed", "oom-kill", "oom_kill", "sigkill", "signal 9", "-9", "137"),
        r"(?:^|\s)Killed\s*$|oom[-_]kill|Out of memory: Kill(?:ed)? process|SIGKILL|signal 9\b"
        r"|exit(?:s|ed)?(?: with)? (?:code|status)[ :=]*(?:-9|137)\b|exitcode[=: ]+-9\b"
        r"|returncode[=: ]+-9\b|died\s*\(-9\)",
        signature="host_ram_kill",
    ),
    _p(
        "died_unexpectedly",
        ("died unexpectedly", "terminated unexpectedly", "died with exit code"),
        r"died unexpectedly|terminated unexpectedly|died with exit code",
        signature="died_unexpectedly",
    ),
    _p(
        "cpu_swap_exhausted",
        "lack of cpu swap space",
        r"lack of CPU swap space",
        signature="cpu_swap_exhausted",
    ),
    _p(
        "host_alloc_failure",
        (
            "cannot allocate memory",
            "bad_alloc",
            "memoryerror",
            "defaultcpuallocator",
            "cudahostalloc",
        ),
        r"Cannot allocate memory|std::bad_alloc|(?<![A-Za-z])MemoryError\b"
        r"|DefaultCPUAllocator: (?:can't allocate|not enough memory)|cudaHostAlloc",
        signature="host_alloc_failure",
    ),
    _p(
        "ray_oom",
        (
            "memory pressure",
            "low on memory",
            "ray oom",
            "ray-oom-prevention",
            "ray_memory_usage_threshold",
            "ray.exceptions.outof",
        ),
        # Ray's memory monitor kills workers when the node's RAM passes its threshold:
        # "N Workers (tasks / actors) killed due to memory pressure (OOM)", "Task was killed
        # due to the node running low on memory", and its advice naming ray-oom-prevention
        r"(?i:killed due to (?:the node )?(?:memory pressure|running low on memory)"
        r"|running low on memory|\(ray oom\)|ray-oom-prevention|RAY_memory_usage_threshold"
        # its exception class, also when an excerpt cuts the name ("ray.exceptions.OutOfMe")
        r"|ray\.exceptions\.OutOf(?:Memory\w*|\w*\s*$))",
        signature="host_ram_kill",
        handler="ray_oom",
    ),
    _p(
        "shm_exhausted",
        ("/dev/shm",),
        # the shared-memory filesystem (a container's default is 64 MiB): Ray's object store
        # ("System memory request exceeds memory available in /dev/shm"), NCCL's segments
        # ("Error while creating shared memory segment /dev/shm/nccl-…"), a full device
        r"exceeds memory available in /dev/shm|creating shared memory segment /dev/shm"
        r"|No space left on device[^\n]{0,80}/dev/shm|/dev/shm[^\n]{0,80}No space left on device",
        signature="shm_exhausted",
    ),
    _p(
        "mmap_failure",
        "unable to mmap",
        # torch.load / safetensors mapping a checkpoint file into host memory
        r"unable to mmap (?:\d+ bytes)?",
        signature="host_alloc_failure",
    ),
    _p(
        "pinned_memory",
        ("pin_memory", "pinned", "cudahostalloc", "pin memory"),
        r"(?i:pin_memory|pinned (?:host |cpu )?(?:memory|buffers?|cache|blocks?)"
        r"|cudaHostAlloc|pin memory)",
        signature="pinned_host_memory",
    ),
    _p(
        "swap_too_large",
        "too large swap space",
        # V0 CacheConfig: swap_space × GPUs above 70 % of host RAM is refused (ValueError),
        # above 40 % warned about ("Possibly too large swap space")
        r"(?<!Possibly )Too large swap space",
        signature="cpu_swap_too_large",
    ),
    _p(
        "swap_possibly_large",
        "possibly too large swap space",
        r"Possibly too large swap space",
        signature="swap_space_large",
    ),
    _p(
        "free_listing",
        ("mem:", "swap:"),
        # a row of `free` / `free -h`: "Mem:  62Gi  5,8Gi  13Gi  45Mi  43Gi  56Gi"
        r"^\s*(?P<kind>Mem|Swap):\s+"
        r"(?P<cols>\d[\d.,]*\s?[KMGTP]?i?B?(?:\s+\d[\d.,]*\s?[KMGTP]?i?B?){1,5})\s*$",
        handler="free_listing",
    ),
    _p(
        "wsl",
        ("/mnt/", "wsl", "microsoft-standard"),
        r"/mnt/[a-z]/|\bWSL2?\b|microsoft-standard",
        signature="wsl",
    ),
    _p(
        # WSL's GPU paravirtualisation failing to make memory resident (-12 is ENOMEM); CUDA
        # reports it as "device not ready" or a kernel's own error
        "wsl_make_resident",
        ("dxgkio_make_resident",),
        r"dxgkio_make_resident\b[^\n]{0,40}?-12\b",
        signature="wsl_resident_enomem",
    ),
    _p(
        "unified_memory",
        ("jetson", "orin", "tegra", "gh200", "gb10", "dgx spark", "unified memory"),
        r"(?i:\bjetson\b|\borin\b|\btegra\b|\bGH200\b|\bGB10\b|DGX Spark|unified memory)",
        signature="unified_memory",
    ),
    # --- multi-process / distributed ------------------------------------------------------------
    _p(
        "nccl_error",
        ("nccl",),
        r"NCCL (?:error|WARN|failure)|nccl(?:Unhandled\w*|System|Internal|Invalid\w*)Error"
        r"|ProcessGroupNCCL.{0,80}(?:[Ee]rror|[Tt]imeout)|Watchdog caught collective",
        signature="nccl_error",
    ),
    _p(
        "nccl_init_frame",
        ("ncclcomminit",),
        # the traceback frame of NCCL's communicator set-up (pynccl's wrapper, vllm
        # distributed/device_communicators); NCCL_DEBUG=INFO's "ncclCommInitRank comm 0x…"
        # progress lines do not match
        r"\bin ncclCommInit(?:Rank|All)\b|\.ncclCommInit(?:Rank|All)\(",
        signature="nccl_init_frame",
    ),
    # --- failures that are not memory (NOT_MEMORY_FAILURES) ----------------------------------
    _p(
        "illegal_instruction",
        ("illegal instruction", "sigill", "invalid opcode", "-4", "132"),
        # the shell's "Illegal instruction (core dumped)", faulthandler's "Fatal Python error:
        # Illegal instruction", the kernel's trap line, an exit status of SIGILL (-4, 128+4);
        # CUDA's "an illegal instruction was encountered" (lower case) is a GPU kernel fault
        r"(?<![\w-])Illegal instruction\b|\bSIGILL\b|trap invalid opcode"
        r"|(?:exit ?code|exit status|returncode)[=: ]+(?:-4|132)\b|died\s*\(-4\)",
        signature="illegal_instruction",
    ),
    _p(
        "no_kernel_image",
        ("no kernel image", "nokernelimage"),
        r"no kernel image is available for execution on the device|cudaErrorNoKernelImageForDevice",
        signature="no_kernel_image",
    ),
    _p(
        "cuda_driver_too_old",
        (
            "driver version is insufficient",
            "insufficientdriver",
            "driver on your system is too old",
        ),
        r"CUDA driver version is insufficient for CUDA runtime version|cudaErrorInsufficientDriver"
        r"|The NVIDIA driver on your system is too old",
        signature="cuda_driver_too_old",
    ),
    # --- allocator configuration ----------------------------------------------------------------
    _p(
        "expandable_hint",
        "to avoid fragmentation",
        r"expandable_segments:True to avoid fragmentation|max_split_size_mb to avoid fragmentation",
        signature="expandable_segments_hint",
    ),
    _p(
        "expandable_in_use",
        "expandable_segments:true",
        r"PYTORCH_CUDA_ALLOC_CONF['\"]?\s*[=:]\s*['\"]?[\w:,.]*expandable_segments:True",
        handler="expandable_in_use",
    ),
    _p(
        "sleep_expandable_conflict",
        ("not in conf", "expandable segments are not compatible"),
        r"expandable_segments:True\"? not in conf"
        r"|Expandable segments are not compatible with memory pool",
        signature="sleep_expandable_conflict",
    ),
    _p(
        "sleep_mode",
        ("sleep mode", "enable-sleep-mode", "enable_sleep_mode", "sleep(level", "wake_up("),
        r"(?i:sleep mode)|--enable-sleep-mode|enable_sleep_mode['\"]?\s*[:=]\s*True"
        r"|\.sleep\(level|\bwake_up\(",
        signature="sleep_mode",
    ),
    _p(
        "lora",
        ("enable-lora", "enable_lora", "loading lora"),
        r"--enable-lora|enable_lora['\"]?\s*[:=]\s*True|Loading LoRA",
        signature="lora",
    ),
    _p(
        "sleep_freed",
        "sleep mode freed",
        rf"Sleep mode freed (?P<sleep_freed_gib>{NUM}) ?GiB",
    ),
    _p(
        "still_in_use",
        "still in use",
        # "Sleep mode freed 43.82 GiB memory, 4.11 GiB memory is still in use." and the same
        # figure quoted after later steps
        r"(?<![\d.])(?P<gib>\d+(?:\.\d+)?) ?GiB(?: memory)? is still in use",
        handler="still_in_use",
    ),
    # --- multimodal encoder profiling (§2.3 step 1) ---------------------------------------------
    _p(
        "encoder_cache_budget",
        "encoder cache will be initialized",
        r"Encoder cache will be initialized with a budget of (?P<encoder_budget_tokens>[\d,]+) "
        r"tokens, and profiled with (?P<encoder_profile_items>\d+) \w+ items",
        signature="mm_encoder_profile",
        phase=Phase.PROFILING,
    ),
    _p(
        "mm_profile_run",
        "profile run for multi-modal",
        r"Starting profile run for multi-modal models",
        signature="mm_encoder_profile",
        phase=Phase.PROFILING,
    ),
    _p(
        "mm_embeddings_too_long",
        "multi-modal embeddings",
        r"too short to hold the multi-modal embeddings",
        signature="mm_encoder_profile",
        phase=Phase.PROFILING,
    ),
    _p(
        "mm_frames",
        (
            "pixel_values",
            "image_embeds",
            "vision",
            "visual",
            "_mm_",
            "multimodal",
            "image_input",
            "image_features",
        ),
        r"\bpixel_values\b|\bimage_embeds\b|vision_tower|\bvision_model\b|\bvisual\b"
        r"|_process_image_input|get_multimodal_embeddings|_execute_mm_encoder|embed_multimodal"
        r"|encode_images|get_image_features|_process_audio_input|input_features\b",
        signature="mm_encoder_frames",
        frame_kind="mm_encoder",
    ),
    _p(
        "mm_model_file",
        ("models/",),
        # any model file under vllm/model_executor/models whose name says vision/visual/ViT,
        # encoder or audio, and the multimodal families whose names do not
        r"models/\w*(?:_vl\b|_vl\.|vl_|vision|visual|vit|encoder|audio|whisper|mllama|llava|pixtral"
        r"|siglip|clip|idefics|minicpmv|minicpmo|phi3v|phi4mm|gemma3_mm|gemma3n_mm|omni|kimi_vl"
        r"|aria|molmo|paligemma|blip|ultravox|voxtral|granite_speech|radio|navit)\w*\.py",
        signature="mm_encoder_frames",
        frame_kind="mm_encoder",
    ),
    _p(
        "mm_remote_code_file",
        ("encoder/", "vision", "visual", "sam_", "vit"),
        # a model's own code (trust_remote_code, a project's fork): a folder named for its
        # encoder or vision part, or a vision-transformer file ("deepencoder/sam_vary_sdpa.py")
        r"/\w*(?:encoder|vision|visual)\w*/[\w.-]+\.py\b|/(?:sam|vit|siglip|clip)_\w*\.py\b",
        signature="mm_encoder_frames",
        frame_kind="mm_encoder",
    ),
    _p(
        "vision_op_frames",
        ("unfold", "im2col", "conv2d", "conv3d", "patch_embed", "patchembed", "fold.py"),
        # image ops that, in a language-model server, only a vision tower runs: patch
        # extraction (nn.Unfold / im2col) and 2-D/3-D patch convolutions
        r"\bF\.unfold\b|\bim2col\b|nn/modules/fold\.py|\bF\.conv[23]d\b|\bconv[23]d\("
        r"|patch_embed|PatchEmbed",
        signature="mm_encoder_frames",
        frame_kind="mm_encoder",
    ),
    # --- runtime pressure ---------------------------------------------------------------------
    _p(
        "kv_usage",
        "kv cache usage:",
        rf"(?:GPU|CPU|XPU) KV cache usage: (?P<kv_usage_max_pct>{NUM})%",
        phase=Phase.SERVING,
        handler="kv_usage",
    ),
    _p(
        "preemptions",
        ("preemption", "preempted"),
        r"Preemptions?: (?P<preemptions>\d+)|is preempted by|preempted by PreemptionMode",
        signature="preemption",
    ),
    _p(
        "memory_growth_words",
        ("leak", "泄漏", "泄露", "keeps growing", "keeps increasing", "over time", "显存", "内存"),
        r"(?i:memory leak|leaks? memory|泄漏|泄露|keeps (?:growing|increasing)|grows? over time"
        r"|increas\w* over time"
        # "显存慢慢增大": GPU memory (or memory) slowly / steadily / keeps growing
        r"|(?:显存|内存)(?:占用)?(?:会)?(?:慢慢|逐渐|不断|持续|一直|缓慢)(?:地)?"
        r"(?:增大|增加|上涨|增长|升高|上升))",
        signature="memory_growth",
    ),
    # --- phase markers and traceback frames ---------------------------------------------------
    _p(
        "serving_markers",
        (
            "application startup complete",
            "uvicorn running on",
            "starting vllm api server",
            "avg prompt throughput",
            "received request",
            "post /v1/",
            "init engine (profile",
        ),
        r"Application startup complete|Uvicorn running on|Starting vLLM API server"
        r"|Avg prompt throughput|Received request|\"POST /v1/"
        r"|init engine \(profile, create kv cache, warmup model\) took",
        phase=Phase.SERVING,
    ),
    _p(
        "serving_frames",
        # prompt logprobs are computed only for real requests that ask for them
        (
            "run_busy_loop",
            "engine_step",
            "step_with_batch_queue",
            "run_engine_loop",
            "_get_prompt_logprobs",
        ),
        r"\b(?:run_busy_loop|_process_engine_step|step_with_batch_queue|run_engine_loop"
        r"|_get_prompt_logprobs\w*)\b",
        frame_phase=Phase.SERVING,
    ),
    _p(
        "profiling_frames",
        (
            "profile_run",
            "determine_num_available_blocks",
            "determine_available_memory",
            "_dummy_run",
            "memory_profiling",
            "profiling.py",
        ),
        r"\b(?:profile_run|determine_num_available_blocks|determine_available_memory|_dummy_run"
        r"|memory_profiling)\b|profiling\.py",
        frame_phase=Phase.PROFILING,
    ),
    _p(
        "profiling_summary",
        "memory profiling takes",
        r"Memory profiling takes",
        phase=Phase.PROFILING,
    ),
    _p(
        "kv_frames",
        (
            "_initialize_kv_caches",
            "initialize_cache",
            "raise_if_cache_size_invalid",
            "get_kv_cache_config",
            "enough_kv_cache_memory",
            "allocate_kv_cache",
            "initialize_kv_cache",
            "initialize_from_config",
            "_init_cache_engine",
            "cacheengine",
        ),
        r"\b(?:_initialize_kv_caches|initialize_cache|raise_if_cache_size_invalid"
        r"|get_kv_cache_configs?|_?check_enough_kv_cache_memory|_allocate_kv_cache\w*"
        r"|initialize_kv_cache\w*|initialize_from_config"
        r"|_init_cache_engine|CacheEngine)\b",
        frame_phase=Phase.KV_ALLOCATION,
    ),
    _p(
        "weight_frames",
        (
            "load_model",
            "load_weights",
            "weight_loader",
            "process_weights_after_loading",
            "model_loader",
            "_initialize_model",
            "modulelist",
            "parameter(torch.empty",
            "checkpoint shards",
            "in __init__",
        ),
        r"\b(?:load_model|load_weights|weight_loader|process_weights_after_loading"
        r"|_initialize_model)\b|model_loader/|nn\.ModuleList\(|Parameter\(torch\.empty"
        r"|checkpoint shards|models/\w+\.py\", line \d+, in (?:__init__|<listcomp>)",
        frame_phase=Phase.WEIGHT_LOADING,
    ),
    _p(
        "activation_frames",
        (
            "attention",
            "attn",
            "softmax",
            "sampler",
            "logits",
            "lm_head",
            "unfold",
            "im2col",
            "top_k_top_p",
        ),
        # ops whose memory grows with the tokens (or images) in the batch: attention kernels
        # and their eager fallbacks, softmax, the sampler and the logits
        r"\bscaled_dot_product_attention\b|\bflash_attn\w*|\bxformers\b|memory_efficient_attention"
        r"|/attention/|\w*attention\w*\.py|\b_?attn\w*\(|\battention\w*\(|\bsoftmax\b|sampler\.py"
        r"|\bsampler\b|compute_logits|_get_logits|logits_processor|\blm_head\b|top_k_top_p"
        r"|\bF\.unfold\b|\bim2col\b",
        frame_kind="activation",
    ),
    _p(
        "startup_frames",
        ("init_device", "request_memory", "memorysnapshot"),
        r"\b(?:init_device|request_memory|MemorySnapshot)\b",
        frame_phase=Phase.STARTUP,
    ),
    _p(
        "traceback",
        "traceback (most recent call last)",
        r"^Traceback \(most recent call last\)",
        handler="traceback",
    ),
    _p(
        "exception_line",
        ("error", "exception"),
        r"^(?:[\w.]+\.)?(?P<exc>\w*(?:Error|Exception))(?::|\(|\s*$)",
        handler="exception",
    ),
    # --- PyTorch's OOM figures on lines of their own (a report wrapped or reformatted) ---------
    _p(
        "oom_detail",
        (
            "has a total capacity of",
            "has a total capacty of",
            "total capacity;",
            "gib total,",
            "mib total,",
            "pytorch allocated:",
            "reserved but unallocated",
            "memory in use",
        ),
        r"(?i:has a total capac\w* of|total capacity;|GPU(?: \d+)? has \S+ ?[KMGT]i?B total,"
        r"|PyTorch allocated:|reserved by PyTorch but unallocated"
        r"|Reserved but unallocated:|memory in use)",
        handler="oom_detail",
    ),
    # --- statements in prose: titles, summaries, descriptions (weaker evidence) ------------------
    _p(
        "said_oom",
        (
            "oom",
            "out of memory",
            "out-of-memory",
            "out of men",
            "out of memr",
            "out of meme",
            "out of gpu",
            "out of cuda",
            "out of device",
            "out of host",
            "out of cpu",
            "out of system",
            "out of node",
            "out of vram",
            "out of ram",
            "enough",
            "insufficient",
            "cannot",
            "can't",
            "can not",
            "unable to",
            "fail",
            "low on memory",
            "memory pressure",
            "exceed",
            "balloon",
            "keeps growing",
            "keeps increasing",
            "keeps rising",
            "keeps climbing",
            "kept growing",
            "crash",
            "each other",
            "kv cache",
            "kv-cache",
            "kvcache",
            *prose.CJK_OOM_TRIGGERS,
        ),
        prose.SAID_OOM,
        handler="said",
    ),
    _p(
        "said_kv_short",
        ("kv cache", "kv-cache", "kvcache"),
        prose.MENTIONS["said_kv_short"],
        handler="said",
    ),
    _p("said_capture", ("graph", "capture"), prose.MENTIONS["said_capture"], handler="said"),
    _p(
        "said_code_regression",
        (
            "narrowed",
            "bisect",
            "introduced",
            "caused by",
            "broken by",
            "regression",
            "fix",
            "patch",
        ),
        prose.MENTIONS["said_code_regression"],
        handler="said",
    ),
    _p(
        "said_sampler",
        ("sampler", "warming up", "warmup", "warm-up", "warm up"),
        prose.MENTIONS["said_sampler"],
        handler="said",
    ),
    _p(
        "said_multimodal",
        (
            "image",
            "video",
            "vision",
            "visual",
            "modal",
            "vlm",
            "pixel",
            "mm_processor",
            "limit-mm",
            "limit_mm",
            "encoder cache",
            "forconditionalgeneration",
        ),
        prose.MENTIONS["said_multimodal"],
        handler="said",
    ),
    _p("said_fragmentation", "fragment", prose.MENTIONS["said_fragmentation"], handler="said"),
    _p(
        "said_host_ram",
        (
            "host ram",
            "host-ram",
            "host-oom",
            "host-memory",
            "host memory",
            "cpu ram",
            "cpu memory",
            "system ram",
            "system memory",
            "node ram",
            "node memory",
            " ram",
            "swap",
            "pinned",
            "pin_memory",
            "mmap",
            "cgroup",
            "rss",
            "%mem",
            "mem(",
            "mem (",
            "free -",
            "ray oom",
            "container",
            "--memory",
            "crash",
            "内存",
        ),
        prose.MENTIONS["said_host_ram"],
        handler="said",
    ),
    _p(
        "said_gpu_not_full",
        ("nvidia-smi", "the gpu", "vram"),
        prose.MENTIONS["said_gpu_not_full"],
        handler="said",
    ),
    _p("said_wake_up", ("wake",), prose.MENTIONS["said_wake_up"], handler="said"),
    _p(
        "said_empty_cache",
        ("empty_cache", "caching allocator"),
        prose.MENTIONS["said_empty_cache"],
        handler="said",
    ),
    _p(
        "said_colocated",
        (
            "grpo",
            "ppo",
            "dpo",
            "rlhf",
            "verl",
            "skyrl",
            "nemo",
            "trainer",
            "training",
            "colocat",
            "co-locat",
            "rollout",
            "shared",
        ),
        prose.MENTIONS["said_colocated"],
        handler="said",
    ),
    _p(
        "said_other_process",
        (
            "another",
            "other process",
            "other engine",
            "other job",
            "previous",
            "leftover",
            "left-over",
            "zombie",
            "orphan",
            "del llm",
            "freed",
            "released",
            "still in use",
            "second model",
            "second llm",
            "second engine",
            "second instance",
            "each other",
            "replicas",
            "engines",
            "instances",
            "释放",
            "占用",
        ),
        prose.MENTIONS["said_other_process"],
        handler="said",
    ),
    _p(
        "said_max_len",
        (
            "max_model_len",
            "max-model-len",
            "max model len",
            "max_seq_len",
            "max-seq-len",
            "max seq len",
            "context",
            "long ",
            "rope",
            "上下文",
            "长度",
        ),
        prose.MENTIONS["said_max_len"],
        handler="said",
    ),
    _p(
        "said_batch",
        (
            "num_seqs",
            "num-seqs",
            "num_seq",
            "num-seq",
            "num seqs",
            "batched",
            "batch_size",
            "batch-size",
            "batch size",
            "concurren",
            "parallel requests",
            "many requests",
            "beam",
            "n=",
            "n =",
        ),
        prose.MENTIONS["said_batch"],
        handler="said",
    ),
    _p(
        "said_logprobs",
        ("logprobs", "logits", "vocab"),
        prose.MENTIONS["said_logprobs"],
        handler="said",
    ),
    _p(
        "said_runtime",
        (
            "shutting down",
            "shut down",
            "during ",
            "while ",
            "after ",
            "at runtime",
            "under load",
            "at step",
        ),
        prose.MENTIONS["said_runtime"],
        handler="said",
    ),
    _p(
        "said_startup",
        (
            "start",
            "launch",
            "engine init",
            "immediately",
            "when loading",
            "while loading",
        ),
        prose.MENTIONS["said_startup"],
        handler="said",
    ),
    _p(
        "said_model_size",
        ("model ", "weights"),
        prose.SAID_MODEL_SIZE.pattern,
        handler="said_model_size",
    ),
    _p(
        "said_single_gpu",
        ("first gpu", "one gpu", "single gpu", "卡"),
        prose.MENTIONS["said_single_gpu"],
        handler="said",
    ),
    _p(
        "said_workaround",
        (
            "work",
            "fine",
            "ok",
            "solved",
            "fixe",
            "resolved",
            "help",
            "succeed",
            "have to",
            "had to",
            "has to",
            "need to",
            "needed to",
            "must to",
            "unless",
            "as long as",
            "except with",
            "except when",
            "解决",
            "解決",
        ),
        prose.WORKAROUND.pattern,
        handler="workaround",
    ),
    _p(
        "said_tried_in_vain",
        (
            "still",
            "oom",
            "same",
            "help",
            "fix",
            "solve",
            "luck",
            "difference",
            "effect",
            "avail",
            "nothing",
        ),
        prose.TRIED_IN_VAIN.pattern,
        handler="tried_in_vain",
    ),
    _p("said_tried_all", "tried", prose.TRIED_ALL.pattern, handler="tried_all"),
    _p(
        "said_lever_change",
        (" from ", "->", "→", "=>"),
        prose.LEVER_CHANGE.pattern,
        handler="lever_change",
    ),
    _p(
        "said_util",
        (
            "memory_utilization",
            "memory-utilization",
            "memory utilization",
            "memory_utilisation",
            "memory-utilisation",
        ),
        prose.SAID_UTIL.pattern,
        handler="said_util",
    ),
    _p(
        "said_unallocated",
        ("reserved-but-unallocated", "reserved but unallocated"),
        prose.SAID_UNALLOCATED.pattern,
        handler="said_unallocated",
    ),
    _p(
        "said_gpu",
        (
            "a100",
            "a800",
            "h100",
            "h800",
            "h200",
            "h20",
            "b200",
            "b100",
            "l40",
            "l4",
            "l20",
            "a10",
            "a30",
            "a40",
            "a6000",
            "rtx",
            "gtx",
            "v100",
            "t4",
            "p100",
            "mi2",
            "mi3",
        ),
        r"(?<![A-Za-z0-9_.])" + prose.SAID_GPU.pattern,
        handler="said_gpu",
    ),
    _p(
        "said_regression",
        ("work", "fine", "ok", "regression", "previously", "upgrad", "downgrad"),
        prose.REGRESSION_WORDS.pattern,
        handler="said_regression",
    ),
    # --- narratives of memory rising over time (last: reads the record after the others) ----
    _p(
        "growth_narrative",
        ("hour", "minute", "day", "小时", "分钟", "时间", "天"),
        r"(?i:\bhours?\b|\bminutes?\b|\bdays?\b|小时|分钟|时间|天)",
        handler="growth",
    ),
)

# Failures that are not memory: the engine dies the same way whatever memory it is given, so no
# memory setting is a fix (the doctor says what is; serve does not heal them). The NCCL one
# counts when its error comes from the communicator's set-up (see ``not_memory_failures``).
NOT_MEMORY_FAILURES: tuple[str, ...] = (
    "illegal_instruction",
    "no_kernel_image",
    "cuda_driver_too_old",
    "nccl_init_failed",
)


def not_memory_failures(signatures: dict[str, Evidence]) -> dict[str, Evidence]:
    """The failures that are not memory among a log's ``signatures``, name → the line that
    shows it (names from :data:`NOT_MEMORY_FAILURES`, in that order). An NCCL error is one only
    inside NCCL's communicator set-up (``nccl_init_frame``): a later one can be a collective's."""
    found = {name: signatures[name] for name in NOT_MEMORY_FAILURES if name in signatures}
    if "nccl_error" in signatures and "nccl_init_frame" in signatures:
        found["nccl_init_failed"] = signatures["nccl_error"]
    return found


# A `ps aux` row (USER PID %CPU %MEM VSZ RSS TTY STAT START TIME COMMAND): a listed process's
# command line is not the command the log's engine ran.
PS_ROW = re.compile(
    r"^\S+\s+\d+\s+\d+(?:\.\d+)?\s+\d+(?:\.\d+)?\s+\d+\s+\d+\s+\S+\s+\S+\s+\S+\s+\S+\s+\S"
)

# Memory figures inside one PyTorch OOM report (applied to the record of an OOM event).
OOM_TRIED = re.compile(rf"Tried to allocate {_mem('tried')}")
OOM_TOTAL_FREE = re.compile(
    rf"GPU (?P<idx>\d+) has a total capac\w* of {_mem('total')} of which {_mem('free')} is free"
)
OOM_PROCESS = re.compile(rf"Process (?P<pid>\d+) has {_mem('used')} memory in use")
OOM_THIS_PROCESS = re.compile(rf"this process has {_mem('used')} (?:memory )?in use")
OOM_ALLOCATED = re.compile(rf"Of the allocated memory {_mem('alloc')} is allocated by PyTorch")
OOM_POOLS = re.compile(rf"{_mem('pools')} allocated in private pools")
OOM_UNALLOCATED = re.compile(rf"{_mem('unalloc')} is reserved by PyTorch but unallocated")
# a reformatted report (quoted in issues and pull requests): "GPU has 19.53 GiB total, 329.87
# MiB free." / "PyTorch allocated: 18.40 GiB" / "Reserved but unallocated: 402.27 MiB"
OOM_ALT_TOTAL_FREE = re.compile(
    rf"GPU(?: (?P<idx>\d+))? has {_mem('total')} total, {_mem('free')} free"
)
OOM_ALT_ALLOCATED = re.compile(rf"PyTorch allocated: {_mem('alloc')}")
OOM_ALT_UNALLOCATED = re.compile(rf"(?i:reserved but unallocated): {_mem('unalloc')}")
OOM_OLD = re.compile(
    rf"\(GPU (?P<idx>\d+); {_mem('total')} total capacity; {_mem('alloc')} already allocated; "
    rf"{_mem('free')} free; (?:{NUM}\s?{UNIT} allowed; )?{_mem('reserved')} reserved "
    r"in total by PyTorch\)"
)

# Memory amounts in a narrative of memory rising over time ("14G … after 1 hour 18G … 20G").
MEMORY_AMOUNT = re.compile(r"(?<![\d.A-Za-z])(\d+(?:\.\d+)?)\s?(?:GiB|GB|G)(?![A-Za-z0-9])")

# Engine settings with integer values (in log fields and in a logged engine-args line).
INT_SETTINGS = frozenset(
    {
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "block_size",
    }
)
# Field value types for conversion of named groups.
INT_FIELDS = INT_SETTINGS | frozenset(
    {
        "kv_tokens",
        "gpu_blocks",
        "cpu_blocks",
        "concurrency_max_model_len",
        "kv_error_max_model_len",
        "kv_capacity_tokens",
        "estimated_max_model_len",
        "auto_fit_reduced_to",
        "mamba_max_num_seqs",
        "mamba_cache_blocks",
        "sampler_warmup_oom_seqs",
        "encoder_budget_tokens",
        "encoder_profile_items",
        "preemptions",
    }
)
FLOAT_FIELDS = frozenset(
    {
        "gpu_memory_utilization",
        "max_concurrency",
        "kv_usage_max_pct",
        "profiling_free_increase",
        "said_util",
    }
)


def build_trigger_index(patterns: tuple[Pattern, ...]) -> dict[str, tuple[int, ...]]:
    """Map each trigger to the indices of the patterns it enables."""
    index: dict[str, list[int]] = {}
    for i, pattern in enumerate(patterns):
        for trigger in pattern.triggers:
            index.setdefault(trigger, []).append(i)
    return {t: tuple(ix) for t, ix in index.items()}


TRIGGERS = build_trigger_index(PATTERNS)


def trie_alternation(words: list[str]) -> str:
    """A regex alternation of ``words`` factored as a prefix tree, longest match first.

    Python's regex engine tries the branches of an alternation one by one at every position;
    a flat alternation of ~170 words costs ~170 tries per character. Factored by prefix, a
    position that starts no word is rejected after one branch per distinct first letter, and
    the optional tail of each node makes the match at a position the longest word there.
    """
    root: dict[str, Any] = {}
    for word in words:
        node = root
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict[str, Any]) -> str:
        kids = sorted((ch, sub) for ch, sub in node.items() if ch != "")
        if not kids:
            return ""
        parts = [re.escape(ch) + build(sub) for ch, sub in kids]
        body = parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"
        if "" in node:
            body = "(?:" + body + ")?"
        return body

    return build(root)


def build_trigger_scan(
    index: dict[str, tuple[int, ...]],
) -> tuple[re.Pattern[str], dict[str, tuple[int, ...]]]:
    """One regex that finds, at every position of a lower-cased record, the longest trigger
    starting there, and the map from such a trigger to the (sorted) indices of every pattern
    enabled by it or by any trigger inside it.

    Exact: a trigger T occurring at position q is a prefix of the longest trigger L found at
    q, so T is a substring of L and L's entry includes T's patterns. One C-level scan replaces
    a Python loop of ~170 substring tests per record.
    """
    words = list(index)
    scan = re.compile("(?=(" + trie_alternation(words) + "))")
    closure: dict[str, tuple[int, ...]] = {}
    for word in words:
        enabled: set[int] = set()
        for other in words:
            if other in word:
                enabled.update(index[other])
        closure[word] = tuple(sorted(enabled))
    return scan, closure


TRIGGER_SCAN, TRIGGER_CLOSURE = build_trigger_scan(TRIGGERS)
