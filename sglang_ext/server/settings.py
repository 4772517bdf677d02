"""Extension settings: one JSON or TOML file, validated strictly.

The file is named by the environment variable `SGLANG_HICACHE_EXT_CONFIG`, or by the key
`"hicache_ext_config"` inside SGLang's `--hicache-storage-backend-extra-config` (inline JSON, or
`@path` to a JSON/TOML/YAML file, read by `read_extra_config` exactly as SGLang reads it), which
may also hold the settings inline as an object). Unknown keys and bad values raise
`SettingsError` with the offending key and the allowed values, so the server stops with one
clear line instead of running with a typo silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

CONFIG_ENV_VAR = "SGLANG_HICACHE_EXT_CONFIG"
EXTRA_CONFIG_KEY = "hicache_ext_config"


class SettingsError(ValueError):
    """A settings file or value that the extension refuses to start with."""


@dataclasses.dataclass(frozen=True)
class ExtensionSettings:
    """What a user can set; every field has a sane default."""

    # Apply the CPU compatibility hooks (host-pool pinning, KV transfers, ...): "auto" applies
    # them when torch has no CUDA device.
    cpu_compat: Literal["auto", "on", "off"] = "auto"
    # Check model path, port and settings before SGLang starts its subprocesses.
    preflight_checks: bool = True
    # Tree core used by the hicache_ext radix cache. Our subclass overrides Python methods, so
    # only the Python core honours them.
    tree_core: Literal["python"] = "python"
    # Report extension state under `internal_states[i]["hicache_ext"]` of `/server_info`.
    report_in_server_info: bool = True
    # Host memory for precomputed chunk KV (registered with POST /chunks), LRU beyond it.
    chunk_store_bytes: int = 2 * 1024**3
    # Server defaults of the per-request fusion options (custom_params fusion, fusion_selector,
    # fusion_recompute_ratio, fusion_sink_tokens).
    fusion_by_default: bool = False
    fusion_selector: str = "a3"
    fusion_recompute_ratio: float = 0.15
    # First tokens of each chunk put first in the recompute budget (0 = the papers' selectors).
    fusion_sink_tokens: int = 0
    # Bounds of POST /chunks, checked before any tokenization: the request body in bytes, the
    # chunk in tokens (also never more than the model's context length), and the requests per
    # minute and client host (0 = unlimited).
    chunk_max_body_bytes: int = 4 * 1024**2
    chunk_max_tokens: int = 32768
    chunk_registrations_per_minute: int = 120

    def __post_init__(self) -> None:
        from sglang_hicache_ext.fusion.selectors import SELECTORS

        if self.chunk_store_bytes <= 0:
            raise SettingsError(f"chunk_store_bytes = {self.chunk_store_bytes} must be positive")
        if self.fusion_selector not in SELECTORS:
            raise SettingsError(
                f"fusion_selector = {self.fusion_selector!r} is unknown; choose from {sorted(SELECTORS)}"
            )
        if not 0.0 <= self.fusion_recompute_ratio <= 1.0:
            raise SettingsError(
                f"fusion_recompute_ratio = {self.fusion_recompute_ratio} must be in [0, 1]"
            )
        if self.fusion_sink_tokens < 0:
            raise SettingsError(f"fusion_sink_tokens = {self.fusion_sink_tokens} must be >= 0")
        for name in ("chunk_max_body_bytes", "chunk_max_tokens"):
            if getattr(self, name) <= 0:
                raise SettingsError(f"{name} = {getattr(self, name)} must be positive")
        if self.chunk_registrations_per_minute < 0:
            raise SettingsError(
                f"chunk_registrations_per_minute = {self.chunk_registrations_per_minute} "
                "must be >= 0 (0 = unlimited)"
            )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str) -> ExtensionSettings:
        hints = get_type_hints(cls)
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise SettingsError(
                f"{source}: unknown setting(s) {', '.join(map(repr, unknown))}; "
                f"known settings: {', '.join(known)}"
            )
        for name, value in values.items():
            _check_value(name, value, hints[name], source)
        try:
            return cls(**dict(values))
        except SettingsError as err:
            raise SettingsError(f"{source}: {err}") from None


def _check_value(name: str, value: Any, annotation: Any, source: str) -> None:
    if get_origin(annotation) is Literal:
        allowed = get_args(annotation)
        if value not in allowed:
            raise SettingsError(
                f"{source}: {name} = {value!r} is not allowed; choose one of "
                f"{', '.join(map(repr, allowed))}"
            )
        return
    if annotation is bool:
        ok = isinstance(value, bool)
    elif annotation is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif annotation is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, annotation)
    if not ok:
        raise SettingsError(
            f"{source}: {name} = {value!r} should be of type {getattr(annotation, '__name__', annotation)}"
        )


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

    Naming a file in both places is refused: two sources of truth would drift apart.
    """
    from_extra = settings_from_extra_config(extra_config)
    env_path = os.environ.get(CONFIG_ENV_VAR)
    if from_extra is not None and env_path:
        raise SettingsError(
            f"settings are given both by {CONFIG_ENV_VAR} and by extra-config "
            f"{EXTRA_CONFIG_KEY}; keep one"
        )
    if from_extra is not None:
        return from_extra
    if env_path:
        return read_settings_file(env_path)
    return ExtensionSettings()
