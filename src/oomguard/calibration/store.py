"""A small JSON store of calibration observations with atomic writes.

Location: ``$OOMGUARD_HOME/calibration.json`` when ``OOMGUARD_HOME`` is set, else
``~/.cache/oomguard/calibration.json``. Entries are keyed by (GPU, vLLM version, model family,
TP, PP); a few observations are kept per key, newest first. Each observation also records the
settings that decide whether a measured term carries over to another configuration (batch
tokens, sequences, eager mode, dtype, quantization, KV dtype): :func:`lookup` returns, term by
term, the newest measurement taken under matching settings.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from oomguard.documents import load_document
from oomguard.errors import BadInput, OomguardError
from oomguard.memory.engine import EngineSettings, MeasuredTerms
from oomguard.units import GIB

if TYPE_CHECKING:  # the log parser is loaded only to record logs: planning reads JSON only
    from oomguard.logs import ParsedLog

STORE_VERSION = 1
KEEP_PER_KEY = 8

# the settings an observation records (ParsedLog field names); pipeline parallelism is in the key
SETTINGS: Final = (
    "max_num_batched_tokens",
    "max_num_seqs",
    "enforce_eager",
    "dtype",
    "quantization",
    "kv_cache_dtype",
)
TERMS: Final = ("weights", "activation", "non_torch", "cudagraph")
# which settings a measured term depends on (besides GPU, version, model, TP and PP):
#   weights: the precision they load in; activation: the profiled batch (tokens, and sequences
#   for the sampler's logits) at that precision; CUDA graphs: captured at all (eager mode),
#   their capture sizes (up to 2 × max_num_seqs) and the precision of their buffers (the same
#   Llama-3.1-8B on an H100 under 0.19: 0.91 GiB bf16, 0.87 GiB fp8, 0.79 GiB fp32);
#   non-torch memory: none.
TERM_SETTINGS: Final[dict[str, tuple[str, ...]]] = {
    "weights": ("dtype", "quantization"),
    "activation": ("max_num_batched_tokens", "max_num_seqs", "dtype", "quantization"),
    "cudagraph": ("enforce_eager", "max_num_seqs", "dtype", "quantization"),
    "non_torch": (),
}
# settings whose default is one fixed value whatever the version, GPU or model (None: unset)
_FIXED_DEFAULT: Final[dict[str, Any]] = {
    "enforce_eager": False,
    "quantization": None,
    "kv_cache_dtype": None,
}


class _Unset(Enum):
    UNSET = "unset"


UNSET: Final = _Unset.UNSET
"""A :func:`lookup` filter left at this value does not filter (None means "vLLM's default")."""


@dataclass(frozen=True)
class StartupMeasurement:
    """The measured terms of one vLLM start-up, with its key and where it came from."""

    gpu: str
    vllm_version: str
    model: str
    family: str
    tp: int
    weights_gib: float | None = None
    activation_gib: float | None = None
    non_torch_gib: float | None = None
    cudagraph_gib: float | None = None
    available_kv_gib: float | None = None
    kv_tokens: int | None = None
    engine: str | None = None
    source: str = ""
    recorded_at: str = field(
        default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds")
    )
    pp: int = 1
    gpu_raw: str | None = None  # the GPU as the log (or --gpu) named it; ``gpu`` is the catalogue's
    # the settings in force, normalised (see :func:`normalize_setting`); None: not stated, or
    # vLLM's default when ``args_stated``
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool | None = None
    dtype: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str | None = None
    user_set: tuple[str, ...] = ()  # which of SETTINGS the user's own arguments set
    args_stated: bool = False  # the log shows the user's arguments: the others were defaults
    # measured under load by `oomguard bench` (None for observations from start-up logs): the
    # most requests of ``bench_sequence_tokens`` (prompt + max_tokens) the pool held without a
    # preemption, and its bytes per token where the server stated its pool in bytes
    max_safe_concurrency: int | None = None
    bench_sequence_tokens: int | None = None
    kv_bytes_per_token: float | None = None
    # measured by `oomguard bench` or `oomguard watch` (:mod:`oomguard.calibration.prefix`):
    # over a window of ``prefix_cache_window_s`` seconds from ``prefix_cache_since`` (ISO, UTC),
    # the prompt tokens looked up in vLLM's prefix cache, those found there, and the requests
    # that finished meanwhile
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    prefix_cache_requests: int | None = None
    prefix_cache_window_s: float | None = None
    prefix_cache_since: str | None = None

    @property
    def key(self) -> str:
        return make_key(self.gpu, self.vllm_version, self.family, self.tp, self.pp)

    def measured_terms(self) -> MeasuredTerms:
        """All terms this observation measured, whatever the settings they are used with."""

        def b(gib: float | None) -> int | None:
            return None if gib is None else int(gib * GIB)

        return MeasuredTerms(
            weights_bytes=b(self.weights_gib),
            activation_bytes=b(self.activation_gib),
            non_torch_bytes=b(self.non_torch_gib),
            cudagraph_bytes=b(self.cudagraph_gib),
            source=f"calibration: {self.source or self.key}",
        )

    def settings(self) -> dict[str, Any]:
        """The recorded settings by name (normalised; None: unstated or vLLM's default)."""
        return {name: getattr(self, name) for name in SETTINGS}

    def applicable_terms(
        self,
        *,
        max_num_batched_tokens: int | None | _Unset = UNSET,
        max_num_seqs: int | None | _Unset = UNSET,
        enforce_eager: bool | None | _Unset = UNSET,
        quantization: str | None | _Unset = UNSET,
        dtype: str | None | _Unset = UNSET,
    ) -> tuple[str, ...]:
        """The measured terms (of :data:`TERMS`) that still hold under the given settings.

        A filter left at :data:`UNSET` does not filter; None means "left to vLLM". A term
        applies when every setting it depends on (:data:`TERM_SETTINGS`) matches; a setting
        the log did not state is taken to be vLLM's default.
        """
        wanted = {
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_num_seqs": max_num_seqs,
            "enforce_eager": enforce_eager,
            "quantization": quantization,
            "dtype": dtype,
        }
        ok = {name: value is UNSET or self._matches(name, value) for name, value in wanted.items()}
        return tuple(
            term
            for term in TERMS
            if getattr(self, f"{term}_gib") is not None
            and all(ok.get(name, True) for name in TERM_SETTINGS[term])
        )

    def _matches(self, name: str, wanted: Any) -> bool:
        have = getattr(self, name)
        want = normalize_setting(name, wanted)
        if name == "quantization" and _family_format(self.family):
            # a quantized checkpoint loads in its own format whatever --quantization says
            return True
        if name in _FIXED_DEFAULT:
            default = _FIXED_DEFAULT[name]
            return (default if have is None else have) == (default if want is None else want)
        if want is None:
            # left to vLLM: holds when the logged run left it to vLLM too (same GPU, version
            # and model, so the same default)
            return name not in self.user_set or have is None
        return have == want


def default_path() -> Path:
    """Where the store lives (see module docstring)."""
    home = os.environ.get("OOMGUARD_HOME")
    if home:
        return Path(home).expanduser() / "calibration.json"
    return Path.home() / ".cache" / "oomguard" / "calibration.json"


# quantization words a family name keeps, first match wins
_FAMILY_FORMATS: Final = (
    "awq",
    "gptq",
    "fp8",
    "int4",
    "int8",
    "w4a16",
    "w8a8",
    "bnb-4bit",
    "gguf",
    "nvfp4",
    "mxfp4",
)


def model_family(model: str) -> str:
    """A model's family and size, without org, quantization and chat suffixes.

    ``meta-llama/Llama-3.1-8B-Instruct`` → ``llama-3.1-8b``; quantized variants keep the
    quantization (weights differ): ``…-AWQ`` → ``llama-3.1-8b-awq``.
    """
    name = model.strip().rstrip("/").split("/")[-1].lower()
    quant = ""
    for word in _FAMILY_FORMATS:
        if word in name:
            quant = word
            break
    name = re.sub(r"[-_.](?:instruct|chat|it|hf|base)(?=$|[-_.])", "", name)
    name = re.sub(
        r"[-_.](?:awq|gptq|fp8(?:-dynamic)?|int[48]|w\d+a\d+|quantized|bnb-4bit|4bit|8bit|gguf"
        r"|nvfp4|mxfp4)(?=$|[-_.])",
        "",
        name,
    )
    name = name.strip("-_.")
    return f"{name}-{quant}" if quant else name


def make_key(gpu: str, vllm_version: str, family: str, tp: int, pp: int = 1) -> str:
    """The store key: GPU name, vLLM minor version, model family, TP and (when > 1) PP.

    PP 1 keeps the short form (``…|tp2``) that stores written before PP was keyed use.
    """
    gpu_norm = re.sub(r"\s+", " ", gpu.strip().lower())
    version = re.sub(r"^v", "", vllm_version.strip().lower())
    minor = re.match(r"(\d+\.\d+)", version)
    key = f"{gpu_norm}|{minor.group(1) if minor else version}|{family}|tp{tp}"
    return key if pp <= 1 else f"{key}|pp{pp}"


_QUANT_ALIASES: Final = {
    "awq_marlin": "awq",
    "gptq_marlin": "gptq",
    "gptq_marlin_24": "gptq",
    "gptq_bitblas": "gptq",
    "bnb": "bitsandbytes",
    "compressed_tensors": "compressed-tensors",
}
_DTYPE_ALIASES: Final = {
    "half": "float16",
    "fp16": "float16",
    "float16": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "fp32": "float32",
    "float32": "float32",
}


def normalize_setting(name: str, value: Any) -> Any:
    """One spelling per setting value, so a log's and a planner's settings compare equal.

    ``dtype``: ``float16``/``bfloat16``/``float32`` (``half``, ``torch.bfloat16``…), None for
    ``auto``; ``quantization``: the method without kernel suffixes (``awq_marlin`` → ``awq``),
    None for none; ``kv_cache_dtype``: None for ``auto``; counts as int; eager as bool.
    """
    if value is None or value is UNSET:
        return None
    if name in ("max_num_batched_tokens", "max_num_seqs"):
        try:
            number = int(value)
        except (TypeError, ValueError):
            return None
        return number if number > 0 else None
    if name == "enforce_eager":
        if isinstance(value, str):
            return value.strip().lower() in ("true", "1", "yes")
        return bool(value)
    text = str(value).strip().lower().removeprefix("torch.")
    if text in ("", "none", "auto"):
        return None
    if name == "dtype":
        return _DTYPE_ALIASES.get(text, text)
    if name == "quantization":
        return _QUANT_ALIASES.get(text, text)
    return text


def _family_format(family: str) -> str:
    """The quantization word :func:`model_family` kept in a family name ('' when none)."""
    for word in _FAMILY_FORMATS:
        if family.endswith("-" + word):
            return word
    return ""


def catalogue_gpu_name(name: str, total_gib: float | None = None) -> str:
    """The GPU catalogue's name for ``name`` (``NVIDIA H100 80GB HBM3`` → ``H100 SXM``).

    ``name`` itself when the catalogue does not know it, or when ``total_gib`` (what the log
    measured) disagrees with the catalogue entry by more than 0.5 GiB (a different variant).
    """
    try:
        from oomguard.facts.gpus import find_gpu

        spec = find_gpu(name)
    except OomguardError:
        return name
    if total_gib is not None and abs(spec.total_bytes / GIB - float(total_gib)) > 0.5:
        return name
    return spec.name


class Store:
    """The calibration file. Reads lazily; every write replaces the file atomically."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_path()

    def load(self) -> dict[str, list[dict[str, Any]]]:
        if not self.path.exists():
            return {}
        data = load_document(
            self.path,
            "the calibration store",
            read_hint="check its permissions or set OOMGUARD_HOME",
            parse_hint="delete it or fix it; it is rebuilt by `oomguard calibrate`",
        )
        entries = data.get("entries", {}) if isinstance(data, dict) else {}
        return entries if isinstance(entries, dict) else {}

    def add(self, observations: Iterable[StartupMeasurement]) -> list[StartupMeasurement]:
        """Store observations (newest first per key); returns those stored.

        Recording the same log again replaces its earlier row instead of adding a copy, and
        a longer window of the same hit-rate measurement (same source and start) replaces the
        shorter one.
        """
        entries = self.load()
        stored: list[StartupMeasurement] = []
        for obs in observations:
            rows = entries.setdefault(obs.key, [])
            row = asdict(obs)
            rows[:] = [r for r in rows if not (_same_measurement(r, row) or _same_window(r, row))]
            rows.insert(0, row)
            del rows[KEEP_PER_KEY:]
            stored.append(obs)
        if stored:
            self._write(entries)
        return stored

    def rows(self, key: str) -> list[StartupMeasurement]:
        """The observations stored under ``key``, newest first (unreadable rows skipped)."""
        out = []
        for row in self.load().get(key) or []:
            obs = observation_from_row(row)
            if obs is not None:
                out.append(obs)
        return out

    def get(self, key: str) -> StartupMeasurement | None:
        """The newest observation stored under ``key``, or None."""
        rows = self.rows(key)
        return rows[0] if rows else None

    def _write(self, entries: dict[str, list[dict[str, Any]]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        payload = json.dumps(
            {"version": STORE_VERSION, "entries": entries}, indent=1, sort_keys=True
        )
        fd, tmp = tempfile.mkstemp(prefix=".calibration-", suffix=".json", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(payload)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def observation_from_row(row: Any) -> StartupMeasurement | None:
    """An :class:`StartupMeasurement` from one stored row (older stores lack the newer fields), or
    None when the row is not one."""
    if not isinstance(row, dict):
        return None
    known = set(StartupMeasurement.__dataclass_fields__)
    values = {k: v for k, v in row.items() if k in known}
    if isinstance(values.get("user_set"), list):
        values["user_set"] = tuple(values["user_set"])
    try:
        return StartupMeasurement(**values)
    except TypeError:  # a required field is missing
        return None


def _same_measurement(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def strip(row: dict[str, Any]) -> Any:
        # as stored: JSON turns tuples into lists
        return json.loads(json.dumps({k: v for k, v in row.items() if k != "recorded_at"}))

    return strip(a) == strip(b)


def _same_window(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two rows of one hit-rate measurement that goes on (the later one covers the earlier)."""
    since = b.get("prefix_cache_since")
    return (
        since is not None
        and a.get("prefix_cache_since") == since
        and a.get("source") == b.get("source")
    )


def observation_from_log(
    parsed: ParsedLog,
    *,
    source: str = "",
    gpu: str | None = None,
    vllm_version: str | None = None,
    model: str | None = None,
    tp: int | None = None,
    pp: int | None = None,
) -> StartupMeasurement | None:
    """The calibration terms a parsed start-up log states, or None when it states none.

    GPU, version, model, TP and PP come from the log, else from the arguments; the GPU is
    stored under its catalogue name when it resolves (the name as given is kept in
    ``gpu_raw``). The settings that decide where the terms apply (batch tokens, sequences,
    eager mode, dtype, quantization, KV dtype) come from the user's arguments in the log, else
    from what the log states in force. The key needs GPU, version and model: raises
    :class:`BadInput` naming what is missing and the option that supplies it.
    """
    weights = parsed.get("weights_gib")
    activation = parsed.get("activation_gib")
    non_torch = parsed.get("non_torch_gib")
    graphs = parsed.get("cudagraph_estimate_gib")
    if graphs is None:
        graphs = parsed.get("cudagraph_actual_gib")
    if weights is None and activation is None and non_torch is None and graphs is None:
        return None
    total_gib = parsed.get("gpu_total_gib")
    raw_gpu = gpu or parsed.get("gpu_name")
    if raw_gpu is None and total_gib is not None:
        raw_gpu = f"{total_gib:.2f} GiB GPU"
    version = vllm_version or parsed.get("vllm_version")
    model = model or parsed.get("model")
    tp_value = tp or parsed.get("tensor_parallel_size") or (1 if parsed.args else None)
    pp_value = pp or parsed.get("pipeline_parallel_size") or 1
    missing = [
        name
        for name, value in (("--gpu", raw_gpu), ("--vllm-version", version), ("--model", model))
        if not value
    ]
    if missing:
        raise BadInput(
            f"{source or 'the log'} does not say its {', '.join(m[2:] for m in missing)}",
            f"pass {' and '.join(missing)} to `oomguard calibrate`",
        )
    user = parsed.user_settings
    settings: dict[str, Any] = {}
    for name in SETTINGS:
        value = user[name] if name in user else parsed.get(name)
        settings[name] = normalize_setting(name, value)
    if settings["enforce_eager"] is None and graphs:
        settings["enforce_eager"] = False  # graphs were captured: the run was not eager
    family = model_family(str(model))
    return StartupMeasurement(
        gpu=catalogue_gpu_name(str(raw_gpu), total_gib),
        vllm_version=str(version),
        model=str(model),
        family=family,
        tp=int(tp_value or 1),
        weights_gib=weights,
        activation_gib=activation,
        non_torch_gib=non_torch,
        cudagraph_gib=graphs,
        available_kv_gib=parsed.get("available_kv_gib"),
        kv_tokens=parsed.get("kv_tokens"),
        engine=parsed.get("engine"),
        source=source,
        pp=int(pp_value),
        gpu_raw=str(raw_gpu),
        user_set=tuple(name for name in SETTINGS if name in user),
        args_stated=parsed.user_args_evidence is not None,
        **settings,
    )


def record_logs(
    paths: Iterable[str | Path],
    *,
    store: Store | None = None,
    gpu: str | None = None,
    vllm_version: str | None = None,
    model: str | None = None,
    tp: int | None = None,
    pp: int | None = None,
) -> tuple[list[StartupMeasurement], list[str]]:
    """Parse each log and store what it measured; returns (stored, skipped-with-reason)."""
    from oomguard.logs import parse_file

    store = store or Store()
    observations: list[StartupMeasurement] = []
    skipped: list[str] = []
    for path in paths:
        parsed = parse_file(path)
        obs = observation_from_log(
            parsed,
            source=str(path),
            gpu=gpu,
            vllm_version=vllm_version,
            model=model,
            tp=tp,
            pp=pp,
        )
        if obs is None:
            skipped.append(
                f"{path}: no start-up memory figures (weights, activation, non-torch, graphs)"
            )
            continue
        observations.append(obs)
    return store.add(observations), skipped


def settings_filters(settings: EngineSettings) -> dict[str, Any]:
    """The :func:`lookup` / :func:`terms_from` filters an engine's settings stand for: each one
    a stored term depends on (``dtype="auto"`` filters as vLLM's default, None). Pipeline
    parallelism is part of the key, not a filter, so it is not among them."""
    return {
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "max_num_seqs": settings.max_num_seqs,
        "enforce_eager": settings.enforce_eager,
        "quantization": settings.quantization,
        "dtype": None if settings.dtype in (None, "auto") else settings.dtype,
    }


def lookup_for(
    gpu_name: str, vllm_version: str, model_name: str, settings: EngineSettings
) -> MeasuredTerms | None:
    """:func:`lookup` for an engine's settings: its TP and PP pick the key, the rest filter."""
    return lookup(
        gpu_name,
        vllm_version,
        model_name,
        settings.tensor_parallel_size,
        pp=settings.pipeline_parallel_size,
        **settings_filters(settings),
    )


def lookup(
    gpu_name: str,
    vllm_version: str,
    model_name: str,
    tp: int,
    *,
    store: Store | None = None,
    pp: int = 1,
    max_num_batched_tokens: int | None | _Unset = UNSET,
    max_num_seqs: int | None | _Unset = UNSET,
    enforce_eager: bool | None | _Unset = UNSET,
    quantization: str | None | _Unset = UNSET,
    dtype: str | None | _Unset = UNSET,
) -> MeasuredTerms | None:
    """The measured terms stored for (GPU, vLLM version (same minor), model family, TP, PP)
    that apply to the given settings, or None when none does.

    The GPU may be named any way the GPU catalogue resolves (NVML's name, a short name); rows
    stored under another spelling of the same GPU are found too. Each filter left out does not
    filter; None means "left to vLLM's default", as in
    :class:`~oomguard.memory.engine.EngineSettings`. Weights need the same dtype and
    quantization; the activation peak also the same ``max_num_batched_tokens`` and
    ``max_num_seqs``; CUDA graphs the same ``enforce_eager`` and ``max_num_seqs``; non-torch
    memory only the key. Each term comes from the newest observation that measured it under
    matching settings; a term none matches is left None for the estimate to fill.
    """
    store = store or Store()
    if not store.path.exists():
        return None  # nothing calibrated yet: the common case, answered without reading
    family = model_family(model_name)
    rows = rows_for(store, gpu_name, vllm_version, family, tp, pp)
    found = terms_from(
        rows,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enforce_eager=enforce_eager,
        quantization=quantization,
        dtype=dtype,
    )
    if found is None:
        return None
    return replace(found, source="calibration: " + found.source)


def terms_from(
    observations: Iterable[StartupMeasurement],
    *,
    max_num_batched_tokens: int | None | _Unset = UNSET,
    max_num_seqs: int | None | _Unset = UNSET,
    enforce_eager: bool | None | _Unset = UNSET,
    quantization: str | None | _Unset = UNSET,
    dtype: str | None | _Unset = UNSET,
) -> MeasuredTerms | None:
    """Each term from the first of ``observations`` (newest first) that measured it under
    settings matching the filters (see :meth:`StartupMeasurement.applicable_terms`); the source
    names the observations used. None when no term applies."""
    filters: dict[str, Any] = {
        "max_num_batched_tokens": max_num_batched_tokens,
        "max_num_seqs": max_num_seqs,
        "enforce_eager": enforce_eager,
        "quantization": quantization,
        "dtype": dtype,
    }
    found: dict[str, int] = {}
    sources: list[str] = []
    for obs in observations:
        for term in obs.applicable_terms(**filters):
            if term in found:
                continue
            found[term] = int(float(getattr(obs, f"{term}_gib")) * GIB)
            label = obs.source or obs.key
            if label not in sources:
                sources.append(label)
    if not found:
        return None
    return MeasuredTerms(
        weights_bytes=found.get("weights"),
        activation_bytes=found.get("activation"),
        non_torch_bytes=found.get("non_torch"),
        cudagraph_bytes=found.get("cudagraph"),
        source="; ".join(sources),
    )


def rows_for(
    store: Store, gpu_name: str, vllm_version: str, family: str, tp: int, pp: int
) -> list[StartupMeasurement]:
    """Observations for the key, newest first: under the catalogue GPU name, the name as
    given, and any other spelling that resolves to the same catalogue GPU."""
    catalogue_name = catalogue_gpu_name(gpu_name)
    wanted = make_key(catalogue_name, vllm_version, family, tp, pp)
    entries = store.load()
    keys = [wanted, make_key(gpu_name, vllm_version, family, tp, pp)]
    suffix = wanted.split("|", 1)[1]
    for key in entries:
        if key in keys or key.split("|", 1)[-1] != suffix:
            continue
        stored = entries[key]
        first = observation_from_row(stored[0]) if stored else None
        if first is not None and catalogue_gpu_name(first.gpu) == catalogue_name:
            keys.append(key)
    rows: list[StartupMeasurement] = []
    for key in dict.fromkeys(keys):
        rows.extend(r for r in map(observation_from_row, entries.get(key) or []) if r is not None)
    rows.sort(key=lambda o: o.recorded_at, reverse=True)
    return rows
