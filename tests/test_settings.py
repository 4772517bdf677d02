"""Extension settings: strict validation and the two sources."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sglang_hicache_ext.sglang_ext.config.extra_config import read_extra_config
from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings, SettingsError
from sglang_hicache_ext.sglang_ext.config.settings_sources import (
    CONFIG_ENV_VAR,
    EXTRA_CONFIG_KEY,
    load_settings,
    read_settings_file,
)


def test_defaults_without_any_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONFIG_ENV_VAR, raising=False)
    assert load_settings() == ExtensionSettings()


def test_toml_and_json_files(tmp_path: Path) -> None:
    toml = tmp_path / "ext.toml"
    toml.write_text('cpu_compat = "on"\npreflight_checks = false\n')
    as_json = tmp_path / "ext.json"
    as_json.write_text(json.dumps({"cpu_compat": "on", "preflight_checks": False}))
    assert (
        read_settings_file(toml)
        == read_settings_file(as_json)
        == ExtensionSettings(cpu_compat="on", preflight_checks=False)
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('cpu_compatt = "on"\n', "unknown setting(s) 'cpu_compatt'"),
        (
            'cpu_compat = "sometimes"\n',
            "ext.toml: cpu_compat = 'sometimes' is not allowed; choose one of 'auto', 'on', 'off'",
        ),
        ("preflight_checks = 1\n", "preflight_checks = 1 should be of type bool"),
        ("cpu_compat = \n", "is not valid TOML"),
        ("chunk_store_bytes = 0\n", "chunk_store_bytes = 0 must be positive"),
        ("chunk_store_bytes = 1.5\n", "chunk_store_bytes = 1.5 should be of type int"),
        ("fusion_sink_tokens = -1\n", "fusion_sink_tokens = -1 must be >= 0"),
        ("fusion_recompute_ratio = 1.5\n", "fusion_recompute_ratio = 1.5 must be in [0, 1]"),
        ("fusion_shadow_rate = 1.5\n", "fusion_shadow_rate = 1.5 must be in [0, 1]"),
        ("fusion_target_agreement = -0.1\n", "fusion_target_agreement = -0.1 must be in [0, 1]"),
        ('fusion_selector = "magic"\n', "fusion_selector = 'magic' is unknown; choose from"),
        ("fusion_decode_capacity = 0\n", "fusion_decode_capacity = 0 must be in (0, 1], the"),
        ("fusion_decode_capacity = 1.5\n", "fusion_decode_capacity = 1.5 must be in (0, 1]"),
        ('fusion_decode_capacity = "all"\n', "fusion_decode_capacity = 'all'"),
        ("chunk_placement_alpha = -1.0\n", "chunk_placement_alpha = -1.0 must be >= 0"),
        ("chunk_placement_alpha = inf\n", "chunk_placement_alpha = inf must be a finite number"),
        (
            "chunk_placement_quality_floor = 1.5\n",
            "chunk_placement_quality_floor = 1.5 must be in [0, 1]",
        ),
        ("chunk_placement_interval_s = 0\n", "chunk_placement_interval_s = 0 must be positive"),
        ("chunk_placement_interval_s = 60\n", "chunk_placement_interval_s needs chunk_disk_dir"),
        ("chunk_max_body_bytes = 0\n", "chunk_max_body_bytes = 0 must be positive"),
        ('chunk_retention = "lfu"\n', "chunk_retention = 'lfu' is not allowed; choose one of"),
        ("chunk_retention_max_kv_error = 1.0\n", "chunk_retention_max_kv_error = 1.0 must be"),
        ("chunk_retention_max_kv_error = -0.1\n", "chunk_retention_max_kv_error = -0.1 must be"),
        ("chunk_max_tokens = -5\n", "chunk_max_tokens = -5 must be positive"),
        ("chunk_registrations_per_minute = -1\n", "must be >= 0 (0 = unlimited)"),
        ('chunk_max_tokens = "many"\n', "should be of type int"),
    ],
)
def test_bad_files_name_the_problem(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "ext.toml"
    path.write_text(content)
    with pytest.raises(SettingsError, match=re.escape(message)):
        read_settings_file(path)


def test_env_var_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "ext.toml"
    path.write_text('cpu_compat = "off"\n')
    monkeypatch.setenv(CONFIG_ENV_VAR, str(path))
    assert load_settings().cpu_compat == "off"


def test_missing_env_var_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CONFIG_ENV_VAR, str(tmp_path / "nope.toml"))
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings()


def test_inline_extra_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONFIG_ENV_VAR, raising=False)
    extra = json.dumps({"some_backend_key": 1, EXTRA_CONFIG_KEY: {"report_in_server_info": False}})
    assert load_settings(extra).report_in_server_info is False
    assert load_settings('{"unrelated": true}') == ExtensionSettings()


def test_two_sources_are_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "ext.toml"
    path.write_text("")
    monkeypatch.setenv(CONFIG_ENV_VAR, str(path))
    with pytest.raises(SettingsError, match="keep one"):
        load_settings({EXTRA_CONFIG_KEY: {}})


def test_chunk_limit_defaults() -> None:
    settings = ExtensionSettings()
    assert settings.chunk_max_body_bytes == 4 * 1024**2
    assert settings.chunk_max_tokens == 32768
    assert settings.chunk_registrations_per_minute == 120
    assert ExtensionSettings(chunk_registrations_per_minute=0).chunk_registrations_per_minute == 0


@pytest.mark.parametrize("suffix", [".json", ".toml", ".yaml"])
def test_extra_config_from_at_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, suffix: str
) -> None:
    monkeypatch.delenv(CONFIG_ENV_VAR, raising=False)
    path = tmp_path / f"extra{suffix}"
    if suffix == ".toml":
        path.write_text(f"prefetch_threshold = 64\n[{EXTRA_CONFIG_KEY}]\nchunk_max_tokens = 512\n")
    else:  # JSON is also YAML
        extra = {"prefetch_threshold": 64, EXTRA_CONFIG_KEY: {"chunk_max_tokens": 512}}
        path.write_text(json.dumps(extra))
    assert read_extra_config(f"@{path}")["prefetch_threshold"] == 64
    assert load_settings(f"@{path}").chunk_max_tokens == 512


def test_extra_config_at_file_naming_a_settings_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(CONFIG_ENV_VAR, raising=False)
    settings = tmp_path / "ext.toml"
    settings.write_text('cpu_compat = "off"\n')
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({EXTRA_CONFIG_KEY: str(settings)}))
    assert load_settings(f"@{extra}").cpu_compat == "off"


@pytest.mark.parametrize(
    ("content", "name", "message"),
    [
        (
            json.dumps({EXTRA_CONFIG_KEY: {"cpu_compat": "maybe"}}),
            "extra.json",
            "cpu_compat = 'maybe' is not allowed",
        ),
        ("{not json", "extra.json", "not valid JSON"),
        ("a = ", "extra.toml", "not valid TOML"),
        ("[1, 2]", "extra.json", "must be a JSON object"),
        ("{}", "extra.ini", "use a .json, .toml or .yaml file"),
    ],
)
def test_bad_at_file_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, content: str, name: str, message: str
) -> None:
    monkeypatch.delenv(CONFIG_ENV_VAR, raising=False)
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(SettingsError, match=re.escape(message)):
        load_settings(f"@{path}")


def test_missing_at_file_and_bad_inline_json_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="cannot read the file"):
        read_extra_config(f"@{tmp_path / 'missing.json'}")
    with pytest.raises(SettingsError, match="not valid JSON"):
        read_extra_config("{'single': 'quotes'}")
    assert read_extra_config(None) == read_extra_config("") == {}


def test_bad_values_built_in_code_are_settings_errors() -> None:
    with pytest.raises(SettingsError, match=re.escape("chunk_max_tokens = 0 must be positive")):
        ExtensionSettings(chunk_max_tokens=0)
    with pytest.raises(SettingsError, match=re.escape("fusion_selector = 'magic' is unknown")):
        ExtensionSettings(fusion_selector="magic")
    with pytest.raises(SettingsError, match=re.escape("must be in [0, 1]")):
        ExtensionSettings(fusion_recompute_ratio=float("nan"))
