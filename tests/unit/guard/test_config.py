"""Guard settings: YAML file + CLI overrides, and one-line errors for bad values."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from oomguard.errors import BadInput, MalformedConfig
from oomguard.guard.cli import register
from oomguard.guard.config import load_config


def test_yaml_file_with_cli_overrides(tmp_path: Path) -> None:
    f = tmp_path / "guard.yaml"
    f.write_text(
        "backends:\n"
        "  - http://127.0.0.1:8000/\n"
        "  - url: http://127.0.0.1:8001\n"
        "    num_gpu_blocks: 2001\n"
        "    block_size: 16\n"
        "high_watermark: 0.85\n"
        "low_watermark: 0.7\n"
        "max_queue_requests: 50\n"
    )
    cfg = load_config(f, {"port": 9000, "host": None, "backends": None})
    assert [b.url for b in cfg.backends] == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    assert cfg.backends[1].num_gpu_blocks == 2001
    assert (cfg.high_watermark, cfg.low_watermark, cfg.port) == (0.85, 0.7, 9000)
    assert cfg.max_queue_requests == 50 and cfg.host == "127.0.0.1"
    cfg = load_config(f, {"backends": ["http://10.0.0.1:8000"]})
    assert [b.url for b in cfg.backends] == ["http://10.0.0.1:8000"]


def test_defaults_are_the_documented_watermarks() -> None:
    cfg = load_config(None, {"backends": ["http://127.0.0.1:8000"]})
    assert (cfg.high_watermark, cfg.low_watermark) == (0.90, 0.80)


@pytest.mark.parametrize(
    ("overrides", "text"),
    [
        ({"backends": ["http://x:1"], "low_watermark": 0.95}, "low_watermark"),
        ({"backends": ["ftp://x"]}, "http://HOST:PORT"),
        ({"backends": ["http://x:1"], "max_queue_requests": -1}, "max_queue_requests"),
        ({}, "no backend"),
    ],
)
def test_bad_values_are_one_line_bad_input(overrides: dict[str, object], text: str) -> None:
    with pytest.raises(BadInput) as exc:
        load_config(None, overrides)
    assert text in exc.value.one_line()
    assert "\n" not in exc.value.one_line()


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(MalformedConfig):
        load_config(tmp_path / "missing.yaml", {})
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends: [unclosed\n")
    with pytest.raises(MalformedConfig):
        load_config(bad, {})
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(MalformedConfig):
        load_config(listy, {})
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("backends: [http://x:1]\nhigh_watermarks: 0.9\n")
    with pytest.raises(BadInput, match="high_watermarks"):
        load_config(unknown, {})


def test_cli_command_raises_bad_input_for_bad_settings() -> None:
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """Group, so `guard` is a subcommand as in the real CLI."""

    register(app)
    with pytest.raises(BadInput, match="no backend"):
        app(["guard"], standalone_mode=False)
    with pytest.raises(BadInput, match="low_watermark"):
        app(
            ["guard", "--backend", "http://127.0.0.1:1", "--low-watermark", "0.99"],
            standalone_mode=False,
        )


def test_every_configuration_key_is_documented() -> None:
    from oomguard.guard.config import ApiKeyConfig, BackendConfig, GuardConfig

    doc = (Path(__file__).resolve().parents[3] / "docs" / "guard-config.md").read_text()
    keys = [f"`{k}`" for k in GuardConfig.model_fields]
    keys += [f"`backends[].{k}`" for k in BackendConfig.model_fields]
    keys += [f"`api_keys[].{k}`" for k in ApiKeyConfig.model_fields]
    missing = [k for k in keys if k not in doc]
    assert not missing, f"docs/guard-config.md lacks {missing}"


def test_workers_need_redis_and_redis_urls_are_checked() -> None:
    with pytest.raises(BadInput) as exc:
        load_config(None, {"backends": ["http://x:1"], "workers": 3})
    assert "redis_url" in exc.value.one_line()
    with pytest.raises(BadInput) as exc:
        load_config(None, {"backends": ["http://x:1"], "redis_url": "http://r:6379"})
    assert "redis://" in exc.value.one_line()
    cfg = load_config(None, {"backends": ["http://x:1"], "retry_wait_s": 30})
    assert cfg.restart_wait_s == 30
