"""Where llama.cpp puts each tensor for a given ``-ngl`` / ``--n-cpu-moe`` / ``-ot`` split.

The rules, from ``llama-model.cpp`` ``load_tensors`` and ``llama-model-loader.cpp``
``create_tensor``:

- the input layer (``token_embd``) always stays on the CPU ("very little benefit to
  offloading the input layer");
- layers are numbered 0 … n_layer, the output layer being number n_layer; with
  ``-ngl N`` the layers from ``i_gpu_start = max(n_layer + 1 - N, 0)`` on go to the GPUs, so
  the *last* layers and the output go first;
- with several GPUs, layer ``il`` goes to the first GPU whose cumulative share of
  ``tensor_split`` exceeds ``(il - i_gpu_start) / N`` (default split: by free memory);
- an ``--override-tensor`` rule whose pattern is found in a tensor's name wins over the
  layer's device (first matching rule); ``--cpu-moe`` / ``--n-cpu-moe`` are such rules;
- a model without ``output.weight`` loads ``token_embd`` a second time as the output tensor,
  on the output layer's device.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from oomguard.tiering.model import GGUFModel, GGUFTensor
from oomguard.tiering.settings import REPACK_TYPES, LlamaCppSettings

CPU = "CPU"
REPACK = "CPU_REPACK"  # the CPU's repacked-weights buffer type


def gpu_name(index: int) -> str:
    """The device key of GPU ``index`` ("GPU0")."""
    return f"GPU{index}"


@dataclass(frozen=True)
class Placed:
    """One tensor llama.cpp creates, its device and whether the CPU backend repacks it."""

    tensor: GGUFTensor
    device: str
    repacked: bool = False


@dataclass(frozen=True)
class Placement:
    """The device of every tensor llama.cpp creates (a tied head appears twice)."""

    tensors: tuple[Placed, ...]
    layer_devices: tuple[str, ...]  # device of each repeating layer (also where its KV goes)
    output_device: str
    i_gpu_start: int
    n_gpu_layers: int  # effective: min(-ngl, n_layer + 1), 0 without GPUs

    def devices(self) -> list[str]:
        """Devices holding any tensor, CPU first."""
        seen = {p.device for p in self.tensors} | set(self.layer_devices)
        return sorted(seen, key=lambda d: (d != CPU, d))

    def gpu_layers(self) -> int:
        """Repeating layers on a GPU."""
        return sum(1 for d in self.layer_devices if d != CPU)


def _split_points(settings: LlamaCppSettings) -> list[float]:
    shares = list(settings.tensor_split) or [1.0] * settings.gpu_count
    shares = (shares + [0.0] * settings.gpu_count)[: settings.gpu_count]
    total = sum(shares) or 1.0
    points, running = [], 0.0
    for share in shares:
        running += share
        points.append(running / total)
    return points


def _layer_device(il: int, i_gpu_start: int, n_gpu: int, points: list[float]) -> str:
    if n_gpu == 0 or il < i_gpu_start or il - i_gpu_start >= n_gpu:
        return CPU
    index = bisect.bisect_right(points, (il - i_gpu_start) / n_gpu)
    return gpu_name(min(index, len(points) - 1))


def place(model: GGUFModel, settings: LlamaCppSettings) -> Placement:
    """The device of each tensor under ``settings`` (pure)."""
    n_all = model.n_layer
    wanted = n_all + 1 if settings.n_gpu_layers < 0 else settings.n_gpu_layers
    n_gpu = min(wanted, n_all + 1) if settings.gpu_count > 0 else 0
    i_gpu_start = max(n_all + 1 - wanted, 0)
    points = _split_points(settings) if settings.gpu_count else []
    layer_devices = tuple(_layer_device(il, i_gpu_start, n_gpu, points) for il in range(n_all))
    output_device = _layer_device(n_all, i_gpu_start, n_gpu, points)
    rules = settings.all_overrides()

    def device_of(t: GGUFTensor, default: str) -> str:
        for rule in rules:
            if rule.matches(t.name):
                return rule.device if settings.gpu_count or rule.device == CPU else CPU
        return default

    repack_types = REPACK_TYPES[settings.cpu_repack]

    def placed(t: GGUFTensor, device: str, matmul: bool) -> Placed:
        # the CPU buffer list puts the repack buffer type first (llama-model.cpp
        # make_cpu_buft_list); only matrix products use it, and only for row counts its kernels tile
        # (multiples of 8)
        rows = t.shape[1] if len(t.shape) > 1 else 1
        repack = device == CPU and matmul and t.type_name in repack_types and rows % 8 == 0
        return Placed(t, device, repack)

    out: list[Placed] = []
    for t in model.tensors:
        role = t.role
        if role == "input":
            default = CPU
        elif role == "output":
            default = output_device
        else:
            default = layer_devices[t.layer or 0]
        device = device_of(t, default) if rules else default
        out.append(placed(t, device, role != "input" and len(t.shape) > 1))
    if model.tied_output:
        embd = model.by_name["token_embd.weight"]
        out.append(placed(embd, device_of(embd, output_device) if rules else output_device, True))
    return Placement(tuple(out), layer_devices, output_device, i_gpu_start, n_gpu)
