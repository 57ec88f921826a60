"""A model as llama.cpp loads it: hyperparameters and the tensor table of its GGUF file.

:class:`GGUFModel` is a pure value. It comes either from a GGUF file's header
(:func:`oomguard.tiering.gguf_file.read_gguf`, exact: every tensor's type, shape and file
offset) or, when the user has no file yet, from a :class:`~oomguard.memory.spec.ModelSpec`
with the tensor types llama.cpp's quantizer would give (:func:`synthesize_gguf`: exact for
the tensor shapes, the type recipe as in ``llama-quant.cpp``).

Where a tensor lives follows llama.cpp's ``llm_tensor_info`` layers: ``token_embd`` is the
input layer (always on the CPU), ``blk.N.*`` tensors belong to repeating layer N, and the
rest (``output``, ``output_norm``) to the output layer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property

from oomguard.tiering.ggml_types import tensor_bytes

_BLOCK = re.compile(r"^blk\.(\d+)\.")
# input-layer tensors (llama-arch.cpp LLM_TENSOR_LAYER_INPUT)
_INPUT_NAMES = ("token_embd.", "token_embd_norm.", "token_types.", "position_embd.")
EXPERT_TENSOR = re.compile(r"\.ffn_(up|down|gate|gate_up)_(ch|)exps")  # common.h LLM_FFN_EXPS_REGEX


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: ggml shape (``ne0`` first), GGML type and data offset."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    offset_bytes: int | None = None  # from the start of the file's data section (None: synthesized)

    @cached_property
    def nbytes(self) -> int:
        """``ggml_nbytes`` of the tensor."""
        return tensor_bytes(self.type_name, self.shape)

    @cached_property
    def layer(self) -> int | None:
        """The repeating layer (``blk.N``) the tensor belongs to, else None."""
        m = _BLOCK.match(self.name)
        return int(m.group(1)) if m else None

    @cached_property
    def role(self) -> str:
        """``"input"``, ``"repeating"`` or ``"output"`` (llama.cpp's tensor layer)."""
        if self.layer is not None:
            return "repeating"
        if self.name.startswith(_INPUT_NAMES):
            return "input"
        if self.name.startswith("rope_freqs."):
            return "repeating"  # created with layer 0 (llama-model.cpp, TENSOR_DUPLICATED after)
        return "output"

    @property
    def is_expert(self) -> bool:
        """An MoE expert tensor (what ``--cpu-moe`` / ``--n-cpu-moe`` move to the CPU)."""
        return bool(EXPERT_TENSOR.search(self.name))


@dataclass(frozen=True)
class GGUFModel:
    """What llama.cpp's memory depends on, for one GGUF model.

    ``n_head_kv`` and ``swa_layers`` are per layer; ``sliding_window`` is 0 for models without
    sliding-window attention. ``source`` says where the tensor table came from.
    """

    name: str
    architecture: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: tuple[int, ...]
    head_dim_k: int
    head_dim_v: int
    n_vocab: int
    n_ctx_train: int
    tensors: tuple[GGUFTensor, ...]
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff: int = 0
    sliding_window: int = 0
    swa_layers: tuple[bool, ...] = ()
    file_type: str = ""  # "Q4_K_M", from general.file_type or the recipe used
    source: str = ""
    file_bytes: int | None = None
    notes: tuple[str, ...] = field(default=())

    @cached_property
    def by_name(self) -> dict[str, GGUFTensor]:
        return {t.name: t for t in self.tensors}

    @property
    def tied_output(self) -> bool:
        """No ``output.weight``: llama.cpp loads ``token_embd`` a second time as the head."""
        return "output.weight" not in self.by_name and "token_embd.weight" in self.by_name

    @cached_property
    def weight_bytes(self) -> int:
        """Bytes of all tensors in the file."""
        return sum(t.nbytes for t in self.tensors)

    def layer_bytes(self, layer: int) -> int:
        """Bytes of the tensors of repeating layer ``layer``."""
        return sum(t.nbytes for t in self.tensors if t.layer == layer)

    def n_embd_k_gqa(self, layer: int) -> int:
        """K values per token in ``layer`` (``hparams.n_embd_k_gqa``)."""
        return self.n_head_kv[layer] * self.head_dim_k

    def n_embd_v_gqa(self, layer: int) -> int:
        """V values per token in ``layer`` (``hparams.n_embd_v_gqa``)."""
        return self.n_head_kv[layer] * self.head_dim_v

    def is_swa(self, layer: int) -> bool:
        """Whether ``layer`` uses sliding-window attention (its own, smaller KV cache)."""
        return bool(self.swa_layers) and self.swa_layers[layer]

    @property
    def bits_per_weight(self) -> float:
        """Average bits per weight over the whole file (llama.cpp's ``BPW``)."""
        elements = 0
        for t in self.tensors:
            n = 1
            for d in t.shape:
                n *= d
            elements += n
        return 8 * self.weight_bytes / elements if elements else 0.0
