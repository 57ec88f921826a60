"""The llama.cpp memory model against a real llama-server on the CPU (tiny generated GGUFs).

llama-server is built once by ``scripts/setup-llama-server.sh`` (cached); each case starts it
on a tiny random-weight GGUF written with ``gguf`` and compares every buffer it prints with
the prediction: model, KV and output buffers exactly (to the 0.01 MiB the log prints), the
compute buffer within its stated range.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import require_or_skip
from tiny_gguf import SHAPES, write_tiny_gguf

from oomguard.tiering.compare import compare_load
from oomguard.tiering.gguf_file import read_gguf
from oomguard.tiering.memory import predict_llama_cpp
from oomguard.tiering.server import (
    LlamaServerNotFound,
    find_llama_server,
    running_llama_server,
    slot_capacity,
)
from oomguard.tiering.settings import LlamaCppSettings

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]

# (model, settings): every quantization type, slots with and without a unified pool, quantized
# KV, no mmap, no repacking, flash attention off, a small micro-batch
CASES = [
    ("q8_0", dict(ctx_size=4096)),
    ("q4_0", dict(ctx_size=3000, parallel=3)),
    ("q4_k", dict(ctx_size=2048, parallel=4, kv_unified=True)),
    ("q5_k", dict(ctx_size=2048, parallel=2, cache_type_k="q8_0", cache_type_v="q4_0")),
    ("q6_k", dict(ctx_size=1024, ubatch_size=128)),
    ("f16", dict(ctx_size=1024, mmap=False)),
    ("moe_q4_k", dict(ctx_size=4096, parallel=2)),
    ("moe_q4_k", dict(ctx_size=2048, cpu_repack="none")),
    ("q8_0", dict(ctx_size=8192, flash_attn=False)),
]


@pytest.fixture(scope="session")
def llama_server_binary() -> Path:
    """llama-server: the cached build, built here when ``OOMGUARD_BUILD_LLAMA=1`` and missing."""
    try:
        return find_llama_server()
    except LlamaServerNotFound as exc:
        if os.environ.get("OOMGUARD_BUILD_LLAMA") == "1":
            out = subprocess.run(
                ["bash", str(ROOT / "scripts" / "setup-llama-server.sh")],
                check=True,
                capture_output=True,
                text=True,
            )
            return Path(out.stdout.strip().splitlines()[-1])
        require_or_skip(f"{exc.message} ({exc.hint})")
        raise


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    return {k: write_tiny_gguf(root / f"{k}.gguf", s) for k, s in SHAPES.items()}


@pytest.mark.parametrize(
    ("name", "settings"), CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)]
)
def test_prediction_equals_what_llama_server_prints(
    llama_server_binary: Path, models: dict[str, Path], name: str, settings: dict[str, object]
) -> None:
    s = LlamaCppSettings(**settings)  # type: ignore[arg-type]
    prediction = predict_llama_cpp(read_gguf(models[name]), s)
    with running_llama_server(models[name], s, binary=llama_server_binary, timeout_s=90) as server:
        log = server.load_log
        assert log.context["n_ctx"] == str(prediction.context.n_ctx)
        assert log.context["n_ctx_seq"] == str(prediction.context.n_ctx_seq)
    checks = compare_load(prediction, log)
    kinds = {c.kind for c in checks if c.observed_bytes is not None}
    assert {"model", "kv", "compute"} <= kinds
    bad = [c.line() for c in checks if not c.agrees]
    assert not bad, "\n".join(bad)


def test_the_planned_command_form_runs_and_answers(
    llama_server_binary: Path, models: dict[str, Path]
) -> None:
    """The same flags ``plan`` renders for the llama.cpp tier (slots, -ngl, --fit off) on a tiny
    model."""
    s = LlamaCppSettings(
        ctx_size=4 * 512,
        parallel=4,
        n_gpu_layers=3,
        gpu_count=1,
        cache_type_k="q8_0",
        cache_type_v="q8_0",
    )
    with running_llama_server(
        models["q4_k"], s, binary=llama_server_binary, timeout_s=90
    ) as server:
        props = json.load(urllib.request.urlopen(f"{server.url}/props", timeout=10))
        capacity = slot_capacity(props)
        assert (capacity.total_slots, capacity.n_ctx_per_slot) == (4, 512)
        body = json.dumps({"prompt": "hello", "n_predict": 4}).encode()
        req = urllib.request.Request(
            f"{server.url}/completion", data=body, headers={"Content-Type": "application/json"}
        )
        answer = json.load(urllib.request.urlopen(req, timeout=60))
        assert answer["tokens_predicted"] == 4
        assert "--n-gpu-layers" in server.argv and "--fit" in server.argv


@pytest.fixture(scope="module")
def rpc_device(llama_server_binary: Path) -> Iterator[str]:
    """A second ggml device on this CPU: rpc-server on loopback (what -ngl offloads to here)."""
    from oomguard.engine import EngineProcess
    from oomguard.tiering.server import free_port

    try:
        binary = find_llama_server("rpc-server")
    except LlamaServerNotFound as exc:
        require_or_skip(f"{exc.message} ({exc.hint})")
        raise
    port = free_port()
    proc = EngineProcess([str(binary), "-H", "127.0.0.1", "-p", str(port), "-t", "1"])
    proc.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        proc.stop(grace_s=5.0)


SPLIT_CASES = [
    ("q8_0", dict(n_gpu_layers=3, ctx_size=2048)),  # layers 2, 3 and the output on the device
    ("q4_k", dict(n_gpu_layers=1, ctx_size=2048, parallel=2)),  # only the output layer
    ("q5_k", dict(n_gpu_layers=-1, ctx_size=1024)),  # everything, the tied head loaded twice
    ("moe_q4_k", dict(n_gpu_layers=-1, n_cpu_moe=2, ctx_size=2048)),  # experts of layers 0-1 stay
    ("q6_k", dict(n_gpu_layers=4, ctx_size=1024, kv_offload=False)),  # KV kept on the CPU
]


@pytest.mark.parametrize(
    ("name", "settings"), SPLIT_CASES, ids=[f"{n}-split{i}" for i, (n, _) in enumerate(SPLIT_CASES)]
)
def test_split_across_two_devices_equals_the_prediction(
    llama_server_binary: Path,
    rpc_device: str,
    models: dict[str, Path],
    name: str,
    settings: dict[str, object],
) -> None:
    """-ngl / --n-cpu-moe / --no-kv-offload against a real second device (rpc-server on this
    CPU)."""
    s = LlamaCppSettings(gpu_count=1, gpu_backend="rpc", **settings)  # type: ignore[arg-type]
    prediction = predict_llama_cpp(read_gguf(models[name]), s)
    with running_llama_server(
        models[name], s, binary=llama_server_binary, timeout_s=90, extra=("--rpc", rpc_device)
    ) as server:
        log = server.load_log
    assert log.gpu_names and log.gpu_names[0].startswith("RPC0[")
    checks = compare_load(prediction, log)
    on_device = {c.kind for c in checks if c.device == "GPU0" and c.observed_bytes}
    assert "model" in on_device
    bad = [c.line() for c in checks if not c.agrees]
    assert not bad, "\n".join(bad)
