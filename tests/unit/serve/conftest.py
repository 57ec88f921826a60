"""Serve unit tests: an empty calibration store each, the tiny model's config, and the real
vLLM CPU logs recorded in ``tests/integration/data``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomguard.logs.follow import LogFollower
from oomguard.memory.spec import GPUSpec, ModelSpec

DATA_DIR = Path(__file__).resolve().parents[2] / "integration" / "data"
GIB = 2**30

# the integration tier's generated model (tests/integration/tinymodel.py TINY): its config is
# all the memory model reads
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "vocab_size": 4096,
    "torch_dtype": "bfloat16",
}


@pytest.fixture(autouse=True)
def _own_calibration_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OOMGUARD_HOME", str(tmp_path / "oomguard-home"))


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A directory holding the tiny model's config.json (what vLLM was started with)."""
    path = tmp_path / "tiny-llama"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return path


@pytest.fixture
def tiny_spec(model_dir: Path) -> ModelSpec:
    from oomguard.facts.resolve import resolve_model

    return resolve_model(str(model_dir), allow_hub=False)


def cpu_node(total_gib: float = 12.59) -> GPUSpec:
    """The CPU node of the recording machine (the logs state its total)."""
    return GPUSpec(
        name="CPU node 0", total_bytes=int(total_gib * GIB), marketing_gb=13.5, vendor="cpu"
    )


def follow(name: str) -> LogFollower:
    """A follower fed the recorded log ``name`` line by line."""
    follower = LogFollower()
    for line in (DATA_DIR / f"{name}.log").read_text(errors="replace").splitlines():
        follower.feed(line)
    return follower
