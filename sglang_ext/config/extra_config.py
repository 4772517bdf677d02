"""SGLang's `--hicache-storage-backend-extra-config` read as SGLang's HiCache controller reads it
(inline JSON, or `@path` to a .json, .toml or .yaml file), and the error a settings problem
raises."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class SettingsError(ValueError):
    """A settings file or value that the extension refuses to start with."""


def read_extra_config(extra_config: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """SGLang's `--hicache-storage-backend-extra-config` as an object: inline JSON, or `@path`
    to a .json, .toml or .yaml/.yml file (the forms SGLang's HiCache controller accepts)."""
    if extra_config is None:
        return {}
    if isinstance(extra_config, Mapping):
        return dict(extra_config)
    source = "--hicache-storage-backend-extra-config"
    if extra_config.startswith("@"):
        path = Path(extra_config[1:]).expanduser()
        source = f"{source} {extra_config}"
        suffix = path.suffix.lower()
        try:
            text = path.read_text()
        except OSError as err:
            raise SettingsError(f"{source}: cannot read the file ({err.strerror})") from err
        try:
            if suffix == ".json":
                value = json.loads(text)
            elif suffix == ".toml":
                value = tomllib.loads(text)
            elif suffix in (".yaml", ".yml"):
                import yaml

                value = yaml.safe_load(text)
            else:
                raise SettingsError(f"{source}: use a .json, .toml or .yaml file")
        except (json.JSONDecodeError, tomllib.TOMLDecodeError) as err:
            raise SettingsError(f"{source}: not valid {suffix[1:].upper()}: {err}") from err
        except ImportError as err:  # PyYAML is optional, as in SGLang
            raise SettingsError(f"{source}: reading YAML needs PyYAML") from err
        except Exception as err:  # yaml.YAMLError, without importing yaml for the other formats
            raise SettingsError(f"{source}: not valid YAML: {err}") from err
    else:
        try:
            value = json.loads(extra_config) if extra_config.strip() else {}
        except json.JSONDecodeError as err:
            raise SettingsError(f"{source}: not valid JSON: {err}") from err
    if value is None:  # an empty YAML file
        return {}
    if not isinstance(value, dict):
        raise SettingsError(f"{source}: must be a JSON object / TOML table")
    return value
