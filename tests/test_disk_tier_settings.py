"""The disk tier's settings as part of the one settings model: the extra-config keys deployments
use still parse to the same values and defaults, and a bad value is one line naming the key."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from sglang_hicache_ext.sglang_ext.config.disk_tier_settings import (
    DiskTierSettings,
    disk_tier_extra_config,
)
from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings, SettingsError
from sglang_hicache_ext.sglang_ext.config.settings_sources import (
    CONFIG_ENV_VAR,
    EXTRA_CONFIG_KEY,
    load_settings,
)
from sglang_hicache_ext.tuning.ttl.online_config import OnlineTtlConfig

# Every key the extra config took before the settings model held them, as deployments write it
# (JSON numbers: an int where the value is whole).
EVERY_KEY: dict[str, Any] = {
    "disk_dir": "/var/cache/sglang-disk",
    "capacity_bytes": 64e9,
    "disk_budget_bytes": 32e9,
    "ttl_policy": "static",
    "ttl_period_s": 60,
    "ttl_window_s": 600,
    "ttl_groups": 4,
    "max_ttl_s": 7200,
    "initial_ttl_s": 120,
    "pace_first_period": False,
    "static_ttls": {"g1": 30, "g2": 0.5},
    "purge_interval_s": 1,
    "ttl_history_save_s": 0.5,
}


@pytest.fixture(autouse=True)
def _no_settings_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONFIG_ENV_VAR, raising=False)


def test_every_existing_key_parses_to_its_value() -> None:
    extra = disk_tier_extra_config(**EVERY_KEY)
    settings = DiskTierSettings.from_extra_config(json.loads(json.dumps(extra)))
    assert settings.model_dump() == {
        **EVERY_KEY,
        "static_ttls": {"g1": 30.0, "g2": 0.5},
    }
    assert settings.ttl_config() == OnlineTtlConfig(
        policy="static",
        disk_budget_bytes=32e9,
        capacity_bytes=64e9,
        period_s=60.0,
        window_s=600.0,
        top_k=4,
        max_ttl_s=7200.0,
        initial_ttl_s=120.0,
        pace_first_period=False,
        static_ttls=(("g1", 30.0), ("g2", 0.5)),
    )
    assert settings.history_save_s == 0.5


def test_defaults_are_unchanged() -> None:
    settings = DiskTierSettings()
    assert settings.model_dump() == {
        "disk_dir": "/tmp/sglang-hicache-ext-disk",
        "capacity_bytes": 16 * 2**30,
        "disk_budget_bytes": None,
        "ttl_policy": "group",
        "ttl_period_s": 300.0,
        "ttl_window_s": 3600.0,
        "ttl_groups": 8,
        "max_ttl_s": 86_400.0,
        "initial_ttl_s": 600.0,
        "pace_first_period": True,
        "static_ttls": None,
        "purge_interval_s": 5.0,
        "ttl_history_save_s": None,
    }
    config = settings.ttl_config()
    assert config.disk_budget_bytes == 8 * 2**30  # half the capacity
    assert settings.history_save_s == 60.0  # min(ttl_period_s, 60)
    assert DiskTierSettings(ttl_period_s=10).history_save_s == 10.0


def test_the_settings_model_holds_the_disk_tier() -> None:
    extra = {
        **disk_tier_extra_config("/tmp/d", ttl_groups=2),
        "prefetch_threshold": 64,  # SGLang's own keys are SGLang's
        EXTRA_CONFIG_KEY: {"chunk_max_tokens": 512},
    }
    settings = load_settings(json.dumps(extra))
    assert settings.chunk_max_tokens == 512
    assert settings.disk_tier == DiskTierSettings(disk_dir="/tmp/d", ttl_groups=2)
    assert settings.as_dict()["disk_tier"]["ttl_groups"] == 2
    # Another backend's config, or none: no disk tier, its keys are not ours to check.
    other = {"backend_name": "x", "module_path": "elsewhere", "ttl_polcy": 1}
    assert load_settings(json.dumps(other)).disk_tier is None
    assert load_settings().disk_tier is None


@pytest.mark.parametrize("suffix", [".toml", ".yaml"])
def test_disk_tier_keys_from_an_at_file(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"extra{suffix}"
    if suffix == ".toml":
        lines = [
            f"{key} = {json.dumps(value)}" for key, value in disk_tier_extra_config("/d").items()
        ]
        path.write_text("\n".join([*lines, "capacity_bytes = 64e9", "[static_ttls]", "g = 30"]))
    else:  # JSON is also YAML
        path.write_text(json.dumps(disk_tier_extra_config("/d", capacity_bytes=64e9)))
    disk_tier = load_settings(f"@{path}").disk_tier
    assert disk_tier is not None
    assert (disk_tier.disk_dir, disk_tier.capacity_bytes) == ("/d", 64e9)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"ttl_polcy": "group"}, "unknown setting(s) 'ttl_polcy'; known settings: disk_dir, "),
        (
            {"ttl_policy": "lru"},
            "ttl_policy = 'lru' is not allowed; "
            "choose one of 'group', 'group-always', 'fixed', 'static'",
        ),
        ({"capacity_bytes": 0}, "capacity_bytes = 0 must be positive"),
        ({"capacity_bytes": float("inf")}, "capacity_bytes = inf must be a finite number"),
        ({"capacity_bytes": "64e9"}, "capacity_bytes = '64e9' should be of type float"),
        ({"disk_budget_bytes": -1}, "disk_budget_bytes = -1 must be >= 0"),
        ({"ttl_period_s": 0}, "ttl_period_s = 0 must be positive"),
        ({"ttl_window_s": -5.0}, "ttl_window_s = -5.0 must be positive"),
        ({"ttl_groups": -1}, "ttl_groups = -1 must be >= 0"),
        ({"ttl_groups": 2.5}, "ttl_groups = 2.5 should be of type int"),
        ({"max_ttl_s": float("nan")}, "max_ttl_s = nan must be a finite number"),
        ({"initial_ttl_s": -1}, "initial_ttl_s = -1 must be >= 0"),
        ({"pace_first_period": 1}, "pace_first_period = 1 should be of type bool"),
        (
            {"static_ttls": {"g": -1}},
            "static_ttls = {'g': -1} must map each group to a finite TTL >= 0 (seconds)",
        ),
        ({"static_ttls": {"g": "long"}}, "static_ttls['g'] = 'long' should be of type float"),
        ({"static_ttls": [30]}, "static_ttls = [30] should be of type dict"),
        ({"purge_interval_s": 0}, "purge_interval_s = 0 must be positive"),
        ({"ttl_history_save_s": 0}, "ttl_history_save_s = 0 must be positive"),
        ({"disk_dir": 3}, "disk_dir = 3 should be of type str"),
    ],
)
def test_bad_values_are_one_line(values: dict[str, Any], message: str) -> None:
    extra = {**disk_tier_extra_config("/tmp/d"), **values}
    with pytest.raises(SettingsError) as caught:
        DiskTierSettings.from_extra_config(extra)
    assert str(caught.value).startswith(f"hicache_ext_disk: {message}")
    assert "\n" not in str(caught.value)
    # Through the settings model, the same line (what the launch check reports).
    with pytest.raises(SettingsError, match=re.escape(message)):
        load_settings(json.dumps(extra))


def test_interface_v1_is_required() -> None:
    extra = {**disk_tier_extra_config("/tmp/d"), "interface_v1": 0}
    with pytest.raises(SettingsError, match=re.escape('needs "interface_v1": 1')):
        DiskTierSettings.from_extra_config(extra)


def test_a_settings_file_does_not_take_the_disk_tier(tmp_path: Path) -> None:
    path = tmp_path / "ext.json"
    path.write_text(json.dumps({"disk_tier": {"ttl_groups": 2}}))
    with pytest.raises(SettingsError, match="disk_tier is not a key of this file"):
        load_settings(json.dumps({EXTRA_CONFIG_KEY: str(path)}))


def test_every_disk_tier_setting_is_described() -> None:
    assert ExtensionSettings.model_fields["disk_tier"].description
    assert all(field.description for field in DiskTierSettings.model_fields.values())
