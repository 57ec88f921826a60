"""What a launch's log measured, as calibration observations.

On a GPU the log states the terms themselves (weights, activation peak, non-torch memory,
CUDA graphs) and :func:`oomguard.calibration.observation_from_log` reads them. The CPU build
states only the worker's resident memory outside the KV cache ("… GiB memory was consumed by
non-kv usages", or requested − the pool in a failed allocation): the weights are computed
exactly and the activation peak is the model's estimate, so what is left is the runtime
(interpreter, torch, oneDNN, vLLM), stored as the non-torch term. The next prediction for the
same (device, vLLM version, model family, TP) then subtracts the measured sum.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from oomguard.calibration import StartupMeasurement, Store, observation_from_log
from oomguard.errors import OomguardError
from oomguard.logs import Observed, ParsedLog
from oomguard.serve.device import Device
from oomguard.units import GIB

if TYPE_CHECKING:
    from oomguard.memory.engine import MemoryPrediction
    from oomguard.memory.spec import ModelSpec


def cpu_non_kv_gib(parsed: ParsedLog) -> Observed[float] | None:
    """The CPU worker's resident memory outside the KV cache, as the log states it."""
    stated = parsed.fields.get("cpu_non_kv_gib")
    if stated is not None:
        return Observed(float(stated.value), stated.evidence)
    request = parsed.fields.get("cpu_kv_request_gib")
    requested = parsed.get("requested_gib")
    if request is not None and requested is not None:
        return Observed(float(requested) - float(request.value), request.evidence)
    return None


def observation_of(
    parsed: ParsedLog,
    device: Device,
    spec: ModelSpec,
    vllm_version: str,
    *,
    source: str,
    prediction: MemoryPrediction | None = None,
) -> StartupMeasurement | None:
    """The terms ``parsed`` measured, keyed for ``device``; None when it measured none.

    On the CPU backend ``prediction`` (this launch's) supplies the weights and activation
    estimate subtracted from the measured non-KV memory.
    """
    log = parsed
    if device.platform == "cpu" and "non_torch_gib" not in parsed.fields:
        non_kv = cpu_non_kv_gib(parsed)
        if non_kv is None or prediction is None:
            return None
        runtime = (
            non_kv.value
            - (prediction.weights.value_bytes + prediction.activation.value_bytes) / GIB
        )
        if runtime <= 0:
            return None
        log = copy.copy(parsed)
        log.fields = dict(parsed.fields)
        log.fields["non_torch_gib"] = Observed(runtime, non_kv.evidence)
    try:
        return observation_from_log(
            log, source=source, gpu=device.name, vllm_version=vllm_version, model=spec.name
        )
    except OomguardError:
        return None


def store_observation(observation: StartupMeasurement, store: Store | None = None) -> str:
    """Store ``observation``; returns its key. Raises :class:`OomguardError` when the store
    cannot be written."""
    (store or Store()).add([observation])
    return observation.key
