"""Read a llama-server command line: its flags (from the binary's own ``--help``), the model, and
the settings that decide its memory.

llama-server has hundreds of flags and renames them between releases, so the table of flags
is read from the ``--help`` of the binary that will run (:func:`parse_help`): every name of a
flag, whether it takes a value, and the ``LLAMA_ARG_*`` variable that sets it. A flag the
binary does not list is refused before anything is launched, as llama-server itself would.
:func:`read_args` then maps the flags that decide memory onto :class:`LlamaCppSettings`, in
llama-server's own defaults (``common/common.h``, ``tools/server/server.cpp``): ``-np``
unset means four slots sharing one KV pool; ``-ngl`` unset (``auto``) means every layer on
the GPUs once ``--fit off`` stops llama.cpp's own fitting.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from oomguard.errors import BadInput
from oomguard.tiering.settings import LlamaCppSettings, Override

_FLAG_TOKEN = re.compile(r"-{1,2}[A-Za-z0-9][\w.-]*,?")
_ENV = re.compile(r"\(env: (LLAMA_ARG_\w+)\)")
_TRUE = frozenset({"1", "true", "on", "yes", "enabled"})
_FALSE = frozenset({"0", "false", "off", "no", "disabled"})
AUTO_SLOTS = 4  # tools/server/server.cpp: -np unset (-1) runs 4 slots with a unified KV pool


@dataclass(frozen=True)
class LlamaFlag:
    """One flag of llama-server's ``--help``: its names, whether it takes a value, its variable."""

    names: tuple[str, ...]
    takes_value: bool
    env: str | None = None

    @property
    def canonical(self) -> str:
        """The first ``--`` name (``--gpu-layers`` for ``-ngl``): the positive spelling."""
        return next((n for n in self.names if n.startswith("--")), self.names[0])

    def negates(self, name: str) -> bool:
        """Whether ``name`` is the negative spelling of a switch (``-nkvo``, ``--no-mmap``):
        ``--help`` lists a switch's positive names first, then its negative ones."""
        if self.takes_value or not any(n.startswith("--no-") for n in self.names[1:]):
            return False
        first_long = self.names.index(self.canonical)
        return name in self.names[first_long + 1 :]


@dataclass(frozen=True)
class FlagTable:
    """Every flag of one llama-server binary, by each of its names and by its variable."""

    by_name: Mapping[str, LlamaFlag]
    by_env: Mapping[str, LlamaFlag]

    def get(self, name: str) -> LlamaFlag | None:
        """The flag named ``name`` (any spelling), or None."""
        return self.by_name.get(name)

    def canonical(self, name: str) -> str:
        """The canonical spelling of ``name`` (itself when the binary has no such flag)."""
        flag = self.by_name.get(name)
        return flag.canonical if flag is not None else name


def parse_help(text: str) -> FlagTable:
    """The :class:`FlagTable` of a ``llama-server --help`` output.

    A flag line starts with its names (``-c,    --ctx-size N``); what follows the last name up
    to the description is the value it takes; ``(env: LLAMA_ARG_…)`` on a following line
    names its variable.
    """
    by_name: dict[str, LlamaFlag] = {}
    by_env: dict[str, LlamaFlag] = {}
    current: LlamaFlag | None = None
    for line in text.splitlines():
        if line.startswith("-") and not line.startswith("-----"):
            current = _flag_of(line)
            for name in current.names:
                by_name.setdefault(name, current)
        if current is not None:
            m = _ENV.search(line)
            if m:
                current = LlamaFlag(current.names, current.takes_value, m.group(1))
                for name in current.names:
                    by_name[name] = current
                by_env[m.group(1)] = current
    if "--model" not in by_name or "--ctx-size" not in by_name:
        raise BadInput(
            "the llama-server --help output lists no --model or --ctx-size",
            "check that the binary is llama-server",
        )
    return FlagTable(by_name, by_env)


def _flag_of(line: str) -> LlamaFlag:
    head = re.split(r"\s{2,}", re.sub(r",\s+", ", ", line.rstrip()), maxsplit=1)[0]
    names: list[str] = []
    rest = head
    while True:
        m = _FLAG_TOKEN.match(rest)
        if not m:
            break
        token = m.group(0)
        names.append(token.rstrip(","))
        rest = rest[m.end() :].lstrip()
        if not token.endswith(","):
            break
    return LlamaFlag(tuple(names), bool(rest.strip()))


@dataclass(frozen=True)
class LlamaArgs:
    """A llama-server command line as read: the model, the memory settings, the rest."""

    model: str
    settings: dict[str, Any]  # LlamaCppSettings fields the command decides
    values: dict[str, str | None]  # canonical flag → its value (None: a switch) as given
    fit: bool  # llama.cpp's own fitting (--fit, on unless "off")
    fit_target_mib: tuple[int, ...] = ()
    rpc: str | None = None
    devices: str | None = None
    notes: tuple[str, ...] = field(default=())

    def llama_settings(self, gpu_count: int, gpu_backend: str = "cuda") -> LlamaCppSettings:
        """The settings on a machine with ``gpu_count`` devices llama.cpp offloads to."""
        values = dict(self.settings)
        if not gpu_count:
            for name in ("n_gpu_layers", "n_cpu_moe", "cpu_moe", "tensor_split"):
                values.pop(name, None)
            values["overrides"] = tuple(o for o in values.get("overrides", ()) if o.device == "CPU")
        return LlamaCppSettings(gpu_count=gpu_count, gpu_backend=gpu_backend, **values)


def split_args(args: Sequence[str], table: FlagTable) -> list[tuple[str, str | None]]:
    """``args`` as (flag as written, value or None); raises BadInput for a flag the binary does
    not have, a flag missing its value, or a stray word."""
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        name, has_inline, inline = token.partition("=")
        flag = table.get(name) if token.startswith("-") else None
        if flag is None:
            what = (
                f"not a llama-server flag: {name}"
                if token.startswith("-")
                else f"unexpected word {token!r}"
            )
            raise BadInput(what, "check the spelling (llama-server --help lists its flags)")
        if not flag.takes_value:
            out.append((name, None))
            continue
        if has_inline:
            out.append((name, inline))
        elif i < len(args):
            out.append((name, args[i]))
            i += 1
        else:
            raise BadInput(f"{name} needs a value", f"write {name} VALUE")
    return out


def read_args(
    args: Sequence[str], table: FlagTable, env: Mapping[str, str] | None = None
) -> LlamaArgs:
    """Read a llama-server command line (its arguments, without the binary) and the
    ``LLAMA_ARG_*`` variables in ``env`` (a flag on the line wins over its variable)."""
    given = _Given(table)
    for key, setting in (env or {}).items():
        by_env = table.by_env.get(key)
        if by_env is not None:
            given.values[by_env.canonical] = (
                setting if by_env.takes_value else ("" if _truthy(setting) else "0")
            )
    overrides: list[str] = []
    for written, value in split_args(args, table):
        flag = table.get(written)
        assert flag is not None
        if flag.canonical == table.canonical("--override-tensor") and value is not None:
            overrides.append(value)
        given.values[flag.canonical] = (
            value if flag.takes_value else ("0" if flag.negates(written) else "")
        )
    if overrides:
        given.values[table.canonical("--override-tensor")] = ",".join(overrides)
    return _settings_of(given)


@dataclass
class _Given:
    """The flags given, by canonical name, looked up by any spelling."""

    table: FlagTable
    values: dict[str, str | None] = field(default_factory=dict)

    def get(self, alias: str) -> str | None:
        return self.values.get(self.table.canonical(alias))

    def has(self, alias: str) -> bool:
        return self.table.canonical(alias) in self.values

    def switch(self, alias: str, default: bool) -> bool:
        if not self.has(alias):
            return default
        value = self.get(alias)
        return value is None or value.lower() not in _FALSE

    def number(self, alias: str, default: int) -> int:
        value = self.get(alias)
        if value is None or value == "":
            return default
        try:
            return int(value)
        except ValueError:
            raise BadInput(f"{alias} {value} is not a whole number", f"pass {alias} N") from None


def _settings_of(given: _Given) -> LlamaArgs:
    model = given.get("--model")
    if not model:
        raise BadInput(
            "the llama-server command names no model file",
            "pass --model PATH.gguf (serve runs a local GGUF; it downloads nothing)",
        )
    s: dict[str, Any] = {}
    notes: list[str] = []
    parallel = given.number("--parallel", -1)
    auto_slots = parallel < 0
    s["parallel"] = AUTO_SLOTS if auto_slots else parallel
    s["kv_unified"] = given.switch("--kv-unified", auto_slots)
    per_slot = given.number("--kv-unified-per-slot", 0)
    ctx = given.number("--ctx-size", 0)
    if ctx == 0 and per_slot > 0:
        ctx = s["parallel"] * per_slot  # server.cpp: the pool sized from --kv-unified-per-slot
    s["ctx_size"] = ctx
    s["n_gpu_layers"] = _gpu_layers(given.get("--n-gpu-layers"))
    s["n_cpu_moe"] = given.number("--n-cpu-moe", 0)
    s["cpu_moe"] = given.switch("--cpu-moe", False)
    if given.get("--override-tensor"):
        s["overrides"] = tuple(_overrides(str(given.get("--override-tensor"))))
    for field_name, flag in (
        ("cache_type_k", "--cache-type-k"),
        ("cache_type_v", "--cache-type-v"),
    ):
        if given.get(flag):
            s[field_name] = str(given.get(flag)).lower()
    fa = (given.get("--flash-attn") or "auto").lower()
    if fa not in ("on", "off", "auto", "1", "0", "true", "false", "enabled", "disabled"):
        raise BadInput(f"--flash-attn {fa} is not on, off or auto", "pass --flash-attn on|off|auto")
    s["flash_attn"] = fa not in ("off", "0", "false", "disabled")  # auto: on for CPU and CUDA
    s["batch_size"] = given.number("--batch-size", 2048)
    s["ubatch_size"] = given.number("--ubatch-size", 512)
    if not given.switch("--repack", True):
        s["cpu_repack"] = "none"
    s["kv_offload"] = given.switch("--kv-offload", True)
    mode = (given.get("--load-mode") or "auto").lower()
    s["mmap"] = "mmap" in mode or mode == "auto"
    if given.get("--tensor-split"):
        parts = str(given.get("--tensor-split")).replace("/", ",").split(",")
        s["tensor_split"] = tuple(float(x) for x in parts if x)
    for flag, why in (
        ("--swa-full", "a full-size sliding-window cache"),
        ("--split-mode", "--split-mode"),
        ("--mmproj", "a multimodal projector"),
        ("--lora", "LoRA adapters"),
        ("--model-draft", "a draft model"),
    ):
        if given.table.get(flag) is not None and given.has(flag) and given.get(flag) != "0":
            notes.append(f"{why} is not in the memory model: the prediction leaves it out")
    fit = (given.get("--fit") or "on").lower() not in ("off", "0", "false")
    targets = tuple(
        int(x) for x in str(given.get("--fit-target") or "").split(",") if x.strip().isdigit()
    )
    return LlamaArgs(
        str(model),
        s,
        dict(given.values),
        fit,
        targets,
        given.get("--rpc"),
        given.get("--device"),
        tuple(notes),
    )


def _truthy(value: str) -> bool:
    return value.strip().lower() not in _FALSE


def _gpu_layers(value: str | None) -> int:
    """-ngl as LlamaCppSettings counts it: ``auto`` and ``all`` (and numbers past the model)
    are every layer once --fit off stops llama.cpp's fitting (llama_model::n_gpu_layers)."""
    if value is None or value.lower() in ("auto", "all", "-1"):
        return -1
    try:
        n = int(value)
    except ValueError:
        raise BadInput(
            f"--n-gpu-layers {value} is not a number, auto or all", "pass -ngl N"
        ) from None
    return -1 if n < 0 else n


def _overrides(text: str) -> list[Override]:
    """``pattern=buffer type`` rules; a GPU buffer type (CUDA0, RPC0[…]) becomes GPUn."""
    out = []
    for rule in text.split(","):
        if not rule:
            continue
        pattern, sep, buft = rule.rpartition("=")
        if not sep or not pattern:
            raise BadInput(
                f"--override-tensor {rule!r} is not PATTERN=BUFFER_TYPE",
                "write e.g. -ot 'exps=CPU'",
            )
        m = re.fullmatch(r"[A-Za-z]+(\d+)(\[.*\])?", buft)
        device = "CPU" if buft.upper().startswith("CPU") else f"GPU{m.group(1) if m else 0}"
        out.append(Override(pattern, device))
    return out
