"""The memory model's prediction for the command about to be launched.

Measured terms replace estimates in this order: what an earlier launch of this session showed
in its log (the user's own machine, minutes ago), then the calibration store, then the
estimate. A term measured under other settings is used only where it still holds (the
calibration store's rules: weights need the same dtype and quantization, the activation peak
also the same batch, CUDA graphs the same eager mode and sequences).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from oomguard.errors import OomguardError
from oomguard.logs import ParsedLog
from oomguard.memory.engine import EngineSettings, MeasuredTerms, MemoryPrediction, predict
from oomguard.memory.spec import ModelSpec
from oomguard.serve.command import EngineCommand
from oomguard.serve.device import Device
from oomguard.serve.verify import Predicted, predicted_terms

_TERM_FIELDS = ("weights_bytes", "activation_bytes", "non_torch_bytes", "cudagraph_bytes")


@dataclass(frozen=True)
class Prediction:
    """A command's predicted startup report and where its measured terms came from."""

    memory: MemoryPrediction
    terms: dict[str, Predicted] = field(default_factory=dict)
    measured_from: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        """Whether the model predicts the start succeeds."""
        return bool(self.memory.fits)

    @property
    def problems(self) -> list[str]:
        """Why it would fail, one line each."""
        return [p.message for p in self.memory.problems]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the terms with ranges, the verdict, the problems, the sources."""
        p = self.memory
        return {
            "fits": p.fits,
            "vllm_version": p.vllm_version,
            "device": p.gpu.name,
            "terms": {
                name: {
                    "value": round(t.value, 4) if name != "kv_cache_tokens" else int(t.value),
                    "range": [round(t.low, 4), round(t.high, 4)],
                    "basis": t.basis,
                }
                for name, t in self.terms.items()
            },
            "max_model_len": p.settings.max_model_len,
            "max_num_seqs": p.settings.max_num_seqs,
            "block_size": p.block_size,
            "problems": self.problems,
            "measured_from": list(self.measured_from),
        }


def settings_for(command: EngineCommand, device: Device, vllm_version: str) -> EngineSettings:
    """The command's settings as the memory model takes them on ``device``."""
    parsed = command.parsed()
    version = vllm_version if vllm_version and vllm_version != "unknown" else "latest"
    return parsed.settings(platform=device.platform, vllm_version=version)


def resolve_spec(model: str, quantization: str | None, *, allow_hub: bool) -> ModelSpec:
    """The model's facts (local path, catalogue, hub); raises :class:`OomguardError`."""
    from oomguard.facts.resolve import resolve_model_with_quantization

    return resolve_model_with_quantization(model, quantization, allow_hub=allow_hub)


def predict_command(
    command: EngineCommand,
    spec: ModelSpec,
    device: Device,
    vllm_version: str,
    *,
    session_logs: list[tuple[ParsedLog, MemoryPrediction | None]] | None = None,
    use_calibration: bool = True,
    free_bytes: int | None = None,
) -> Prediction:
    """Predict ``command``'s startup on ``device``; ``session_logs`` are this session's earlier
    launches (their logs and predictions, newest last), whose measured terms come first."""
    from oomguard.facts.resolve import attach_drafter

    settings = attach_drafter(settings_for(command, device, vllm_version))
    sources: list[str] = []
    measured = _session_terms(session_logs or [], settings, device, spec, vllm_version, sources)
    if use_calibration:
        stored = _stored_terms(settings, device, spec, vllm_version)
        if stored is not None:
            measured, used = _merge(measured, stored)
            if used:
                sources.append(stored.source)
    free = free_bytes if free_bytes is not None else device.free_bytes
    memory = predict(spec, device.spec, settings, measured=measured, free_bytes=free, strict=False)
    return Prediction(memory=memory, terms=predicted_terms(memory), measured_from=tuple(sources))


def _merge(first: MeasuredTerms | None, second: MeasuredTerms) -> tuple[MeasuredTerms, bool]:
    """``first``'s terms, with ``second`` filling the ones it lacks; whether any was filled."""
    if first is None:
        return second, any(getattr(second, f) is not None for f in _TERM_FIELDS)
    filled = {
        f: getattr(second, f)
        for f in _TERM_FIELDS
        if getattr(first, f) is None and getattr(second, f) is not None
    }
    return replace(first, **filled), bool(filled)


def _stored_terms(
    settings: EngineSettings, device: Device, spec: ModelSpec, vllm_version: str
) -> MeasuredTerms | None:
    from oomguard.calibration import lookup_for

    try:
        return lookup_for(device.name, vllm_version, spec.name, settings)
    except OomguardError:
        return None  # an unreadable store must not stop a launch


def _session_terms(
    logs: list[tuple[ParsedLog, MemoryPrediction | None]],
    settings: EngineSettings,
    device: Device,
    spec: ModelSpec,
    vllm_version: str,
    sources: list[str],
) -> MeasuredTerms | None:
    """Terms the session's earlier logs measured that hold under ``settings`` (newest first)."""
    from oomguard.calibration.store import settings_filters, terms_from
    from oomguard.serve.calibrate import observation_of

    observations = []
    for number, (parsed, prediction) in reversed(list(enumerate(logs, start=1))):
        obs = observation_of(
            parsed,
            device,
            spec,
            vllm_version,
            source=f"launch {number} of this session",
            prediction=prediction,
        )
        if obs is not None:
            observations.append(obs)
    found = terms_from(observations, **settings_filters(settings))
    if found is not None:
        sources.extend(found.source.split("; "))
    return found
