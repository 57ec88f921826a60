"""The prefix-cache hit rate of each watched server, recorded into the calibration store.

From its first sample of a server the watcher keeps vLLM's prefix-cache counters
(:mod:`oomguard.calibration.prefix`); every :data:`RECORD_EVERY_S` seconds and when the watch
ends it stores the window since then, one row per server and watch, replaced as it grows. A
counter that goes back (the server restarted) starts a new window. The store's key needs the
GPU (``--gpu``, the plan's, or NVML's when the server is on this machine), the vLLM version
(``--vllm-version`` or the server's ``/version``), the model (the plan's, else the served
model name) and TP/PP (the flags, else 1).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from oomguard.calibration.prefix import PrefixCacheWindow, window_between
from oomguard.engine.memory import DeviceMemory
from oomguard.errors import OomguardError
from oomguard.vllm_metrics import VllmSnapshot
from oomguard.watch.plan_figures import PlanFigures
from oomguard.watch.sampling import TargetSample

RECORD_EVERY_S = 300.0


@dataclass(frozen=True)
class RecordKey:
    """What the watch was told about the servers (None: find it out)."""

    gpu: str | None = None
    vllm_version: str | None = None
    tp: int = 1
    pp: int = 1
    store_path: Path | None = None


@dataclass
class _Window:
    first: VllmSnapshot
    first_s: float
    last: VllmSnapshot
    last_s: float


@dataclass
class PrefixCacheRecorder:
    """Follows each server's counters and stores its window (see the module doc)."""

    key: RecordKey
    plans: dict[str, PlanFigures | None]
    windows: dict[str, _Window] = field(default_factory=dict)
    versions: dict[str, str | None] = field(default_factory=dict)
    recorded_s: float = field(default_factory=time.monotonic)
    stored: list[dict[str, Any]] = field(default_factory=list)

    def observe(self, samples: list[TargetSample], now_s: float) -> None:
        """Take the counters of this round's samples (``now_s``: Unix time)."""
        for s in samples:
            snap = s.snapshot
            if snap is None or snap.prefix_cache_queries_total is None:
                continue
            w = self.windows.get(s.name)
            if w is None or window_between(w.first, snap, w.first_s, now_s) is None:
                self.windows[s.name] = _Window(snap, now_s, snap, now_s)
            else:
                w.last, w.last_s = snap, now_s

    def window(self, name: str) -> PrefixCacheWindow | None:
        """The window measured so far for server ``name``."""
        w = self.windows.get(name)
        return None if w is None else window_between(w.first, w.last, w.first_s, w.last_s)

    def due(self) -> bool:
        """Whether the periodic record is due."""
        return time.monotonic() - self.recorded_s >= RECORD_EVERY_S

    async def record(
        self, session: aiohttp.ClientSession, devices: list[DeviceMemory] | None, local: set[str]
    ) -> list[dict[str, Any]]:
        """Store every server's window that counted lookups; what was stored or why not."""
        self.recorded_s = time.monotonic()
        out = []
        for name in list(self.windows):
            window = self.window(name)
            if window is None or window.queries == 0:
                continue
            gpu = self._gpu(name, devices if name in local else None)
            version = self.key.vllm_version or await self._version(session, name)
            out.append(self._store(name, window, gpu, version))
        self.stored = out
        return out

    def _gpu(self, name: str, devices: list[DeviceMemory] | None) -> str | None:
        plan = self.plans.get(name)
        if self.key.gpu:
            return self.key.gpu
        if plan is not None and plan.gpu_name not in ("", "?"):
            return plan.gpu_name
        return devices[0].name if devices else None

    async def _version(self, session: aiohttp.ClientSession, name: str) -> str | None:
        if name not in self.versions:
            version = None
            try:
                timeout = aiohttp.ClientTimeout(total=5)
                async with session.get(name + "/version", timeout=timeout) as resp:
                    data = await resp.json(content_type=None) if resp.status == 200 else None
                if isinstance(data, dict) and isinstance(data.get("version"), str):
                    version = data["version"]
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
                version = None
            self.versions[name] = version
        return self.versions[name]

    def _store(
        self, name: str, window: PrefixCacheWindow, gpu: str | None, version: str | None
    ) -> dict[str, Any]:
        from oomguard.calibration import StartupMeasurement, Store, catalogue_gpu_name, model_family
        from oomguard.calibration.prefix import window_fields

        plan = self.plans.get(name)
        model = plan.model if plan is not None else self.windows[name].last.model_name
        missing = [
            why
            for why, value in (
                ("the GPU is unknown (pass --gpu)", gpu),
                ("the server does not state a vLLM version (pass --vllm-version)", version),
                ("the model is unknown (pass --model or --plan)", model),
            )
            if not value
        ]
        if missing:
            return {"server": name, "stored": False, "why": "; ".join(missing)}
        assert gpu is not None and version is not None and model is not None
        obs = StartupMeasurement(
            gpu=catalogue_gpu_name(gpu),
            vllm_version=version,
            model=model,
            family=model_family(model),
            tp=self.key.tp,
            pp=self.key.pp,
            gpu_raw=gpu,
            source=f"watch {name}",
            engine="V1",
            **window_fields(window),
        )
        store = Store(self.key.store_path) if self.key.store_path else Store()
        try:
            store.add([obs])
        except OomguardError as exc:
            return {"server": name, "stored": False, "why": exc.one_line()}
        except OSError as exc:  # a store that cannot be written must not end the watch
            return {"server": name, "stored": False, "why": f"{store.path}: {exc.strerror or exc}"}
        return {"server": name, "stored": True, "key": obs.key, **window.to_dict()}
