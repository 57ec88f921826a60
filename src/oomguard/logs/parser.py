"""Stream a vLLM log through the pattern catalogue into a bounded :class:`ParsedLog`."""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterable
from dataclasses import fields as dataclass_fields
from dataclasses import replace
from pathlib import Path
from typing import Any

from oomguard.errors import BadInput
from oomguard.logs import catalogue as cat
from oomguard.logs import prose
from oomguard.logs.lines import Record, iter_records, read_binary_lines
from oomguard.logs.parsed import (
    FIELD_RULES,
    MAX_LIST,
    Evidence,
    GpuProcess,
    Observed,
    OomEvent,
    ParsedLog,
    Phase,
)
from oomguard.units import GIB, KIB, MIB, TIB, parse_int, parse_number, to_gib

_SCAN = cat.TRIGGER_SCAN.findall
_CLOSURE = cat.TRIGGER_CLOSURE
# a message begun in one record is looked for in it joined with at most this many more records
_PENDING_RECORDS = 3
_PENDING_CHARS = 1024
_PAIR = re.compile(
    r"(\w+)=('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|\{[^{}]*\}|\[[^\[\]]*\]|[^,()]+?)"
    r"(?=,\s*\w+=|\)?\s*$)"
)
_LLM_CALL = re.compile(r"\bLLM\(")
_DICT_ITEM = re.compile(r"'(\w+)':\s*('(?:[^'\\]|\\.)*'|\{[^{}]*\}|\[[^\[\]]*\]|[^,}]+)")

# keys of vLLM's args / engine config → ParsedLog field names
ARG_FIELDS: dict[str, str] = {
    "model": "model",
    "model_tag": "model",
    "tensor_parallel_size": "tensor_parallel_size",
    "pipeline_parallel_size": "pipeline_parallel_size",
    "data_parallel_size": "data_parallel_size",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "device_memory_utilization": "gpu_memory_utilization",
    "max_model_len": "max_model_len",
    "max_seq_len": "max_model_len",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "block_size": "block_size",
    "kv_cache_dtype": "kv_cache_dtype",
    "quantization": "quantization",
    "dtype": "dtype",
    "enforce_eager": "enforce_eager",
    "cpu_offload_gb": "cpu_offload_gib",
    "swap_space": "swap_space_gib",
}


class LogBuilder:
    """Mutable state while streaming; everything it keeps is bounded."""

    def __init__(self) -> None:
        self.log = ParsedLog()
        self.tb_phase: Phase | None = None
        self.open_traceback = False
        self.last_frame_phase: Phase | None = None
        self.frame_failure_phase: Observed[Phase] | None = None
        self.explicit_failure: Observed[Phase] | None = None
        self.first_failure_line: int | None = None
        self.weights_done: Evidence | None = None
        self.cudagraph_hint: tuple[float, float, Evidence] | None = None
        self.growth_last_gib: float | None = None
        self.growth_evidence: Evidence | None = None
        self.frame_evidence: Evidence | None = None
        # kinds of code (Pattern.frame_kind) the current traceback has run through
        self.tb_kinds: dict[str, Evidence] = {}
        self.in_frame = False  # the record being fed is traceback content
        self.after_frame = False  # the previous record was a frame line
        # (first record, joined text, patterns still waiting, records joined so far)
        self.pending: list[tuple[Record, str, tuple[int, ...], int]] = []
        self.recent: tuple[str, ...] = ()  # the texts of the records before the one being fed
        self.engines_constructed = 0  # `LLM(...)` constructions seen

    # --- fields -----------------------------------------------------------------------------
    def set_field(self, name: str, value: Any, ev: Evidence) -> None:
        rule = FIELD_RULES.get(name, "first")
        current = self.log.fields.get(name)
        if current is None or rule == "last":
            self.log.fields[name] = Observed(value, ev)
        elif rule == "min" and isinstance(value, (int, float)) and value < current.value:
            self.log.fields[name] = Observed(value, ev)
        elif rule == "max" and isinstance(value, (int, float)) and value > current.value:
            self.log.fields[name] = Observed(value, ev)

    def signature(self, name: str, ev: Evidence) -> None:
        log = self.log
        if name not in log.signatures:
            log.signatures[name] = ev
        log.signature_counts[name] = log.signature_counts.get(name, 0) + 1

    def phase(self, phase: Phase, ev: Evidence) -> None:
        if phase not in self.log.phases:
            self.log.phases[phase] = ev

    def mark_failure(self, line: int) -> None:
        if self.first_failure_line is None:
            self.first_failure_line = line

    # --- one record -------------------------------------------------------------------------
    def feed(self, record: Record) -> None:
        text = record.text
        if not text:
            return
        if record.tag and "engine" not in self.log.fields:
            if (
                record.tag.startswith(("EngineCore", "Worker_", "APIServer"))
                or record.tag == "Worker"
            ):
                self.set_field("engine", "v1", Evidence.of(record.number, text))
            elif record.tag == "VllmWorkerProcess":
                self.set_field("engine", "v0", Evidence.of(record.number, text))
        if record.source and "engine" not in self.log.fields:
            engine = _ENGINE_OF_SOURCE.get(record.source)
            if engine is not None:
                self.set_field("engine", engine, Evidence.of(record.number, text))
        frame_line = text.lstrip().startswith('File "')
        # a line of traceback content: a frame, indented source, or the source line that
        # follows a frame (decorations strip its indentation)
        self.in_frame = frame_line or (
            self.open_traceback and (text[:1] in (" ", "\t") or self.after_frame)
        )
        self.after_frame = frame_line
        if frame_line:
            self.open_traceback = True
            if self.frame_evidence is None:
                self.frame_evidence = Evidence.of(record.number, text)
        if self.pending:
            self._feed_pending(record)
        recent = self.recent
        self.recent = (*recent[1 - _PENDING_RECORDS :], text)
        lower = text.lower()
        found = _SCAN(lower)
        if not found:
            return
        quiet = record.level in prose.QUIET_LEVELS
        candidates: tuple[int, ...] | list[int]
        if len(found) == 1:
            candidates = _CLOSURE[found[0]]
        else:
            merged: set[int] = set()
            for trigger in set(found):
                merged.update(_CLOSURE[trigger])
            candidates = sorted(merged)
        ev: Evidence | None = None
        waiting: list[int] = []
        for i in candidates:
            if quiet and i in _PROSE_ONLY:
                continue  # a person's words: vLLM's own quiet lines are not searched for them
            pattern = cat.PATTERNS[i]
            m = pattern.regex.search(text)
            if m is None and pattern.loose is not None:
                m = pattern.loose_search(text, lower)
                if m is None and recent:
                    # perhaps wrapped before this record: try it joined with the previous ones
                    joined = " ".join(r[-_PENDING_CHARS:] for r in recent) + " " + text
                    m = pattern.loose_search(joined, joined.lower())
                    if m is not None and m.end() <= len(joined) - len(text):
                        m = None  # a message wholly in an earlier record, already read there
                    if m is not None:
                        ev = Evidence.of(record.number, joined[-_PENDING_CHARS:])
                        self._apply(pattern, m, ev, record)
                        continue
                if m is None:
                    # perhaps wrapped before its end: try again with the next records joined
                    waiting.append(i)
                    continue
            if m is None:
                continue
            if ev is None:
                ev = Evidence.of(record.number, text)
            self._apply(pattern, m, ev, record)
        if waiting and not self.pending:
            before = " ".join(r[-_PENDING_CHARS:] for r in recent)
            self.pending = [
                (record, (before + " " + text)[-2 * _PENDING_CHARS :], tuple(waiting), 0)
            ]

    def _feed_pending(self, record: Record) -> None:
        """Try the tolerant forms of messages begun in earlier records on those records joined
        with this one (a message wrapped where a new record seemed to start)."""
        first, joined, waiting, count = self.pending[0]
        self.pending = []
        read = len(joined)
        joined = joined + " " + record.text[:_PENDING_CHARS]
        lower = joined.lower()
        left: list[int] = []
        for i in waiting:
            pattern = cat.PATTERNS[i]
            m = pattern.loose_search(joined, lower)
            if m is not None and m.end() <= read:
                m = None  # a message wholly in the records already read
            if m is None:
                left.append(i)
                continue
            self._apply(pattern, m, Evidence.of(first.number, joined), first)
        if left and count + 1 < _PENDING_RECORDS:
            self.pending = [(first, joined, tuple(left), count + 1)]

    def _apply(self, pattern: cat.Pattern, m: re.Match[str], ev: Evidence, record: Record) -> None:
        groups = m.groupdict()
        for name, raw in groups.items():
            if raw is None or name.endswith("_unit") or name not in FIELD_RULES:
                continue
            try:
                value = self._convert(name, raw, groups)
            except ValueError:
                continue
            self.set_field(name, value, ev)
        if pattern.signature:
            self.signature(pattern.signature, ev)
        if pattern.phase:
            self.phase(pattern.phase, ev)
        if pattern.frame_phase:
            self.phase(pattern.frame_phase, ev)
            stripped = record.text.lstrip()
            if stripped.startswith('File "') or (
                self.open_traceback and record.text[:1] in (" ", "\t")
            ):
                # a frame of a traceback: the innermost one names the failing phase
                self.tb_phase = pattern.frame_phase
                self.last_frame_phase = pattern.frame_phase
                self.open_traceback = True
        if pattern.frame_kind and self.in_frame:
            self.tb_kinds.setdefault(pattern.frame_kind, ev)
        if pattern.failure_phase:
            if self.explicit_failure is None:
                self.explicit_failure = Observed(pattern.failure_phase, ev)
            self.mark_failure(record.number)
        if pattern.handler:
            getattr(self, "_h_" + pattern.handler)(m, ev, record)

    @staticmethod
    def _convert(name: str, raw: str, groups: dict[str, str | None]) -> Any:
        if name.endswith("_gib"):
            return to_gib(raw, groups.get(name + "_unit") or "GiB")
        if name in cat.INT_FIELDS:
            return parse_int(raw)
        if name in cat.FLOAT_FIELDS:
            return parse_number(raw)
        return raw.strip()

    # --- handlers ---------------------------------------------------------------------------
    def _h_engine_v0(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        self.set_field("engine", "v0", ev)

    def _h_engine_v1(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        self.set_field("engine", "v1", ev)

    def _h_platform_cpu(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        self.set_field("platform", "cpu", ev)

    def _h_kv_device(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        label = m.group("device_label")
        if label:
            self.set_field("platform", {"GPU + host": "gpu"}.get(label, label.lower()), ev)

    def _h_weights_done(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        self.phase(Phase.WEIGHT_LOADING, ev)
        if self.weights_done is None:
            self.weights_done = ev

    def _h_free_increase(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        try:
            grew = parse_number(m.group("b")) - parse_number(m.group("a"))
        except ValueError:
            return
        self.set_field("profiling_free_increase", grew, ev)

    def _h_cudagraph_hint(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        self.set_field("cudagraph_estimate_applied", 1.0, ev)
        if self.cudagraph_hint is None:
            try:
                self.cudagraph_hint = (parse_number(m.group("u")), parse_number(m.group("e")), ev)
            except ValueError:
                pass

    def _h_cudagraph_hint_disabled(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        """The estimate switched off: G = (suggested − util) × total, not subtracted (§14.4)."""
        self.set_field("cudagraph_estimate_applied", 0.0, ev)
        if self.cudagraph_hint is None:
            try:
                util, suggested = parse_number(m.group("u")), parse_number(m.group("s"))
            except ValueError:
                return
            # stored as (util, util − G/total), the form of the enabled hint
            self.cudagraph_hint = (util, 2 * util - suggested, ev)

    def _h_kv_usage(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        try:
            pct = parse_number(m.group("kv_usage_max_pct"))
        except ValueError:
            return
        current = self.log.fields.get("kv_usage_max_pct")
        if current is None or pct >= current.value:
            self.log.fields["kv_usage_max_pct"] = Observed(pct, ev)

    def _h_expandable_in_use(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        before = record.text[max(0, m.start() - 16) : m.start()].lower()
        if "setting" not in before and "try" not in before:
            self.signature("expandable_segments_in_use", ev)

    def _h_traceback(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        self.tb_phase = None
        self.open_traceback = True
        self.tb_kinds = {}

    def _failing_traceback(self) -> None:
        """The traceback just closed by a memory failure (or cut off after its frames): record
        the kinds of code it ran through as ``failing_in_<kind>`` signatures."""
        for kind, frame in self.tb_kinds.items():
            self.signature("failing_in_" + kind, frame)

    def _h_ps_engine(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        if len(self.log.engine_processes) < MAX_LIST:
            self.log.engine_processes.append(ev)

    def _h_gpu_process(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        log = self.log
        if len(log.gpu_processes) >= MAX_LIST:
            return
        groups = m.groupdict()
        try:
            pid = int(m.group("pid"))
            gib = int(m.group("mib")) / 1024
            gpu = int(groups["gpu"]) if groups.get("gpu") else None
        except (ValueError, IndexError):
            return
        if any(g.pid == pid and g.gpu_index == gpu for g in log.gpu_processes):
            return
        name = m.group("name").strip()
        log.gpu_processes.append(
            GpuProcess(pid=pid, name=name, gib=gib, evidence=ev, gpu_index=gpu)
        )

    def _h_exception(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        exc = m.group("exc")
        if exc in ("Error", "Exception") and not record.text.startswith(exc):
            return
        self.open_traceback = False
        if len(self.log.errors) < MAX_LIST:
            self.log.errors.append(ev)
        memory = _memory_text(record.text)
        if self.tb_phase is not None and self.frame_failure_phase is None and memory:
            self.frame_failure_phase = Observed(self.tb_phase, ev)
        if memory:
            self._failing_traceback()
        self.tb_kinds = {}

    def _h_oom_torch(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        self._oom("torch", ev, record.text)

    def _h_oom_driver(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        self._oom("driver", ev, record.text)

    def _oom(self, kind: str, ev: Evidence, text: str) -> None:
        log = self.log
        log.oom_count += 1
        self.mark_failure(ev.line)
        self._failing_traceback()
        if self.tb_phase is not None and self.frame_failure_phase is None:
            self.frame_failure_phase = Observed(self.tb_phase, ev)
        if len(log.ooms) >= MAX_LIST:
            return
        event = _parse_oom(kind, ev, text)
        # the same report is often printed again in the final traceback; reports of other
        # GPUs (tensor-parallel ranks) are kept, their differences are evidence
        for existing in log.ooms:
            if (
                existing.kind == event.kind
                and existing.tried_gib == event.tried_gib
                and existing.free_gib == event.free_gib
                and (
                    existing.gpu_index == event.gpu_index
                    or None in (existing.gpu_index, event.gpu_index)
                )
                and existing.this_process_gib in (event.this_process_gib, None)
            ):
                if event.total_gib is not None and existing.total_gib is None:
                    log.ooms[log.ooms.index(existing)] = event
                return
        log.ooms.append(event)

    def _h_oom_detail(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        """PyTorch's OOM figures on a line of their own, after the line that reported the
        failure (a report wrapped by the reporter or reformatted): fill in what the event
        lacks."""
        log = self.log
        if not log.ooms:
            return
        last = log.ooms[-1]
        if last.evidence.line >= record.number or record.number - last.evidence.line > 8:
            return
        detail = _parse_oom(last.kind, last.evidence, record.text)
        updates: dict[str, Any] = {}
        for f in dataclass_fields(OomEvent):
            if f.name in ("kind", "evidence"):
                continue
            mine, theirs = getattr(last, f.name), getattr(detail, f.name)
            if theirs not in (None, ()) and mine in (None, ()):
                updates[f.name] = theirs
        if updates:
            log.ooms[-1] = replace(last, **updates)

    def _h_ray_oom(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        self.signature("ray_oom", ev)

    def _h_free_listing(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        """A row of `free` (-h or KiB): total, used, free[, shared, buff/cache, available]."""
        values: list[float] = []
        for token in m.group("cols").split():
            gib = _free_amount_gib(token)
            if gib is None:
                return
            values.append(gib)
        if len(values) < 3:
            return
        total = values[0]
        if total <= 0:
            return
        if m.group("kind") == "Mem":
            available = values[5] if len(values) >= 6 else values[2]
            self.set_field("host_ram_total_gib", total, ev)
            self.set_field("host_ram_available_gib", available, ev)
            if available < 0.05 * total:
                self.signature("host_ram_low", ev)
        else:
            self.set_field("host_swap_total_gib", total, ev)
            self.set_field("host_swap_free_gib", values[2], ev)
            if values[2] < 0.05 * total:
                self.signature("host_swap_full", ev)

    def _h_still_in_use(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        """What an engine keeps on the GPU after sleeping; a figure that keeps rising over
        the log's steps is memory the engine no longer releases."""
        try:
            gib = float(m.group("gib"))
        except ValueError:
            return
        first = self.log.fields.get("sleep_residual_first_gib")
        self.set_field("sleep_residual_first_gib", gib, ev)
        self.set_field("sleep_residual_gib", gib, ev)
        if first is not None and gib >= first.value + 2.0 and gib >= 1.5 * first.value:
            self.signature("sleep_residual_growth", first.evidence)

    # --- prose ------------------------------------------------------------------------------
    def _h_said(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        """A sentence naming a memory failure or a mechanism (``said_*`` signatures); vLLM's
        own quiet log lines and hedged advice ("to avoid OOM") do not count."""
        name = m.re.pattern
        pattern = _SAID_BY_REGEX.get(name)
        if pattern is None:
            return
        if record.level in prose.QUIET_LEVELS:
            return
        if pattern in ("said_oom", "said_fragmentation"):
            for found in m.re.finditer(record.text):
                if prose.is_statement(record.text, found.start(), record.level):
                    self.signature(pattern, ev)
                    return
            return
        self.signature(pattern, ev)

    def _h_workaround(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        if record.level in prose.QUIET_LEVELS:
            return
        named = False
        for found in m.re.finditer(record.text):
            lever = next((g for g in found.group("a", "b", "c", "d", "e", "f") if g), "")
            cause = prose.lever_cause(lever)
            if cause is not None:
                self.signature("said_fix_" + cause, ev)
                named = True
        if named and _SAID_OOM.search(record.text):
            # "I have to lower max_num_seqs to avoid the OOM": a workaround for an OOM that
            # happened, not advice
            self.signature("said_oom", ev)

    def _h_tried_in_vain(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        """A setting the writer changed without avoiding the failure ("even with
        --enforce-eager", "lowered max-model-len to 8K. OOM."): ``said_tried_<cause>``."""
        if record.level in prose.QUIET_LEVELS:
            return
        for found in m.re.finditer(record.text):
            lever = next((g for g in found.group("a", "b", "c") if g), "")
            cause = prose.lever_cause(lever)
            if cause is not None:
                self.signature("said_tried_" + cause, ev)

    def _h_tried_all(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        if record.level not in prose.QUIET_LEVELS:
            self.signature("said_tried_all", ev)

    def _h_lever_change(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        """ "Setting X to 0.7 would cause OOM, so decrease it from 0.7 to 0.6": a setting
        lowered (or the parallelism raised) in a text that names a memory failure, even a hedged
        one, reports the failure and the change that avoided it. Raising utilization, the
        context or the batch is no fix for running out of memory and is not read as one."""
        if record.level in prose.QUIET_LEVELS or _SAID_OOM.search(record.text) is None:
            return
        for found in m.re.finditer(record.text):
            change = prose.lever_change(record.text, found)
            if change is None:
                continue
            lever, old, new = change
            cause = prose.lever_cause(lever)
            if cause is None or old == new:
                continue
            if (new > old) != (cause == "weights_dont_fit"):
                continue
            self.signature("said_fix_" + cause, ev)
            self.signature("said_oom", ev)
            if cause == "util_overshoot" and 0 < new < old <= 1:
                self.set_field("said_util", old, ev)
                self.set_field("said_changed_util", new, ev)

    def _h_said_util(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        if record.level in prose.QUIET_LEVELS:
            return
        for found in m.re.finditer(record.text):
            try:
                util = float(found.group("util"))
            except ValueError:
                continue
            if 0 < util <= 1:
                self.set_field("said_util", util, ev)

    def _h_said_model_size(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        if record.level in prose.QUIET_LEVELS:
            return
        try:
            value = m.group("gib") or m.group("total") or m.group("of")
            self.set_field("said_weights_gib", float(value), ev)
        except (TypeError, ValueError):
            return

    def _h_said_unallocated(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        if self.log.ooms and record.number - self.log.ooms[-1].evidence.line <= 8:
            return  # part of an OOM report: read with it
        raw, unit = (
            (m.group("a"), m.group("a_unit")) if m.group("a") else (m.group("b"), m.group("b_unit"))
        )
        try:
            self.set_field("said_unallocated_gib", to_gib(raw, unit), ev)
        except ValueError:
            return

    def _h_said_gpu(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        if record.level in prose.QUIET_LEVELS or "said_gpu_name" in self.log.fields:
            return
        name = re.sub(r"\s+", " ", m.group("name"))
        mem = m.group("mem")
        self.set_field("said_gpu_name", f"{name} {mem}GB" if mem else name, ev)
        count = m.group("count") or m.group("count2")
        if m.group("dual"):
            count = "2"
        if count and 1 < int(count) <= 64:
            self.set_field("said_gpu_count", int(count), ev)

    def _h_said_regression(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        """ "Works in 0.2.6 but runs out of memory in 0.2.7": the oldest and newest vLLM
        versions of a sentence that also states a memory failure."""
        if record.level in prose.QUIET_LEVELS or "said_version_old" in self.log.fields:
            return
        if _SAID_OOM.search(record.text) is None:
            return
        versions = sorted({prose.version_tuple(v) for v in prose.VERSION.findall(record.text)})
        if len(versions) >= 2:
            self.set_field("said_version_old", ".".join(map(str, versions[0])), ev)
            self.set_field("said_version_new", ".".join(map(str, versions[-1])), ev)

    # --- arguments --------------------------------------------------------------------------
    def _h_args_dict(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        payload = m.group("payload")
        args: dict[str, Any]
        try:
            parsed = ast.literal_eval(payload)
            args = parsed if isinstance(parsed, dict) else {}
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            args = {k: _literal(v) for k, v in _DICT_ITEM.findall(payload)}
        self._take_args(args, ev, user=True)

    def _h_args_pairs(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        # the engine config line: the values in force, the user's and vLLM's own alike
        payload = m.group("payload")
        args = {k: _literal(v) for k, v in _PAIR.findall(payload + ")")}
        self._take_args(args, ev)

    def _h_args_namespace(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        # the api_server's argparse Namespace: every argument as the user gave it (None: unset)
        payload = m.group("payload")
        args = {k: _literal(v) for k, v in _PAIR.findall(payload + ")")}
        self._take_args(args, ev, user=True)

    def _h_args_kwargs(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        before = self.engines_constructed
        # (a record may hold several source lines: count every construction in it)
        self.engines_constructed += max(len(_LLM_CALL.findall(record.text)), 1)
        if before < 2 <= self.engines_constructed:
            # a second engine built in the same code while the first may still hold its
            # weights and KV cache: the co-tenant is the earlier engine
            self.signature("said_other_process", ev)
        payload = m.group("payload")
        args: dict[str, Any] = {k: _literal(v) for k, v in _PAIR.findall(payload + ")")}
        first = payload.split(",", 1)[0].strip()
        if "=" not in first and first[:1] in ("'", '"'):
            args.setdefault("model", first.strip("'\""))
        self._take_args(args, ev, user=True)

    def _h_args_cmdline(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        if cat.PS_ROW.match(record.text):
            return  # another process's command line in a `ps` listing
        # a command quoted in prose ends at its closing backtick ("`vllm serve m` runs out …")
        args = command_args(m.group("payload").split("`", 1)[0])
        if args:
            self._take_args(args, ev, user=True)

    def _take_args(self, args: dict[str, Any], ev: Evidence, *, user: bool = False) -> None:
        """Record an arguments line. ``user``: the user's own arguments (non-default args,
        command line, ``LLM(...)``, Namespace) rather than the engine's resolved config."""
        if not args:
            return
        log = self.log
        if log.args_evidence is None:
            log.args_evidence = ev
        if user and log.user_args_evidence is None:
            log.user_args_evidence = ev
        for key, value in args.items():
            key = str(key).replace("-", "_")
            if len(log.args) < 96 and key not in log.args:
                log.args[key] = value
            field = ARG_FIELDS.get(key)
            if field is None or value is None or value == "None":
                if key == "enable_sleep_mode" and value in (True, "True", "true"):
                    self.signature("sleep_mode", ev)
                elif key == "enable_lora" and value in (True, "True", "true"):
                    self.signature("lora", ev)
                elif key in ("limit_mm_per_prompt",) and value:
                    self.signature("mm_limits", ev)
                continue
            converted = _arg_value(field, value)
            if converted is not None:
                self.set_field(field, converted, ev)
                if user and field not in log.user_settings:
                    log.user_settings[field] = converted

    # --- narratives of memory growth ----------------------------------------------------------
    def _h_growth(self, m: re.Match[str], ev: Evidence, record: Record) -> None:
        """A record that speaks of time: memory amounts rising within it or since the last
        such record are a narrative of memory growth."""
        text = record.text
        amounts = [float(a) for a in cat.MEMORY_AMOUNT.findall(text)]
        if not amounts:
            return
        rising = len(amounts) >= 2 and all(
            b > a for a, b in zip(amounts, amounts[1:], strict=False)
        )
        if self.growth_last_gib is not None and amounts[0] > self.growth_last_gib * 1.1:
            rising = True
        if rising:
            self.signature("memory_growth", self.growth_evidence or ev)
        self.growth_last_gib = amounts[-1]
        if self.growth_evidence is None:
            self.growth_evidence = ev

    # --- finish -------------------------------------------------------------------------------
    def finish(self, lines: int) -> ParsedLog:
        log = self.log
        log.lines = lines
        fields = log.fields
        if "engine" not in fields:
            for name, engine in (
                ("available_kv_gib", None),
                ("kv_tokens", "v1"),
                ("gpu_blocks", "v0"),
                ("requested_gib", None),
            ):
                obs = fields.get(name)
                if obs is not None and engine is not None:
                    self.set_field("engine", engine, obs.evidence)
                    break
        if "engine" not in fields:
            for event in log.ooms:
                # PyTorch's OOM text before 2.2 ("(GPU 0; 14.58 GiB total capacity; …)", then
                # 2.1's "has a total capacty of") dates the log to vLLM ≤ 0.3: the V0 engine
                low = event.evidence.text.lower()
                if "total capacity;" in low or "total capacty" in low:
                    self.set_field("engine", "v0", event.evidence)
                    break
        if (
            "activation_gib" not in fields
            and "peak_torch_gib" in fields
            and "weights_gib" in fields
        ):
            self.set_field(
                "activation_gib",
                max(fields["peak_torch_gib"].value - fields["weights_gib"].value, 0.0),
                fields["peak_torch_gib"].evidence,
            )
        if "gpu_total_gib" not in fields:
            total_ev: tuple[float, Evidence] | None = None
            if "startup_total_gib" in fields:
                total_ev = (fields["startup_total_gib"].value, fields["startup_total_gib"].evidence)
            else:
                for event in log.ooms:
                    if event.total_gib is not None:
                        total_ev = (event.total_gib, event.evidence)
                        break
            if total_ev is not None:
                self.set_field("gpu_total_gib", total_ev[0], total_ev[1])
        if (
            self.cudagraph_hint is not None
            and "cudagraph_estimate_gib" not in fields
            and "gpu_total_gib" in fields
        ):
            util, equiv, ev = self.cudagraph_hint
            self.set_field(
                "cudagraph_estimate_gib", max(util - equiv, 0.0) * fields["gpu_total_gib"].value, ev
            )
        if "no_cache_blocks" not in log.signatures:
            # an empty KV pool stated by its numbers is the failure vLLM raises right after
            # ("No available memory for the cache blocks"), even when the excerpt stops before it
            # (a budget printed as 0.0 GiB may be a small pool rounded: counted blocks or
            # tokens above zero say it was not empty)
            counted = [fields[n] for n in ("gpu_blocks", "kv_tokens") if n in fields]
            budget = fields.get("available_kv_gib")
            empty = [o for o in counted if o.value <= 0]
            if budget is not None and budget.value < 0:
                empty.insert(0, budget)
            if empty and not any(o.value > 0 for o in counted):
                self.signature("no_cache_blocks", empty[0].evidence)
                self.mark_failure(empty[0].evidence.line)
        self._capacity_below_length()
        if self.open_traceback and self.frame_evidence is not None:
            # a traceback that ends without its exception line (cut by the reporter)
            found = log.phases.get(self.last_frame_phase) if self.last_frame_phase else None
            ev = found or self.frame_evidence
            self.signature("truncated_traceback", ev or self.frame_evidence)
            self._failing_traceback()
        log.failure_phase = self._failure_phase()
        return log

    def _capacity_below_length(self) -> None:
        """The KV cache's stated size in tokens below max_model_len, followed by a traceback:
        the fit check that raised ("max seq len … is larger than the maximum number of tokens
        that can be stored in KV cache"), even when the excerpt stops before its message."""
        log, fields = self.log, self.log.fields
        if "kv_too_small" in log.signatures or "no_cache_blocks" in log.signatures:
            return
        length = fields.get("max_model_len")
        if length is None:
            return
        capacity: tuple[int, Evidence] | None = None
        if "kv_tokens" in fields:
            capacity = (int(fields["kv_tokens"].value), fields["kv_tokens"].evidence)
        elif "gpu_blocks" in fields:
            block = int(self.log.get("block_size") or 16)
            capacity = (int(fields["gpu_blocks"].value) * block, fields["gpu_blocks"].evidence)
        if capacity is None or not 0 < capacity[0] < int(length.value):
            return
        concurrency = fields.get("max_concurrency")
        if concurrency is not None and float(concurrency.value) >= 1.0:
            return  # vLLM counted a whole request as fitting (a sliding-window or hybrid pool)
        after = self.frame_evidence or (log.errors[0] if log.errors else None)
        if after is None or after.line <= capacity[1].line:
            return  # no failure after it: a sliding-window or hybrid pool can start like this
        self.set_field("kv_capacity_tokens", capacity[0], capacity[1])
        self.set_field("kv_error_max_model_len", int(length.value), length.evidence)
        self.signature("kv_too_small", capacity[1])
        self.mark_failure(capacity[1].line)

    def _failure_phase(self) -> Observed[Phase] | None:
        log = self.log
        if self.explicit_failure is not None:
            return self.explicit_failure
        if self.frame_failure_phase is not None:
            return self.frame_failure_phase
        failed = log.shows_failure or "truncated_traceback" in log.signatures
        if not failed:
            return None
        if self.last_frame_phase is not None:
            return Observed(self.last_frame_phase, log.phases[self.last_frame_phase])
        reached = log.phase_reached
        if reached is None:
            return None
        ev = log.phases[reached]
        if reached == Phase.WEIGHT_LOADING and self.weights_done is not None:
            # weights were loaded; whatever failed next was the profiling run
            return Observed(Phase.PROFILING, self.weights_done)
        return Observed(reached, ev)


_SAID_BY_REGEX = {p.regex.pattern: p.name for p in cat.PATTERNS if p.handler == "said"}
_SAID_OOM = re.compile(prose.SAID_OOM)

# Handlers that read a person's words and return at once on a record at one of vLLM's quiet
# levels (prose.QUIET_LEVELS): a pattern whose only effect is such a handler cannot change the
# result on those records, so it is not searched there. Its prose regexes are the costliest of
# the catalogue, and vLLM's periodic INFO lines ("... tokens/s ... KV cache usage ...") wake
# them through short triggers ("ok", "fix"): skipping them makes a long log ~5x faster.
_QUIET_RETURNING_HANDLERS = frozenset(
    {
        "said",
        "workaround",
        "tried_in_vain",
        "tried_all",
        "lever_change",
        "said_util",
        "said_model_size",
        "said_gpu",
        "said_regression",
    }
)


def _prose_only(p: cat.Pattern) -> bool:
    groups = set(p.regex.groupindex) | (set(p.loose.groupindex) if p.loose else set())
    return (
        p.handler in _QUIET_RETURNING_HANDLERS
        and not (p.signature or p.phase or p.frame_phase or p.failure_phase or p.frame_kind)
        and not groups & set(FIELD_RULES)
    )


_PROSE_ONLY = frozenset(i for i, p in enumerate(cat.PATTERNS) if _prose_only(p))

# vLLM source files that log under one engine only (the logger header names the file): V1's
# engine core, GPU worker and model runner, KV-cache sizing and executor; V0's worker, model
# runner, multiprocessing engine and executors. Files both engines have (llm_engine.py,
# api_server.py, config.py) are absent.
_ENGINE_OF_SOURCE: dict[str, str] = {
    **dict.fromkeys(
        (
            "core.py",
            "core_client.py",
            "gpu_model_runner.py",
            "gpu_worker.py",
            "kv_cache_utils.py",
            "multiproc_executor.py",
            "gpu_input_batch.py",
        ),
        "v1",
    ),
    **dict.fromkeys(
        (
            "model_runner.py",
            "worker.py",
            "engine.py",
            "multiproc_worker_utils.py",
            "gpu_executor.py",
            "cache_engine.py",
            "block_manager.py",
            "ray_gpu_executor.py",
        ),
        "v0",
    ),
}
_FREE_AMOUNT = re.compile(r"^(\d+(?:[.,]\d+)?)([KMGTP]?)(i?)B?$")


def _free_amount_gib(token: str) -> float | None:
    """One column of `free`: ``62Gi``, ``5,8Gi`` (a locale's decimal comma), ``45Mi``, or a
    bare number of KiB (plain ``free``)."""
    m = _FREE_AMOUNT.match(token)
    if m is None:
        return None
    number = float(m.group(1).replace(",", "."))
    scale = {"": KIB, "K": KIB, "M": MIB, "G": GIB, "T": TIB, "P": 1024 * TIB}[m.group(2)]
    return number * scale / GIB


def command_args(text: str) -> dict[str, Any]:
    """vLLM arguments (underscore names) of a pasted ``vllm serve`` / api_server command.

    Returns ``{}`` when the text is not a readable command; never raises.
    """
    text = text.strip()
    if text.startswith("-m "):
        text = "python " + text
    try:
        from oomguard.vllm_args import parse_command

        command = parse_command(text)
    except Exception:  # a fragment we cannot read adds nothing
        return {}
    args: dict[str, Any] = {"model": command.model}
    args.update(command.settings_kwargs)
    for name, value in command.other_flags.items():
        args[name.replace("-", "_")] = value
    return args


def _memory_text(text: str) -> bool:
    low = text.lower()
    return "memory" in low or "cache blocks" in low or "kv cache" in low


def _literal(text: str) -> Any:
    text = text.strip()
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text


def _arg_value(field: str, value: Any) -> Any:
    try:
        if field in cat.INT_SETTINGS:
            number = int(float(str(value).replace(",", "")))
            return number if number > 0 else None
        if field in ("gpu_memory_utilization", "cpu_offload_gib", "swap_space_gib"):
            return float(value)
        if field == "enforce_eager":
            return str(value).lower() in ("true", "1", "yes")
        if field == "dtype":
            return str(value).replace("torch.", "")
        return str(value)
    except (TypeError, ValueError):
        return None


def _parse_oom(kind: str, ev: Evidence, text: str) -> OomEvent:
    def gib(m: re.Match[str] | None, name: str) -> float | None:
        if m is None:
            return None
        try:
            return to_gib(m.group(name), m.group(name + "_unit"))
        except (ValueError, IndexError):
            return None

    tried = gib(cat.OOM_TRIED.search(text), "tried")
    total = free = allocated = reserved = None
    gpu_index: int | None = None
    new = cat.OOM_TOTAL_FREE.search(text)
    if new is not None:
        total, free, gpu_index = gib(new, "total"), gib(new, "free"), int(new.group("idx"))
    old = cat.OOM_OLD.search(text)
    if old is not None:
        total, free, gpu_index = gib(old, "total"), gib(old, "free"), int(old.group("idx"))
        allocated, reserved = gib(old, "alloc"), gib(old, "reserved")
    if new is None:
        alt = cat.OOM_ALT_TOTAL_FREE.search(text)
        if alt is not None:
            total, free = gib(alt, "total"), gib(alt, "free")
            gpu_index = int(alt.group("idx")) if alt.group("idx") else None
    processes: list[tuple[int, float]] = []
    for pm in cat.OOM_PROCESS.finditer(text):
        used = gib(pm, "used")
        if used is not None and len(processes) < MAX_LIST:
            processes.append((int(pm.group("pid")), used))
    this = gib(cat.OOM_THIS_PROCESS.search(text), "used")
    if allocated is None:
        allocated = gib(
            cat.OOM_ALLOCATED.search(text) or cat.OOM_ALT_ALLOCATED.search(text), "alloc"
        )
    unallocated = gib(
        cat.OOM_UNALLOCATED.search(text) or cat.OOM_ALT_UNALLOCATED.search(text), "unalloc"
    )
    if unallocated is None and reserved is not None and allocated is not None:
        unallocated = max(reserved - allocated, 0.0)
    low = text.lower()
    if kind == "torch" and "xpu" in low:
        kind = "xpu"
    elif kind == "torch" and "hip out of memory" in low:
        kind = "hip"
    return OomEvent(
        kind=kind,
        evidence=ev,
        tried_gib=tried,
        gpu_index=gpu_index,
        total_gib=total,
        free_gib=free,
        this_process_gib=this,
        processes_gib=tuple(processes),
        allocated_gib=allocated,
        reserved_gib=reserved,
        reserved_unallocated_gib=unallocated,
        private_pools_gib=gib(cat.OOM_POOLS.search(text), "pools"),
    )


def parse_stream(lines: Iterable[str]) -> ParsedLog:
    """Parse log lines (any iterable of strings, each may hold several lines) into a ParsedLog.

    Memory stays bounded whatever the input size: records are processed one at a time and
    only a fixed set of values and a few pieces of evidence are kept. Never raises on
    malformed text (binary garbage, truncated lines, interleaved processes).
    """
    builder = LogBuilder()
    last = 0
    for record in iter_records(lines):
        builder.feed(record)
        last = record.number + record.lines - 1
    return builder.finish(last)


def parse_file(path: str | Path) -> ParsedLog:
    """Parse a log file (or ``-`` for standard input), streaming it in bounded memory.

    Raises :class:`BadInput` when the file is missing, a directory, or unreadable.
    """
    if str(path) == "-":
        return parse_stream(read_binary_lines(sys.stdin.buffer))
    p = Path(path)
    if not p.exists():
        raise BadInput(
            f"log file not found: {p}", "give the path of a vLLM log, or - to read standard input"
        )
    if p.is_dir():
        raise BadInput(f"{p} is a directory, not a log file", "give the path of a vLLM log file")
    try:
        with p.open("rb") as stream:
            return parse_stream(read_binary_lines(stream))
    except PermissionError as exc:
        raise BadInput(
            f"cannot read {p}: permission denied", "check the file's permissions"
        ) from exc
    except OSError as exc:
        raise BadInput(
            f"cannot read {p}: {exc.strerror or exc}", "check the path and the disk"
        ) from exc
