"""Gateway configuration: pydantic models, YAML loading, CLI overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from oomguard.errors import BadInput, MalformedConfig


class BackendConfig(BaseModel):
    """One vLLM server. Capacity fields override what its ``/metrics`` reports (from a plan)."""

    model_config = ConfigDict(extra="forbid")

    url: str
    num_gpu_blocks: int | None = Field(default=None, ge=2)
    block_size: int | None = Field(default=None, ge=1)
    max_model_len: int | None = Field(default=None, ge=1)
    # Sent upstream as ``Authorization: Bearer …`` (vLLM's --api-key) instead of the client's.
    api_key: str | None = None
    # "auto": llama-server when /props answers as its does (oomguard.guard.llama_backend)
    engine: Literal["auto", "vllm", "llama.cpp"] = "auto"
    kv_unified: bool | None = None  # llama-server: one KV pool shared by all slots (None: assumed)

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"backend URL {v!r} must look like http://HOST:PORT")
        return v.rstrip("/")


class ApiKeyConfig(BaseModel):
    """One client key. ``role: priority`` may set ``x-priority`` / the body's ``priority``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    key: str | None = Field(default=None, min_length=8)
    key_sha256: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{64}$")
    role: Literal["user", "priority"] = "user"

    @model_validator(mode="after")
    def _one_key(self) -> ApiKeyConfig:
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError(f"API key {self.name!r} needs exactly one of `key` or `key_sha256`")
        return self


class GuardConfig(BaseModel):
    """Everything ``oomguard guard`` runs with; defaults are the documented behaviour."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    backends: list[BackendConfig] = Field(min_length=1)
    host: str = "127.0.0.1"
    port: int = Field(default=8100, ge=0, le=65535)
    # Admission (oomguard.guard.admission). Requests whose progress is unknown count at their
    # full size (prompt + max_tokens) and must stay under high_watermark × capacity; refused in
    # the high band, admission pauses until the projected peak is below low_watermark. Tracked
    # requests (track_progress) are projected step by step from their observed progress, with
    # lag allowances that make the projection an upper bound; the projected peak of everything
    # in flight must stay under projected_watermark × capacity (1.0: the whole pool, because
    # the bound is already safe; set it to high_watermark to keep the same margin for both).
    high_watermark: float = Field(default=0.90, gt=0.0, le=1.0)
    low_watermark: float = Field(default=0.80, gt=0.0, le=1.0)
    projected_watermark: float = Field(default=1.0, gt=0.0, le=1.0)
    tighten_factor: float = Field(default=0.90, gt=0.0, le=1.0)
    min_capacity_fraction: float = Field(default=0.50, gt=0.0, le=1.0)
    relax_step: float = Field(default=0.02, ge=0.0, le=1.0)
    calm_period_s: float = Field(default=5.0, ge=0.0)
    # Progress-aware admission (oomguard.guard.projection). "auto" (default): track a request
    # when the full reservations, it included, exceed track_above_fraction of capacity (below
    # that plain reservations fit anyway, and streams are relayed unread); "always"; "off":
    # plain reservations only. Tracking asks the backend for per-chunk usage (non-streamed
    # requests are streamed upstream and assembled).
    track_progress: Literal["auto", "always", "off"] = "auto"
    track_above_fraction: float = Field(default=0.25, ge=0.0, le=1.0)
    progress_lag_s: float = Field(default=0.02, ge=0.0, le=10.0)
    progress_lag_floor_tokens: int = Field(default=2, ge=0)
    progress_start_allowance_s: float = Field(default=0.5, gt=0.0)
    rate_quantile: float = Field(default=0.9, gt=0.0, le=1.0)
    start_latency_quantile: float = Field(default=0.95, gt=0.0, le=1.0)
    # A request admitted now starts no sooner than this share of the low start latencies.
    progress_earliest_start_share: float = Field(default=0.0, ge=0.0, le=1.0)
    stagger_admissions: bool = True
    # A request that fits may pass a queue head that does not, at most this many times per head.
    max_head_bypass: int = Field(default=8, ge=0)
    # Log every admission: the rule that admitted it and the pool as admission saw it.
    log_admissions: bool = False
    # Count the full prompt blocks of a request's n sequences once (vLLM's prefix cache).
    share_prefix_blocks: bool = True
    # Requests sent ahead of a slot freeing to wait in vLLM's queue, per backend (0: none).
    engine_queue_requests: int = Field(default=2, ge=0)
    first_chunk_tokens: int = Field(default=512, ge=1)
    # Learned output lengths (oomguard.guard.output_lengths): a tracked request is planned for
    # this quantile of what its class (model, route, API key, prompt band) really generated,
    # never above max_tokens, once the class has output_length_min_samples completions (0
    # turns the learning off); the projected peak then stays under learned_watermark.
    output_length_quantile: float = Field(default=0.95, ge=0.0, lt=1.0)
    output_length_min_samples: int = Field(default=8, ge=1)
    output_length_window: int = Field(default=256, ge=1)
    learned_watermark: float = Field(default=0.90, gt=0.0, le=1.0)
    # How learned lengths enter admission: "per-request", each sequence planned at the
    # quantile under learned_watermark; "sum", also the distribution of the blocks in flight,
    # its risk of exceeding projected_watermark below a tenth of the quantile's tail
    # (oomguard.guard.projected_sum).
    output_length_projection: Literal["sum", "per-request"] = "sum"
    # queue and shedding
    max_queue_requests: int = Field(default=256, ge=0)
    max_queue_tokens: int = Field(default=4_000_000, ge=0)
    queue_timeout_s: float = Field(default=60.0, gt=0.0)
    max_retry_after_s: int = Field(default=300, ge=1)
    # input limits
    max_body_bytes: int = Field(default=8 * 2**20, ge=1024)
    max_tokens_limit: int = Field(default=1_000_000, ge=1)
    max_prompts_per_request: int = Field(default=256, ge=1)
    max_n: int = Field(default=128, ge=1, le=4096)
    # cost
    tokenizer: Literal["backend", "estimate"] = "backend"
    # With "backend": count with the model's own tokenizer in-process where its files are on
    # this machine (the path or hub id in the backend's /v1/models), else by /tokenize.
    local_tokenizer: bool = True
    estimate_chars_per_token: float = Field(default=3.0, gt=0.0)
    learn_chars_per_token: bool = True
    tokenize_concurrency: int = Field(default=16, ge=1)
    tokenize_concurrency_per_request: int = Field(default=4, ge=1)
    # clients: no keys (the default) = no authentication and no priority honoured
    api_keys: list[ApiKeyConfig] = Field(default_factory=list)
    forward_priority: bool = False
    # backends and failures
    poll_interval_s: float = Field(default=0.25, gt=0.0)
    models_refresh_s: float = Field(default=5.0, gt=0.0)
    health_timeout_s: float = Field(default=1.0, gt=0.0)
    eject_after_failures: int = Field(default=2, ge=1)
    upstream_timeout_s: float = Field(default=600.0, gt=0.0)
    tokenize_timeout_s: float = Field(default=5.0, gt=0.0)
    max_retries: int = Field(default=3, ge=0)
    # How long an accepted request waits for a failed backend to come back. None (default):
    # twice the longest restart or startup seen on the backends, at least restart_wait_min_s.
    restart_wait_s: float | None = Field(
        default=None, gt=0.0, validation_alias=AliasChoices("restart_wait_s", "retry_wait_s")
    )
    restart_wait_min_s: float = Field(default=900.0, gt=0.0)
    # replicas sharing admission through Redis
    redis_url: str | None = None
    redis_prefix: str = Field(default="oomguard", min_length=1)
    lease_s: float = Field(default=10.0, ge=1.0)
    snapshot_max_age_s: float = Field(default=2.0, gt=0.0)
    redis_timeout_s: float = Field(default=0.5, gt=0.0)
    replicas: int | None = Field(default=None, ge=1)
    workers: int = Field(default=1, ge=1, le=256)
    # "uvloop": libuv's event loop (fewer CPU cycles per relayed request) where installed,
    # else asyncio's own; "asyncio": always asyncio's own.
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"

    @field_validator("backends", mode="before")
    @classmethod
    def _backends_from_strings(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [{"url": b} if isinstance(b, str) else b for b in v]
        return v

    @model_validator(mode="after")
    def _check_watermarks(self) -> GuardConfig:
        if self.low_watermark >= self.high_watermark:
            raise ValueError(
                f"low_watermark ({self.low_watermark}) must be below high_watermark "
                f"({self.high_watermark})"
            )
        if self.workers > 1 and not self.redis_url:
            raise ValueError(
                f"workers={self.workers} needs redis_url: the worker processes share admission "
                "through Redis (pass --redis-url redis://HOST:6379/0)"
            )
        if self.redis_url is not None and urlsplit(self.redis_url).scheme not in (
            "redis",
            "rediss",
            "unix",
        ):
            raise ValueError(
                f"redis_url {self.redis_url!r} must look like redis://HOST:PORT/DB or unix:///PATH"
            )
        if self.projected_watermark < self.high_watermark:
            raise ValueError(
                f"projected_watermark ({self.projected_watermark}) must not be below "
                f"high_watermark ({self.high_watermark})"
            )
        return self


def _one_line(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        loc = ".".join(str(p) for p in err["loc"]) or "config"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def build_config(values: dict[str, Any]) -> GuardConfig:
    """Validate a dict of settings into a :class:`GuardConfig`; raises BadInput on error."""
    try:
        return GuardConfig.model_validate(values)
    except ValidationError as exc:
        raise BadInput(
            f"invalid guard settings: {_one_line(exc)}",
            "fix the value (see `oomguard guard --help`)",
        ) from None


def load_config(path: Path | None, overrides: dict[str, Any]) -> GuardConfig:
    """Read a YAML config file (optional) and apply ``overrides`` (CLI flags) on top.

    ``overrides`` entries whose value is None are ignored; a ``backends`` override replaces
    the file's list. Raises MalformedConfig for an unreadable file, BadInput for bad values.
    """
    values: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise MalformedConfig(
                f"cannot read guard config {path}: {exc.strerror}", "check the path"
            ) from None
        except yaml.YAMLError as exc:
            raise MalformedConfig(
                f"guard config {path} is not valid YAML: {str(exc).splitlines()[0]}",
                "fix the YAML syntax",
            ) from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise MalformedConfig(
                f"guard config {path} must be a mapping of settings, not {type(loaded).__name__}",
                "write `key: value` lines, e.g. `backends: [http://127.0.0.1:8000]`",
            )
        values.update(loaded)
    for key, value in overrides.items():
        if value is None or (key == "backends" and not value):
            continue
        values[key] = value
    if not values.get("backends"):
        raise BadInput(
            "no backend given", "pass --backend http://HOST:PORT (repeatable) or list `backends:`"
        )
    return build_config(values)
