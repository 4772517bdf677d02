"""Extension settings: strict validation and the two sources."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sglang_ext.settings import (
    CONFIG_ENV_VAR,
    EXTRA_CONFIG_KEY,
    ExtensionSettings,
    SettingsError,
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
        ('cpu_compat = "sometimes"\n', "cpu_compat = 'sometimes' is not allowed"),
        ("preflight_checks = 1\n", "preflight_checks = 1 should be of type bool"),
        ("cpu_compat = \n", "is not valid TOML"),
        ("chunk_store_bytes = 0\n", "chunk_store_bytes = 0 must be positive"),
        ("chunk_store_bytes = 1.5\n", "chunk_store_bytes = 1.5 should be of type int"),
        ("fusion_sink_tokens = -1\n", "fusion_sink_tokens = -1 must be >= 0"),
    ],
)
def test_bad_files_name_the_problem(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "ext.toml"
    path.write_text(content)
    with pytest.raises(SettingsError, match=message.replace("(", r"\(").replace(")", r"\)")):
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
