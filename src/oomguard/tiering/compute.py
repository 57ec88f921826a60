"""An estimate of llama.cpp's compute buffers: the worst-case graph's live tensors at their peak.

At load, ``llama_context::sched_reserve`` builds the prompt-processing graph for one
micro-batch of ``T = min(n_ctx, n_ubatch)`` tokens over the full KV cache, and ggml's graph
allocator (``ggml-alloc.c``) gives each backend one buffer as large as the most bytes its
tensors hold at once (freed tensors are reused; unary ops work in place). What is live at the
peak, from the graph a llama-style layer builds (``llama-graph.cpp``):

- the inputs, alive for the whole graph: the attention mask ``[n_kv, T]`` (f16 with flash
  attention, f32 without; one per cache, sliding-window layers have their own), token ids,
  positions, output ids;
- the feed-forward phase: the residual stream and its norm ``[n_embd, T]``, gate and up
  projections and their product ``[n_ff, T]`` each (MoE: ``[n_ff_exp, n_used, T]`` each, the
  expert outputs ``[n_embd, n_used, T]``, router logits), f32;
- the attention phase: residual, norm, Q/K/V projections and the attention output; without
  flash attention also the scores ``[n_kv, T, n_head]`` f32 (softmax works in place);
- the output phase: logits ``[n_vocab, min(T, outputs)]`` f32 (llama-server reserves one
  output per slot).

On the CPU the measured buffers (tests against a real llama-server) lie between this sum and
the sum plus one more ``[n_embd, T]`` f32 tensor, which is the stated range. With layers on a
GPU, the GPU holds the same working set for its layers and, when layers also stay on the
CPU, the batched matrix products of those layers run on the GPU on copies of their weights
(``op_offload``, batches of 32 tokens or more): between the largest CPU weight and one CPU
layer's weights more, an estimate not checked against a GPU here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from oomguard.tiering.model import GGUFModel
from oomguard.tiering.placement import CPU, Placement
from oomguard.tiering.settings import LlamaCppSettings

if TYPE_CHECKING:
    from oomguard.tiering.memory import ContextSize

F32 = 4
SMALL_FLOATS_PER_TOKEN = 32  # token ids, positions, output ids, conversions: a few values per token


@dataclass(frozen=True)
class ComputeEstimate:
    """One backend's compute buffer: estimate and range (bytes), and what it is made of."""

    device: str
    value_bytes: int
    low_bytes: int
    high_bytes: int
    basis: str


def _expert_ff(model: GGUFModel) -> int:
    t = next((t for t in model.tensors if ".ffn_gate_exps." in t.name or ".ffn_up_exps." in t.name), None)
    return t.shape[1] if t is not None and len(t.shape) > 1 else model.n_ff


def _shared_ff(model: GGUFModel) -> int:
    t = next((t for t in model.tensors if ".ffn_up_shexp." in t.name), None)
    return t.shape[1] if t is not None and len(t.shape) > 1 else 0


def ffn_floats_per_token(model: GGUFModel) -> int:
    """f32 values per token live at the feed-forward peak (residual, norm, projections)."""
    if model.n_expert:
        ff = _expert_ff(model)
        used = max(1, model.n_expert_used)
        return 2 * model.n_embd + used * (3 * ff + model.n_embd) + 3 * _shared_ff(model)
    return 2 * model.n_embd + 3 * model.n_ff


def attention_floats_per_token(model: GGUFModel) -> int:
    """f32 values per token live in the attention phase, scores excluded."""
    q = model.n_head * model.head_dim_k
    kv = max(model.n_head_kv) * (model.head_dim_k + model.head_dim_v)
    return 2 * model.n_embd + 2 * q + kv


def _mask_bytes(model: GGUFModel, settings: LlamaCppSettings, n_kv: int, n_kv_swa: int, tokens: int) -> int:
    per = 2 if settings.flash_attn else F32
    full = n_kv * tokens * per
    swa = n_kv_swa * tokens * per if any(model.swa_layers) else 0
    return full + swa


def graph_peak_bytes(model: GGUFModel, settings: LlamaCppSettings, n_kv: int, n_kv_swa: int,
                     tokens: int, outputs: int) -> tuple[int, int]:  # fmt: skip
    """(low, high) bytes of one backend's buffer for the whole graph of ``tokens`` tokens."""
    mask = _mask_bytes(model, settings, n_kv, n_kv_swa, tokens)
    ffn = ffn_floats_per_token(model) * tokens * F32
    attn = attention_floats_per_token(model) * tokens * F32
    if not settings.flash_attn:
        attn += n_kv * tokens * model.n_head * F32
    logits = model.n_vocab * outputs * F32 + model.n_embd * tokens * F32
    low = mask + max(ffn, attn, logits)
    high = low + (model.n_embd + SMALL_FLOATS_PER_TOKEN) * tokens * F32
    return low, high


def _cpu_weight_copies(model: GGUFModel, placement: Placement) -> tuple[int, int]:
    """(largest CPU matrix, largest CPU layer) bytes: what op_offload copies to the GPU."""
    layers: dict[int, int] = {}
    largest = 0
    for p in placement.tensors:
        if p.device != CPU or p.tensor.layer is None or len(p.tensor.shape) < 2:
            continue
        layers[p.tensor.layer] = layers.get(p.tensor.layer, 0) + p.tensor.nbytes
        largest = max(largest, p.tensor.nbytes)
    return largest, max(layers.values(), default=0)


def estimate_compute(model: GGUFModel, settings: LlamaCppSettings, ctx: ContextSize, placement: Placement) -> list[ComputeEstimate]:
    """The compute buffer of each backend llama.cpp reserves for ``ctx``."""
    tokens = int(ctx.n_ubatch)
    n_kv = int(ctx.n_ctx_seq)
    n_seq = int(ctx.n_seq_max)
    unified = settings.kv_unified
    n_kv_swa = min(n_kv, model.sliding_window * (n_seq if unified else 1) + tokens) if model.sliding_window else 0
    n_kv_swa = (n_kv_swa + 255) // 256 * 256
    outputs = min(tokens, n_seq)
    low, high = graph_peak_bytes(model, settings, n_kv, n_kv_swa, tokens, outputs)
    basis = (f"estimate: mask + the largest phase of a {tokens}-token micro-batch over {n_kv} KV cells "
             f"({'flash attention' if settings.flash_attn else 'attention scores'})")  # fmt: skip
    gpu_layers = placement.gpu_layers()
    if gpu_layers == 0 and placement.output_device == CPU:
        return [ComputeEstimate(CPU, (low + high) // 2, low, high, basis)]
    out = []
    gpus = sorted({d for d in placement.layer_devices if d != CPU} | ({placement.output_device} - {CPU}))
    copy_low, copy_high = _cpu_weight_copies(model, placement) if gpu_layers < model.n_layer else (0, 0)
    for i, gpu in enumerate(gpus):
        g_low, g_high = low + (copy_low if i == 0 else 0), high + (copy_high if i == 0 else 0)
        out.append(ComputeEstimate(gpu, (g_low + g_high) // 2, g_low, g_high,
                                   basis + ("; + CPU layers' weights copied for batched products" if copy_high and i == 0 else "")))  # fmt: skip
    if gpu_layers < model.n_layer:
        out.append(ComputeEstimate(CPU, (low + high) // 2, low, high, basis + " (CPU layers, pinned host memory)"))
    else:
        embd = model.n_embd * tokens * F32 + _mask_bytes(model, settings, n_kv, n_kv_swa, tokens)
        small = SMALL_FLOATS_PER_TOKEN * tokens * F32
        out.append(ComputeEstimate(CPU, embd + small // 2, embd, embd + small,
                                   "estimate: the input embeddings and mask, in pinned host memory"))  # fmt: skip
    return out
