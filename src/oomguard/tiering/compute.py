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

from oomguard.tiering.model import GGUFModel
from oomguard.tiering.placement import CPU, Placement
from oomguard.tiering.settings import ContextSize, LlamaCppSettings

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
    t = next(
        (t for t in model.tensors if ".ffn_gate_exps." in t.name or ".ffn_up_exps." in t.name), None
    )
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
        ffn = (
            4 * e
            + 3 * model.n_expert
            + used
            + 3 * used * ff
            + 2 * used * e
            + 3 * _shared_ff(model)
            + e
        )
    else:
        ffn = 4 * e + 3 * model.n_ff
    return attn + ffn


def _mask_bytes(
    model: GGUFModel, settings: LlamaCppSettings, n_kv: int, n_kv_swa: int, tokens: int
) -> int:
    per = 2 if settings.flash_attn else F32
    full = n_kv * tokens * per
    swa = n_kv_swa * tokens * per if any(model.swa_layers) else 0
    return full + swa


@dataclass(frozen=True)
class _Phases:
    """Bytes of the graph's parts for one micro-batch (see the module docstring)."""

    mask: int
    embd: int  # one [n_embd, T] f32 tensor
    small: int
    ffn_low: int  # feed-forward peak live set
    attn_low: int  # attention live set (scores included without flash attention)
    layer: int  # every tensor of one layer
    logits: int
    head: int  # the output norm of the output rows


def _phases(
    model: GGUFModel,
    settings: LlamaCppSettings,
    n_kv: int,
    n_kv_swa: int,
    tokens: int,
    outputs: int,
) -> _Phases:
    q = model.n_head * model.head_dim_k
    kv = max(model.n_head_kv) * (model.head_dim_k + model.head_dim_v)
    attn = (model.n_embd + q + kv) * tokens * F32
    if not settings.flash_attn:
        attn = (n_kv * model.n_head + model.n_embd + q) * tokens * F32
    return _Phases(
        mask=_mask_bytes(model, settings, n_kv, n_kv_swa, tokens),
        embd=model.n_embd * tokens * F32,
        small=SMALL_FLOATS_PER_TOKEN * tokens * F32,
        ffn_low=peak_floats_per_token(model) * tokens * F32,
        attn_low=attn,
        layer=layer_floats_per_token(model, settings.flash_attn, n_kv) * tokens * F32,
        logits=model.n_vocab * outputs * F32,
        head=2 * model.n_embd * outputs * F32,
    )


def _device_range(
    device: str, ph: _Phases, runs_attention: bool, runs_ffn: bool, runs_output: bool
) -> tuple[int, int]:
    """(low, high) of one backend's buffer from the parts of the graph it runs.

    The CPU holds the graph's inputs (mask, the embeddings from ``get_rows``, and up to one more
    ``[n_embd, T]`` tensor); a GPU that runs attention holds a copy of the mask. A backend runs
    the operations whose weights it holds (``ggml_backend_sched``), so the attention, the
    feed-forward (or the experts alone, with ``--n-cpu-moe``) and the head may sit on
    different backends."""
    low = high = 0
    if device == CPU:
        low, high = ph.mask, ph.mask + 2 * ph.embd + ph.small
    elif runs_attention:
        low, high = ph.mask, ph.mask + ph.small
    phases = [
        ph.ffn_low if runs_ffn else 0,
        ph.attn_low if runs_attention else 0,
        ph.logits if runs_output else 0,
        ph.embd if device == CPU else 0,
    ]
    low += max(phases)
    if runs_attention or runs_ffn:
        high += ph.layer + ph.embd
    if runs_output:
        high += ph.logits + ph.head
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


def _roles(model: GGUFModel, placement: Placement) -> dict[str, tuple[bool, bool, bool]]:
    """Per device: (runs attention, runs a feed-forward or experts, runs the head)."""
    attention: set[str] = set()
    ffn: set[str] = set()
    for p in placement.tensors:
        if p.tensor.layer is None:
            continue
        if ".attn_" in p.tensor.name:
            attention.add(p.device)
        elif (
            ".ffn_" in p.tensor.name and "norm" not in p.tensor.name and "_inp" not in p.tensor.name
        ):
            ffn.add(p.device)
    devices = attention | ffn | {placement.output_device, CPU}
    return {d: (d in attention, d in ffn, d == placement.output_device) for d in devices}


def estimate_compute(
    model: GGUFModel, settings: LlamaCppSettings, ctx: ContextSize, placement: Placement
) -> list[ComputeEstimate]:
    """The compute buffer of each backend llama.cpp reserves for ``ctx``."""
    tokens = int(ctx.n_ubatch)
    n_kv = int(ctx.n_ctx_seq)
    n_seq = int(ctx.n_seq_max)
    n_kv_swa = (
        min(n_kv, model.sliding_window * (n_seq if settings.kv_unified else 1) + tokens)
        if model.sliding_window
        else 0
    )
    n_kv_swa = (n_kv_swa + 255) // 256 * 256
    ph = _phases(model, settings, n_kv, n_kv_swa, tokens, min(tokens, n_seq))
    basis = (
        f"estimate: the parts of a {tokens}-token micro-batch's graph over {n_kv} KV cells this "
        f"backend runs ({'flash attention' if settings.flash_attn else 'attention scores'})"
    )
    # op_offload copies CPU weights only to backends that ask for them (CUDA's offload_op;
    # the RPC backend has none)
    gpu_layers = placement.gpu_layers()
    copies = gpu_layers < model.n_layer and settings.gpu_backend == "cuda"
    copy_low, copy_high = _cpu_weight_copies(model, placement) if copies else (0, 0)
    out = []
    roles = _roles(model, placement)
    split_experts = (
        model.n_expert > 0 and (settings.cpu_moe or settings.n_cpu_moe > 0) and gpu_layers > 0
    )
    for device in sorted(roles, key=lambda d: (d != CPU, d)):
        attention, ffn, head = roles[device]
        # with experts split between the CPU and a GPU, a real second device (rpc-server) held far
        # less than the experts' live set; not understood, so the GPU's range starts at attention
        low, high = _device_range(
            device, ph, attention, ffn and not (split_experts and device != CPU), head
        )
        if split_experts and device != CPU and ffn:
            high = max(high, _device_range(device, ph, attention, True, head)[1])
        if device == "GPU0" and copy_high:
            low, high = low + copy_low, high + copy_high
        if high == 0:
            continue
        where = " (pinned host memory)" if device == CPU and gpu_layers else ""
        out.append(ComputeEstimate(device, (low + high) // 2, low, high, basis + where))
    return out
