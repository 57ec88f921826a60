"""Local directories, safetensors headers, the hub (offline / unreachable) and resolve order."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from oomguard.errors import MalformedConfig, UnknownModel
from oomguard.facts.catalogue import find_entry, list_entries
from oomguard.facts.hub import spec_from_hub
from oomguard.facts.local import INDEX_TOTAL_KEY, spec_from_local
from oomguard.facts.resolve import resolve_model, resolve_model_with_quantization

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 2048,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}  # fmt: skip


def _model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "tiny-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return d


def test_local_directory_with_safetensors_gives_exact_bytes(tmp_path: Path) -> None:
    d = _model_dir(tmp_path)
    save_file(
        {
            "model.embed_tokens.weight": np.zeros((100, 64), dtype=np.float16),
            "model.norm.weight": np.zeros((64,), dtype=np.float32),
        },
        str(d / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {"model.layers.0.mlp.up_proj.weight": np.zeros((128, 64), dtype=np.int8)},
        str(d / "model-00002-of-00002.safetensors"),
    )
    spec = spec_from_local(d)
    assert spec.name == "tiny-llama" and spec.source.endswith("config.json")
    assert spec.checkpoint_bytes_by_dtype == {"F16": 100 * 64 * 2, "F32": 64 * 4, "I8": 128 * 64}
    assert (
        spec_from_local(d / "config.json").checkpoint_bytes_by_dtype
        == spec.checkpoint_bytes_by_dtype
    )


def test_local_index_total_size_when_shards_absent(tmp_path: Path) -> None:
    d = _model_dir(tmp_path)
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 123456}, "weight_map": {}})
    )
    assert spec_from_local(d).checkpoint_bytes_by_dtype == {INDEX_TOTAL_KEY: 123456}


def test_malformed_config_json_names_path_and_problem(tmp_path: Path) -> None:
    d = tmp_path / "bad"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama", "hidden_size": 64,,}')
    with pytest.raises(MalformedConfig, match=r"bad/config.json is not valid JSON \(line 1"):
        spec_from_local(d)
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(MalformedConfig, match="not a JSON object"):
        spec_from_local(d)


def test_truncated_safetensors_header_is_malformed(tmp_path: Path) -> None:
    d = _model_dir(tmp_path)
    (d / "model.safetensors").write_bytes((10_000).to_bytes(8, "little") + b'{"a": 1}')
    with pytest.raises(MalformedConfig, match="model.safetensors: header length 10000"):
        spec_from_local(d)


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(MalformedConfig, match="has no config.json"):
        spec_from_local(tmp_path)


def test_resolve_prefers_existing_local_path(tmp_path: Path) -> None:
    d = _model_dir(tmp_path)
    assert resolve_model(str(d)).source == str(d / "config.json")
    with pytest.raises(UnknownModel, match="no such file"):
        resolve_model(str(tmp_path / "missing" / "config.json"))


def test_unknown_model_offline_names_the_alternatives(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UnknownModel) as info:
        resolve_model("meta-llama/Llama-3.1-8B-Instruckt")
    line = info.value.one_line()
    assert "HF_HUB_OFFLINE" in line and "config.json" in line and "--model" not in line
    if any(e.id == "meta-llama/Llama-3.1-8B-Instruct" for e in list_entries()):
        assert "meta-llama/Llama-3.1-8B-Instruct" in line


def test_unknown_model_without_hub() -> None:
    with pytest.raises(UnknownModel, match="not in the built-in catalogue"):
        resolve_model("nobody/no-such-model-xyz", allow_hub=False)


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A real TCP server on 127.0.0.1 that accepts connections and never answers."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
                held.append(conn)
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(2)
    for conn in held:
        conn.close()
    server.close()


def test_hub_that_never_answers_does_not_hang(
    monkeypatch: pytest.MonkeyPatch, silent_server: str, tmp_path: Path
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    start = time.monotonic()
    with pytest.raises(UnknownModel, match="could not be fetched from the hub"):
        spec_from_hub("someone/some-model", timeout_s=1.5, endpoint=silent_server)
    assert time.monotonic() - start < 5


def test_quantized_repo_name_selects_quantized_spec_of_catalogued_base() -> None:
    base = find_entry("meta-llama/Llama-3.1-8B-Instruct")
    spec = resolve_model("meta-llama/Llama-3.1-8B-Instruct-AWQ", allow_hub=False)
    assert spec.quant.method == "awq" and spec.quant.weight_bits == 4
    assert spec.total_params == base.spec().total_params
    assert resolve_model("Llama-3.1-8B-Instruct", allow_hub=False).quant.method is None


def test_quantization_flag_applies_online_fp8() -> None:
    spec = resolve_model_with_quantization(
        "meta-llama/Llama-3.1-8B-Instruct", "fp8", allow_hub=False
    )
    assert spec.quant.method == "fp8"


def test_catalogue_lookup_is_forgiving() -> None:
    entry = find_entry("meta-llama/Llama-3.1-8B-Instruct")
    assert find_entry("META-LLAMA/llama-3.1-8b-instruct") is entry
    assert find_entry("Llama-3.1-8B-Instruct") is entry
    assert find_entry("someorg/Llama-3.1-8B-Instruct") is entry  # another org's copy
    with pytest.raises(UnknownModel, match="closest catalogue names: .*Llama-3.1-8B"):
        find_entry("meta-llama/Llama-3.1-8B-Instrukt-v9")


def test_hub_on_a_closed_port_fails_at_once_without_retries(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now: connection refused
    start = time.monotonic()
    with caplog.at_level("WARNING"), pytest.raises(UnknownModel) as info:
        spec_from_hub("someone/some-model", timeout_s=5, endpoint=f"http://127.0.0.1:{port}")
    assert time.monotonic() - start < 1.5
    assert "hub unreachable and config.json not cached" in info.value.one_line()
    assert "local directory" in info.value.one_line()
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()]


def test_hub_unreachable_uses_a_cached_config(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An earlier download in the HF cache still serves when the hub cannot be reached."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    snapshot = tmp_path / "hf" / "hub" / "models--someone--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(TINY_LLAMA))
    refs = tmp_path / "hf" / "hub" / "models--someone--tiny" / "refs"
    refs.mkdir()
    (refs / "main").write_text("abc123")
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    spec = spec_from_hub("someone/tiny", timeout_s=5, endpoint=f"http://127.0.0.1:{port}")
    assert spec.hidden_size == 64 and spec.num_layers == 2


def test_known_quantized_variants_of_a_catalogued_base() -> None:
    from oomguard.facts import known_quantized_variants

    variants = known_quantized_variants("meta-llama/Llama-3.1-70B-Instruct")
    assert [repo for repo, _ in variants] == [
        "hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4",  # 4-bit before 8-bit
        "nvidia/Llama-3.1-70B-Instruct-FP8",
    ]
    awq = variants[0][1]
    assert (awq.method, awq.weight_bits, awq.group_size, awq.zero_point) == ("awq", 4, 128, True)
    assert variants[1][1].method == "fp8"
    # any name of the base works; every variant is itself a catalogue entry with that base
    assert known_quantized_variants("llama-3.1-70b-instruct") == variants
    for repo, quant in known_quantized_variants("meta-llama/Llama-3.1-8B-Instruct"):
        entry = find_entry(repo)
        assert entry.base_model == "meta-llama/Llama-3.1-8B-Instruct" and quant.weight_bits == 4
    assert known_quantized_variants("google/gemma-2-9b") == []
    assert known_quantized_variants("nobody/nothing") == []


def test_every_declared_base_model_is_consistent() -> None:
    """A base_model names a quantized entry's source repo: catalogued ones must match in shape."""
    for entry in list_entries():
        if not entry.base_model:
            continue
        spec = entry.spec()
        assert spec.quant.method is not None, f"{entry.id}: base_model set on an unquantized entry"
        try:
            base = find_entry(entry.base_model)
        except UnknownModel:
            continue  # a fine-tune that is not catalogued itself (e.g. zephyr-7b-beta)
        assert base.spec().total_params == spec.total_params, entry.id
