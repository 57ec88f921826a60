"""llama.cpp's memory at load, per device: model buffers, KV cache, output and compute buffers.

Pure functions over a :class:`GGUFModel` and :class:`LlamaCppSettings`; each figure is the one
llama-server prints at load (``model buffer size``, ``KV buffer size``, ``output buffer
size``, ``compute buffer size``), computed the way llama.cpp allocates it:

- model buffers: a CPU buffer over memory-mapped weights spans the file from its first CPU
  tensor to the end of its last (``llama_model_loader::get_mapping_range``, mapped with
  ``buffer_from_host_ptr``); an allocated buffer sums each tensor's allocation size padded to
  the buffer type's alignment (``ggml_backend_alloc_ctx_tensors_from_buft``); CUDA adds one
  row of padding to quantized tensors whose rows are not a multiple of 512
  (``MATRIX_ROW_PADDING``);
- KV cache: ``n_ctx`` is padded to 256 (``llama_context``); without ``--kv-unified`` each of
  the ``--parallel`` slots gets ``pad(n_ctx / parallel, 256)`` cells in its own stream; each
  layer holds K ``[n_embd_k_gqa, cells, streams]`` and V the same, of the cache types, on its
  layer's device (``llama_kv_cache``); sliding-window layers keep
  ``pad(min(cells, window × streams_or_1 + n_ubatch), 256)`` cells (``llama_kv_cache_iswa``);
- output buffer: ``n_vocab × max(n_seq_max, n_seq_max)`` floats of logits
  (``llama_context::output_reserve``), in the host buffer of the output layer's device;
- compute buffers: an estimate (see :mod:`oomguard.tiering.compute`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from oomguard.tiering.compute import ComputeEstimate, estimate_compute
from oomguard.tiering.ggml_types import is_quantized, kv_cache_type, pad, row_bytes
from oomguard.tiering.model import GGUFModel, GGUFTensor
from oomguard.tiering.placement import CPU, REPACK, Placement, place
from oomguard.tiering.settings import (
    CPU_ALIGNMENT_BYTES,
    GPU_BACKENDS,
    ContextSize,
    LlamaCppSettings,
)
from oomguard.units import MIB


@dataclass(frozen=True)
class Buffer:
    """One buffer llama-server prints at load: what it holds, where, and its size.

    ``low_bytes``/``high_bytes`` equal ``size_bytes`` for exact figures; estimates carry a range.
    """

    kind: str  # "model" | "kv" | "output" | "compute"
    device: str  # "CPU" | "GPU0" | ...
    size_bytes: int
    estimated: bool = False
    low_bytes: int | None = None
    high_bytes: int | None = None
    basis: str = ""
    name: str = ""  # llama.cpp's buffer type when it differs from the device ("CPU_Mapped")

    @property
    def size_mib(self) -> float:
        """The size as llama.cpp prints it (MiB)."""
        return self.size_bytes / MIB

    def range_bytes(self) -> tuple[int, int]:
        """(low, high): the size itself for an exact figure."""
        low = self.size_bytes if self.low_bytes is None else self.low_bytes
        high = self.size_bytes if self.high_bytes is None else self.high_bytes
        return low, high


@dataclass(frozen=True)
class LlamaCppMemory:
    """The prediction for one model and settings: buffers per device and what they add up to."""

    model: GGUFModel
    settings: LlamaCppSettings
    context: ContextSize
    placement: Placement
    buffers: tuple[Buffer, ...]
    host_weight_bytes: int  # weights on the CPU (what must stay resident for speed)
    notes: tuple[str, ...] = field(default=())

    def device_bytes(self, device: str, which: str = "value") -> int:
        """Sum of the buffers on ``device`` (``which``: "value", "low" or "high")."""
        total = 0
        for b in self.buffers:
            if b.device != device:
                continue
            low, high = b.range_bytes()
            total += {"value": b.size_bytes, "low": low, "high": high}[which]
        return total

    def buffer(self, kind: str, device: str) -> Buffer | None:
        """The buffer of ``kind`` on ``device``, if there is one."""
        return next((b for b in self.buffers if b.kind == kind and b.device == device), None)

    def gpu_devices(self) -> list[str]:
        """GPU devices with any buffer, in order."""
        return sorted({b.device for b in self.buffers if b.device != CPU})

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token of context costs over all full-attention layers."""
        k_type = kv_cache_type(self.settings.cache_type_k)
        v_type = kv_cache_type(self.settings.cache_type_v)
        return sum(
            row_bytes(k_type, self.model.n_embd_k_gqa(il))
            + row_bytes(v_type, self.model.n_embd_v_gqa(il))
            for il in range(self.model.n_layer)
            if not self.model.is_swa(il)
        )


def context_size(model: GGUFModel, settings: LlamaCppSettings) -> ContextSize:
    """The context llama.cpp creates for ``settings`` (``llama_context`` constructor)."""
    n_seq = max(1, settings.parallel)
    n_ctx = pad(settings.ctx_size or model.n_ctx_train, 256)
    if settings.kv_unified:
        n_ctx_seq = n_ctx
    else:
        n_ctx_seq = pad(n_ctx // n_seq, 256)
        n_ctx = n_ctx_seq * n_seq
    n_batch = min(n_ctx, settings.batch_size)
    n_ubatch = min(n_batch, settings.ubatch_size)
    streams = 1 if settings.kv_unified else n_seq
    return ContextSize(n_ctx, n_ctx_seq, n_seq, streams, n_batch, n_ubatch)


def _alloc_bytes(t: GGUFTensor, device: str, settings: LlamaCppSettings) -> int:
    if device == CPU:
        return pad(t.nbytes, CPU_ALIGNMENT_BYTES)
    alignment, row_padding = GPU_BACKENDS[settings.gpu_backend]
    size = t.nbytes
    if row_padding and is_quantized(t.type_name) and t.shape[0] % row_padding:
        size += row_bytes(t.type_name, row_padding - t.shape[0] % row_padding)
    return pad(size, alignment)


def _model_buffers(placement: Placement, settings: LlamaCppSettings) -> list[Buffer]:
    out: list[Buffer] = []
    repacked = [p.tensor for p in placement.tensors if p.repacked]
    by_device: dict[str, list[GGUFTensor]] = {}
    for p in placement.tensors:
        if not p.repacked:
            by_device.setdefault(p.device, []).append(p.tensor)
    for device in placement.devices():
        tensors = by_device.get(device, [])
        if not tensors:
            continue
        offsets = [t.offset_bytes for t in tensors]
        if device == CPU and settings.mmap and all(o is not None for o in offsets):
            # buffer_from_host_ptr over the mapped range (a tied head mapped twice is one range)
            first = min(o for o in offsets if o is not None)
            last = max((t.offset_bytes or 0) + t.nbytes for t in tensors)
            size, basis, name = last - first, "the mapped range of the file", "CPU_Mapped"
        elif device == CPU and settings.mmap:
            size = sum({t.name: t.nbytes for t in tensors}.values())
            basis, name = "mapped weights (no file: no gaps assumed)", "CPU_Mapped"
        else:
            size = sum(_alloc_bytes(t, device, settings) for t in tensors)
            basis, name = "allocated, padded per tensor", device
        out.append(Buffer("model", device, size, basis=basis, name=name))
    if repacked:
        size = sum(_alloc_bytes(t, CPU, settings) for t in repacked)
        out.append(
            Buffer("model", CPU, size, basis="repacked for the CPU's matrix kernels", name=REPACK)
        )
    return out


def _kv_buffers(
    model: GGUFModel, settings: LlamaCppSettings, ctx: ContextSize, placement: Placement
) -> list[Buffer]:
    k_type = kv_cache_type(settings.cache_type_k)
    v_type = kv_cache_type(settings.cache_type_v)
    swa_cells = pad(
        min(
            ctx.n_ctx_seq,
            model.sliding_window * (ctx.n_seq_max if settings.kv_unified else 1) + ctx.n_ubatch,
        ),
        256,
    )
    per_device: dict[str, int] = {}
    for il in range(model.n_layer):
        cells = swa_cells if model.is_swa(il) else ctx.n_ctx_seq
        device = placement.layer_devices[il] if settings.kv_offload else CPU
        fake_k = GGUFTensor("k", k_type, (model.n_embd_k_gqa(il), cells, ctx.n_stream))
        fake_v = GGUFTensor("v", v_type, (model.n_embd_v_gqa(il), cells, ctx.n_stream))
        size = _alloc_bytes(fake_k, device, settings) + _alloc_bytes(fake_v, device, settings)
        per_device[device] = per_device.get(device, 0) + size
    return [
        Buffer(
            "kv",
            d,
            n,
            basis=f"{ctx.n_ctx_seq} cells × {ctx.n_stream} stream(s), K {k_type}, V {v_type}",
        )
        for d, n in sorted(per_device.items(), key=lambda kv: (kv[0] != CPU, kv[0]))
    ]


def predict_llama_cpp(model: GGUFModel, settings: LlamaCppSettings) -> LlamaCppMemory:
    """Predict every buffer llama-server allocates at load for ``model`` under ``settings``."""
    ctx = context_size(model, settings)
    placement = place(model, settings)
    buffers = _model_buffers(placement, settings)
    buffers += _kv_buffers(model, settings, ctx, placement)
    logits_bytes = model.n_vocab * ctx.n_seq_max * 4
    buffers.append(Buffer("output", CPU, logits_bytes, basis="logits of one token per slot, f32"))
    compute: list[ComputeEstimate] = estimate_compute(model, settings, ctx, placement)
    for c in compute:
        buffers.append(
            Buffer(
                "compute",
                c.device,
                c.value_bytes,
                estimated=True,
                low_bytes=c.low_bytes,
                high_bytes=c.high_bytes,
                basis=c.basis,
            )
        )
    host_weights = sum(
        {p.tensor.name: p.tensor.nbytes for p in placement.tensors if p.device == CPU}.values()
    )
    notes = []
    if settings.mmap and host_weights:
        notes.append("CPU weights are memory-mapped: they count as page cache, not process memory")
    return LlamaCppMemory(
        model, settings, ctx, placement, tuple(buffers), host_weights, tuple(notes)
    )
