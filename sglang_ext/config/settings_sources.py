"""Where the extension's settings come from: one JSON or TOML file, named by the environment
variable `SGLANG_HICACHE_EXT_CONFIG` or by the key `"hicache_ext_config"` of SGLang's
`--hicache-storage-backend-extra-config` (which may also hold them inline), else the defaults
of `ExtensionSettings` (`settings.py`). The disk tier's part comes from the extra-config's own
keys when that loads our disk tier.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sglang_hicache_ext.sglang_ext.config.disk_tier_settings import (
    DiskTierSettings,
    loads_disk_tier,
)
from sglang_hicache_ext.sglang_ext.config.extra_config import SettingsError, read_extra_config
from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings

CONFIG_ENV_VAR = "SGLANG_HICACHE_EXT_CONFIG"
EXTRA_CONFIG_KEY = "hicache_ext_config"


def read_settings_file(path: str | os.PathLike[str]) -> ExtensionSettings:
    path = Path(path).expanduser()
    if not path.is_file():
        raise SettingsError(f"settings file {path} does not exist (named by {CONFIG_ENV_VAR})")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            values = tomllib.loads(text)
        elif path.suffix == ".json":
            values = json.loads(text)
        else:
            raise SettingsError(f"settings file {path}: use a .toml or .json file")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        raise SettingsError(
            f"settings file {path} is not valid {path.suffix[1:].upper()}: {err}"
        ) from err
    if not isinstance(values, dict):
        raise SettingsError(f"settings file {path}: the top level must be a table/object")
    return ExtensionSettings.from_mapping(values, source=str(path))


def settings_from_extra_config(
    extra_config: str | Mapping[str, Any] | None,
) -> ExtensionSettings | None:
    """Settings named or given inline in SGLang's storage-backend extra-config, if any."""
    extra = read_extra_config(extra_config)
    if EXTRA_CONFIG_KEY not in extra:
        return None
    value = extra[EXTRA_CONFIG_KEY]
    if isinstance(value, str):
        return read_settings_file(value)
    if isinstance(value, Mapping):
        return ExtensionSettings.from_mapping(value, source=f"extra-config {EXTRA_CONFIG_KEY}")
    raise SettingsError(
        f"extra-config {EXTRA_CONFIG_KEY} must be a path to a .toml/.json file or an object"
    )


def load_settings(extra_config: str | Mapping[str, Any] | None = None) -> ExtensionSettings:
    """The effective settings: extra-config first, then the env var file, then defaults.

    Naming a file in both places is refused: two sources of truth would drift apart. The
    `disk_tier` part comes from the extra-config's own keys when that loads our disk tier.
    """
    extra = read_extra_config(extra_config)
    from_extra = settings_from_extra_config(extra)
    env_path = os.environ.get(CONFIG_ENV_VAR)
    if from_extra is not None and env_path:
        raise SettingsError(
            f"settings are given both by {CONFIG_ENV_VAR} and by extra-config "
            f"{EXTRA_CONFIG_KEY}; keep one"
        )
    if from_extra is not None:
        settings = from_extra
    elif env_path:
        settings = read_settings_file(env_path)
    else:
        settings = ExtensionSettings()
    if not loads_disk_tier(extra):
        return settings
    return settings.model_copy(update={"disk_tier": DiskTierSettings.from_extra_config(extra)})
