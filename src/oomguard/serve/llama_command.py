"""The llama-server command serve launches: the GGUF, the settings that decide memory, the rest.

A pasted ``llama-server -m model.gguf -c 8192 -ngl 30 --rpc host:port …`` is read against the
flags of the binary that will run (:mod:`oomguard.tiering.args`): the flags that decide memory
become :class:`~oomguard.tiering.settings.LlamaCppSettings` (what the prediction and the heal
change), every other flag is kept as written. The argv written back states every memory
setting explicitly (:func:`oomguard.tiering.command.llama_server_argv`: ``--fit off`` so that
llama.cpp's own fitting does not change the split it was given, ``--log-verbosity 4`` so that
it prints the buffers the prediction is checked against), so "the same configuration" is the
same settings and the same other flags.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from oomguard.errors import BadInput
from oomguard.tiering.args import FlagTable, LlamaArgs, read_args, split_args
from oomguard.tiering.command import llama_server_argv
from oomguard.tiering.settings import LlamaCppSettings

DEFAULT_PORT = 8080  # llama-server's own default
DEFAULT_HOST = "127.0.0.1"
# flags whose value the settings (or serve itself) write out: everything else is passed as given
MEMORY_FLAGS = (
    "--model", "--ctx-size", "--parallel", "--kv-unified", "--kv-unified-per-slot",
    "--n-gpu-layers", "--cpu-moe", "--n-cpu-moe", "--tensor-split", "--override-tensor",
    "--cache-type-k", "--cache-type-v", "--flash-attn", "--batch-size", "--ubatch-size", "--repack",
    "--kv-offload", "--load-mode", "--no-mmap", "--fit", "--fit-target", "--fit-ctx",
    "--log-verbosity", "--host", "--port",
)  # fmt: skip


@dataclass(frozen=True)
class LlamaCommand:
    """A llama-server command: the GGUF, its memory settings, where it listens, its other flags."""

    model: str
    settings: LlamaCppSettings
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    extra: tuple[str, ...] = ()  # the user's other flags, as written (``--rpc``, ``--alias`` …)
    env: Mapping[str, str] = field(default_factory=dict)
    rpc: str | None = None
    devices: str | None = None
    explicit_split: bool = False  # the user gave -ngl / --n-cpu-moe / -ot: keep their split

    # --- reading -------------------------------------------------------------------------
    @classmethod
    def from_args(
        cls,
        args: Sequence[str],
        table: FlagTable,
        env: Mapping[str, str] | None = None,
        base_dir: Path | None = None,
    ) -> tuple[LlamaCommand, LlamaArgs]:
        """Read llama-server's arguments (without the binary); raises :class:`BadInput` for a
        flag this binary does not have, a missing model, or a model file that does not exist."""
        read = read_args(args, table, env)
        model = Path(read.model).expanduser()
        if not model.is_absolute() and base_dir is not None:
            model = base_dir / model
        if not model.is_file():
            raise BadInput(
                f"model file does not exist: {model}", "pass --model PATH to a local .gguf file"
            )
        memory = {table.canonical(f) for f in MEMORY_FLAGS}
        extra: list[str] = []
        for written, value in split_args(args, table):
            if table.canonical(written) in memory:
                continue
            extra += [written] if value is None else [written, value]
        host = read.values.get(table.canonical("--host")) or DEFAULT_HOST
        port_text = read.values.get(table.canonical("--port")) or str(DEFAULT_PORT)
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise BadInput(f"--port {port_text} is not a port number", "pass 1-65535")
        explicit = any(
            table.canonical(f) in read.values
            for f in (
                "--n-gpu-layers",
                "--n-cpu-moe",
                "--cpu-moe",
                "--override-tensor",
                "--tensor-split",
            )
        )
        settings = read.llama_settings(0)
        command = cls(
            str(model),
            settings,
            host,
            int(port_text),
            tuple(extra),
            dict(env or {}),
            read.rpc,
            read.devices,
            explicit,
        )
        return command, read

    # --- what the loop needs ---------------------------------------------------------------
    @property
    def bind_host(self) -> str:
        """The address it binds."""
        return self.host

    @property
    def base_url(self) -> str:
        """``http://host:port`` (a wildcard bind is reached on the loopback)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

    def argv(self, binary: str) -> list[str]:
        """The process to start."""
        return llama_server_argv(
            self.model,
            self.settings,
            binary=binary,
            host=self.host,
            port=self.port,
            extra=self.extra,
        )

    def key(self) -> str:
        """What makes two commands the same configuration (not where it listens)."""
        return repr((self.model, self.settings, self.extra))

    def display(self) -> str:
        """The command as one shell line."""
        return shlex.join(self.argv("llama-server"))

    # --- changing it -----------------------------------------------------------------------
    def with_settings(self, settings: LlamaCppSettings) -> LlamaCommand:
        """The same command with other memory settings."""
        return replace(self, settings=settings)

    def split_text(self) -> str:
        """The split in llama-server's words (``-ngl 20``, ``-ngl all --n-cpu-moe 4``)."""
        s = self.settings
        if not s.gpu_count:
            return "CPU only"
        text = f"-ngl {'all' if s.n_gpu_layers < 0 else s.n_gpu_layers}"
        if s.cpu_moe:
            text += " --cpu-moe"
        if s.n_cpu_moe:
            text += f" --n-cpu-moe {s.n_cpu_moe}"
        return text
