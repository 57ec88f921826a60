"""An estimate of llama.cpp's compute buffers, as a range that brackets the true size.

At load, ``llama_context::sched_reserve`` builds the prompt-processing graph for one
micro-batch of ``T = min(n_ctx, n_ubatch)`` tokens over the full KV cache, and ggml's graph
allocator (``ggml-alloc.c``) gives each backend one buffer as large as the most bytes its
tensors hold at once: a tensor's memory is reused once its last consumer ran, unary ops work
in place, and fragmentation adds what the best-fit search cannot reuse. oomguard does not
replay that allocator; it brackets its result from the graph a llama-style layer builds
(``llama-graph.cpp``, ``models/llama.cpp``):

- both bounds hold the inputs, alive for the whole graph: the attention mask ``[n_kv, T]``
  (f16 with flash attention, f32 without; sliding-window layers have their own), token ids,
  positions, output ids, and the logits ``[n_vocab, min(T, slots)]`` (llama-server reserves
  one output per slot);
- low: the tensors that must be alive together at the feed-forward peak (the residual and the
  gate, up and gated-product ``[n_ff, T]`` tensors; MoE: per used expert), or, without flash
  attention, the scores ``[n_kv, T, n_head]`` f32;
- high: every tensor one layer creates, kept (no reuse inside a layer), and the input
  embeddings.

The estimate's value is the middle of the range; the split search plans with the top. With
layers on a GPU, the GPU holds the same graph for its layers and, when layers also stay on the
CPU, the batched matrix products of those layers run on the GPU on copies of their weights
(``op_offload``, batches of 32 tokens or more): the range widens by the largest CPU weight
(low) to one CPU layer's weights (high), which is not checked against a GPU here.
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
SMALL_FLOATS_PER_TOKEN = 8  # token ids, positions, output ids, KV row indices


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


def peak_floats_per_token(model: GGUFModel) -> int:
    """f32 values per token live at the feed-forward peak with perfect reuse (the lower bound):
    the residual stream and the three ``[n_ff]`` tensors around the gated product (MoE: per used
    expert)."""
    if model.n_expert:
        ff = _expert_ff(model)
        return model.n_embd + 3 * max(1, model.n_expert_used) * ff + 3 * _shared_ff(model)
    return model.n_embd + 3 * model.n_ff


def layer_floats_per_token(model: GGUFModel, flash_attn: bool, n_kv: int) -> int:
    """f32 values per token of every intermediate tensor one layer creates (no reuse inside the
    layer: the upper bound). Attention: two norm outputs, Q/K/V, roped Q/K, the attention
    output, the output projection and the residual sum; without flash attention the scores
    ``[n_kv, n_head]`` (softmax in place) and the merged heads. Feed-forward: two norm outputs,
    gate, up, their product, down and the residual sum; MoE: router logits, probabilities and
    order, weights, per-expert gate/up/product, down and weighted outputs, their sum."""
    e = model.n_embd
    q = model.n_head * model.head_dim_k
    k = max(model.n_head_kv) * model.head_dim_k
    v = max(model.n_head_kv) * model.head_dim_v
    attn = 4 * e + 3 * q + 2 * k + v
    if not flash_attn:
        attn += n_kv * model.n_head + q
    if model.n_expert:
        used, ff = max(1, model.n_expert_used), _expert_ff(model)
        ffn = 4 * e + 3 * model.n_expert + used + 3 * used * ff + 2 * used * e + 3 * _shared_ff(model) + e
    else:
        ffn = 4 * e + 3 * model.n_ff
    return attn + ffn


def _mask_bytes(model: GGUFModel, settings: LlamaCppSettings, n_kv: int, n_kv_swa: int, tokens: int) -> int:
    per = 2 if settings.flash_attn else F32
    full = n_kv * tokens * per
    swa = n_kv_swa * tokens * per if any(model.swa_layers) else 0
    return full + swa


def graph_peak_bytes(model: GGUFModel, settings: LlamaCppSettings, n_kv: int, n_kv_swa: int,
                     tokens: int, outputs: int) -> tuple[int, int]:  # fmt: skip
    """(low, high) bytes of one backend's buffer for the whole graph of ``tokens`` tokens.

    Low: the inputs plus the largest set of tensors that must be alive at once (feed-forward
    peak, or the attention scores without flash attention). High: the inputs plus every tensor
    one layer creates, the input embeddings and the logits, as if nothing inside a layer were
    reused (the allocator frees a layer's tensors before the next layer's need the memory)."""
    mask = _mask_bytes(model, settings, n_kv, n_kv_swa, tokens)
    low_floats = peak_floats_per_token(model)
    if not settings.flash_attn:
        low_floats = max(low_floats, n_kv * model.n_head + model.n_embd + model.n_head * model.head_dim_k)
    logits = model.n_vocab * outputs * F32
    low = mask + max(low_floats * tokens * F32, logits)
    layer = layer_floats_per_token(model, settings.flash_attn, n_kv)
    high = mask + (layer + model.n_embd + SMALL_FLOATS_PER_TOKEN) * tokens * F32 + logits
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
    # op_offload copies CPU weights only to backends that ask for them (CUDA's offload_op;
    # the RPC backend has none)
    copies = gpu_layers < model.n_layer and settings.gpu_backend == "cuda"
    copy_low, copy_high = _cpu_weight_copies(model, placement) if copies else (0, 0)
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
