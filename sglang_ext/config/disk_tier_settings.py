"""The TTL disk tier's settings: the `disk_tier` part of the one settings model (`settings.py`).

They are the keys of SGLang's `--hicache-storage-backend-extra-config` beside SGLang's own when
that config loads our HiCache storage backend (`disk_tier/storage_backend.py`) through SGLang's
dynamic factory, which hands the backend that config and nothing else. Every key is written
once here, with its type, default, bounds and description; a bad value is the same one-line
`SettingsError` as any other setting's. `disk_tier_extra_config` builds such a config.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from sglang_hicache_ext.sglang_ext.config.extra_config import SettingsError
from sglang_hicache_ext.sglang_ext.config.validation_messages import one_line
from sglang_hicache_ext.tuning.ttl.online_config import OnlineTtlConfig, OnlineTtlPolicy

BACKEND_NAME = "hicache_ext_disk"
# What SGLang's dynamic factory imports: `storage_backend.GroupTTLDiskStorage`.
MODULE_PATH = "sglang_hicache_ext.sglang_ext.disk_tier.storage_backend"
CLASS_NAME = "GroupTTLDiskStorage"
# Keys of the extra config that SGLang itself reads (or that carry the settings file).
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "hicache_ext_config",
        "file_storage_path",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
    }
)
_DEFAULT_HISTORY_SAVE_S = 60.0


def _finite_ttls(ttls: dict[str, float]) -> dict[str, float]:
    if not all(math.isfinite(ttl) and ttl >= 0 for ttl in ttls.values()):
        raise ValueError("must map each group to a finite TTL >= 0 (seconds)")
    return ttls


# Group name -> TTL in seconds (tiers/pages/ttl_policy.py `TtlTable` refuses the same values).
StaticTtls = Annotated[dict[str, float], AfterValidator(_finite_ttls)]


class DiskTierSettings(BaseModel):
    """The disk tier's settings: keys at the top level of `--hicache-storage-backend-extra-config`,
    beside SGLang's own (`backend_name`, `module_path`, `class_name`, `interface_v1`, ...), when
    that config loads `hicache_ext_disk` (bytes and seconds)."""

    # As ExtensionSettings: strict (JSON `1` is not `true`), unknown keys refused.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    disk_dir: str = Field(
        "/tmp/sglang-hicache-ext-disk",
        min_length=1,
        description="Root folder of the disk tier, one server per folder (claimed at launch); "
        "each model and TP rank keeps its pages in a folder of its own inside it.",
    )
    capacity_bytes: float = Field(
        16 * 2**30,
        gt=0,
        allow_inf_nan=False,
        description="Hard cap on the bytes of page files; beyond it the soonest expiry is "
        "evicted first.",
    )
    disk_budget_bytes: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="Average bytes on disk the TTLs may cost (Kareto's budget). "
        "Null: half of capacity_bytes.",
    )
    ttl_policy: OnlineTtlPolicy = Field(
        "group",
        description="How TTLs are chosen: group (group TTLs while their shadow disk out-earns "
        "one TTL's, else one TTL), group-always (group TTLs every period), fixed (one TTL, "
        "same budget) or static (initial_ttl_s and static_ttls).",
    )
    ttl_period_s: float = Field(
        300.0, gt=0, allow_inf_nan=False, description="Seconds between TTL re-plans."
    )
    ttl_window_s: float = Field(
        3600.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds of past accesses each re-plan is computed from.",
    )
    ttl_groups: int = Field(
        8, ge=0, description="K: the top subtrees by recent reuse that get their own TTL."
    )
    max_ttl_s: float = Field(
        86_400.0, ge=0, allow_inf_nan=False, description="Largest TTL a plan gives."
    )
    initial_ttl_s: float = Field(
        600.0,
        ge=0,
        allow_inf_nan=False,
        description="TTL before the first page is written, and the TTL of ttl_policy static "
        "for groups static_ttls does not name.",
    )
    pace_first_period: bool = Field(
        True,
        description="Until the first plan, pace the TTL from the budget and the page write "
        "rate seen so far (Little's law); false: initial_ttl_s until the first plan.",
    )
    static_ttls: StaticTtls | None = Field(
        None, description="Group -> TTL in seconds for ttl_policy static."
    )
    purge_interval_s: float = Field(
        5.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds between removals of expired pages (the tier's counts reach "
        "/metrics at the same pace).",
    )
    ttl_history_save_s: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Seconds between saves of the TTL access history (when it changed; always "
        "on close). Null: min(ttl_period_s, 60).",
    )

    def __init__(self, **values: Any) -> None:
        # Built in code or from the extra config, a bad value is the one-line SettingsError.
        try:
            super().__init__(**values)
        except ValidationError as err:
            raise SettingsError(one_line(err, DiskTierSettings)) from None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> DiskTierSettings:
        """Our keys of an extra config that loads this backend (SGLang's own are SGLang's)."""
        if not extra.get("interface_v1"):
            raise SettingsError(f'{BACKEND_NAME} needs "interface_v1": 1 (zero-copy page I/O)')
        try:
            return cls(
                **{str(key): value for key, value in extra.items() if key not in SGLANG_KEYS}
            )
        except SettingsError as err:
            raise SettingsError(f"{BACKEND_NAME}: {err}") from None

    def ttl_config(self) -> OnlineTtlConfig:
        budget = (
            self.capacity_bytes / 2 if self.disk_budget_bytes is None else self.disk_budget_bytes
        )
        return OnlineTtlConfig(
            policy=self.ttl_policy,
            disk_budget_bytes=float(budget),
            capacity_bytes=float(self.capacity_bytes),
            period_s=self.ttl_period_s,
            window_s=self.ttl_window_s,
            top_k=self.ttl_groups,
            max_ttl_s=self.max_ttl_s,
            initial_ttl_s=self.initial_ttl_s,
            pace_first_period=self.pace_first_period,
            static_ttls=tuple(sorted((self.static_ttls or {}).items())),
        )

    @property
    def history_save_s(self) -> float:
        # SGLang stops schedulers by signal, without close(): a stop loses what is not saved.
        if self.ttl_history_save_s is None:
            return min(self.ttl_period_s, _DEFAULT_HISTORY_SAVE_S)
        return self.ttl_history_save_s


def loads_disk_tier(extra: Mapping[str, Any]) -> bool:
    """Whether an extra config (read by `read_extra_config`) names this backend's module."""
    return extra.get("module_path") == MODULE_PATH


def disk_tier_extra_config(disk_dir: str | Path, **settings: Any) -> dict[str, Any]:
    """`--hicache-storage-backend-extra-config` (as a dict, to pass as JSON) that loads this
    backend through SGLang's dynamic factory, with `DiskTierSettings` keys as keywords."""
    return {
        "backend_name": BACKEND_NAME,
        "module_path": MODULE_PATH,
        "class_name": CLASS_NAME,
        "interface_v1": 1,
        "disk_dir": str(disk_dir),
        **settings,
    }
