"""A small JSON store of calibration observations with atomic writes.

Location: ``$OOMGUARD_HOME/calibration.json`` when ``OOMGUARD_HOME`` is set, else
``~/.cache/oomguard/calibration.json``. Entries are keyed by (GPU, vLLM version, model family,
TP); the newest observation for a key wins, older ones are kept (a few per key) for reference.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from oomguard.errors import BadInput, MalformedConfig
from oomguard.logs import ParsedLog, parse_file

GIB = 2**30
STORE_VERSION = 1
KEEP_PER_KEY = 5

try:  # the memory model owns the type; keep a compatible fallback while it is absent
    from oomguard.memory.engine import MeasuredTerms
except ImportError:  # pragma: no cover - only before memory/engine.py exists

    @dataclass(frozen=True)
    class MeasuredTerms:  # type: ignore[no-redef]
        weights_bytes: int | None = None
        activation_bytes: int | None = None
        non_torch_bytes: int | None = None
        cudagraph_bytes: int | None = None
        source: str = ""


@dataclass(frozen=True)
class Observation:
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

    @property
    def key(self) -> str:
        return make_key(self.gpu, self.vllm_version, self.family, self.tp)

    def measured_terms(self) -> MeasuredTerms:
        def b(gib: float | None) -> int | None:
            return None if gib is None else int(gib * GIB)

        return MeasuredTerms(
            weights_bytes=b(self.weights_gib),
            activation_bytes=b(self.activation_gib),
            non_torch_bytes=b(self.non_torch_gib),
            cudagraph_bytes=b(self.cudagraph_gib),
            source=f"calibration: {self.source or self.key}",
        )


def default_path() -> Path:
    """Where the store lives (see module docstring)."""
    home = os.environ.get("OOMGUARD_HOME")
    if home:
        return Path(home).expanduser() / "calibration.json"
    return Path.home() / ".cache" / "oomguard" / "calibration.json"


def model_family(model: str) -> str:
    """A model's family and size, without org, quantization and chat suffixes.

    ``meta-llama/Llama-3.1-8B-Instruct`` → ``llama-3.1-8b``; quantized variants keep the
    quantization (weights differ): ``…-AWQ`` → ``llama-3.1-8b-awq``.
    """
    name = model.strip().rstrip("/").split("/")[-1].lower()
    quant = ""
    for word in (
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
    ):
        if word in name:
            quant = word
            break
    name = re.sub(r"[-_.](?:instruct|chat|it|hf|base)(?=$|[-_.])", "", name)
    name = re.sub(
        r"[-_.](?:awq|gptq|fp8(?:-dynamic)?|int[48]|w\d+a\d+|quantized|bnb-4bit|4bit|8bit|gguf|nvfp4|mxfp4)(?=$|[-_.])",
        "",
        name,
    )
    name = name.strip("-_.")
    return f"{name}-{quant}" if quant else name


def make_key(gpu: str, vllm_version: str, family: str, tp: int) -> str:
    gpu_norm = re.sub(r"\s+", " ", gpu.strip().lower())
    version = re.sub(r"^v", "", vllm_version.strip().lower())
    minor = re.match(r"(\d+\.\d+)", version)
    return f"{gpu_norm}|{minor.group(1) if minor else version}|{family}|tp{tp}"


class Store:
    """The calibration file. Reads lazily; every write replaces the file atomically."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_path()

    def load(self) -> dict[str, list[dict[str, Any]]]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise BadInput(
                f"cannot read the calibration store {self.path}: {exc.strerror}",
                "check its permissions or set OOMGUARD_HOME",
            ) from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise MalformedConfig(
                f"calibration store {self.path} is not valid JSON ({exc.msg})",
                "delete it or fix it; it is rebuilt by `oomguard calibrate`",
            ) from exc
        entries = data.get("entries", {}) if isinstance(data, dict) else {}
        return entries if isinstance(entries, dict) else {}

    def add(self, observations: Iterable[Observation]) -> list[Observation]:
        """Store observations (newest first per key); returns those stored."""
        entries = self.load()
        stored: list[Observation] = []
        for obs in observations:
            rows = entries.setdefault(obs.key, [])
            row = asdict(obs)
            rows[:] = [r for r in rows if r != row]
            rows.insert(0, row)
            del rows[KEEP_PER_KEY:]
            stored.append(obs)
        if stored:
            self._write(entries)
        return stored

    def get(self, key: str) -> Observation | None:
        rows = self.load().get(key) or []
        if not rows:
            return None
        known = {f for f in Observation.__dataclass_fields__}
        return Observation(**{k: v for k, v in rows[0].items() if k in known})

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


def observation_from_log(
    parsed: ParsedLog,
    *,
    source: str = "",
    gpu: str | None = None,
    vllm_version: str | None = None,
    model: str | None = None,
    tp: int | None = None,
) -> Observation | None:
    """The calibration terms a parsed start-up log states, or None when it states none.

    GPU, version, model and TP come from the log, else from the arguments. The key needs
    all four: raises :class:`BadInput` naming what is missing and the option that supplies it.
    """
    weights = parsed.get("weights_gib")
    activation = parsed.get("activation_gib")
    non_torch = parsed.get("non_torch_gib")
    graphs = parsed.get("cudagraph_estimate_gib")
    if graphs is None:
        graphs = parsed.get("cudagraph_actual_gib")
    if weights is None and activation is None and non_torch is None and graphs is None:
        return None
    gpu = gpu or parsed.get("gpu_name")
    if gpu is None and parsed.get("gpu_total_gib") is not None:
        gpu = f"{parsed.get('gpu_total_gib'):.2f} GiB GPU"
    version = vllm_version or parsed.get("vllm_version")
    model = model or parsed.get("model")
    tp_value = tp or parsed.get("tensor_parallel_size") or (1 if parsed.args else None)
    missing = [
        name
        for name, value in (("--gpu", gpu), ("--vllm-version", version), ("--model", model))
        if not value
    ]
    if missing:
        raise BadInput(
            f"{source or 'the log'} does not say its {', '.join(m[2:] for m in missing)}",
            f"pass {' and '.join(missing)} to `oomguard calibrate`",
        )
    return Observation(
        gpu=str(gpu),
        vllm_version=str(version),
        model=str(model),
        family=model_family(str(model)),
        tp=int(tp_value or 1),
        weights_gib=weights,
        activation_gib=activation,
        non_torch_gib=non_torch,
        cudagraph_gib=graphs,
        available_kv_gib=parsed.get("available_kv_gib"),
        kv_tokens=parsed.get("kv_tokens"),
        engine=parsed.get("engine"),
        source=source,
    )


def record_logs(
    paths: Iterable[str | Path],
    *,
    store: Store | None = None,
    gpu: str | None = None,
    vllm_version: str | None = None,
    model: str | None = None,
    tp: int | None = None,
) -> tuple[list[Observation], list[str]]:
    """Parse each log and store what it measured; returns (stored, skipped-with-reason)."""
    store = store or Store()
    observations: list[Observation] = []
    skipped: list[str] = []
    for path in paths:
        parsed = parse_file(path)
        obs = observation_from_log(
            parsed, source=str(path), gpu=gpu, vllm_version=vllm_version, model=model, tp=tp
        )
        if obs is None:
            skipped.append(
                f"{path}: no start-up memory figures (weights, activation, non-torch, graphs)"
            )
            continue
        observations.append(obs)
    return store.add(observations), skipped


def lookup(
    gpu_name: str, vllm_version: str, model_name: str, tp: int, *, store: Store | None = None
) -> MeasuredTerms | None:
    """The stored measured terms for (GPU, vLLM version (same minor), model family, TP), or None."""
    store = store or Store()
    obs = store.get(make_key(gpu_name, vllm_version, model_family(model_name), tp))
    return obs.measured_terms() if obs is not None else None
