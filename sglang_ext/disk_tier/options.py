"""The disk tier's settings: our keys of `--hicache-storage-backend-extra-config`, and the
extra config that loads the backend through SGLang's dynamic factory."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from sglang_hicache_ext.tuning.ttl.online_config import OnlineTtlConfig

BACKEND_NAME = "hicache_ext_disk"
# What SGLang's dynamic factory imports: `storage_backend.GroupTTLDiskStorage`.
MODULE_PATH = "sglang_hicache_ext.sglang_ext.disk_tier.storage_backend"
CLASS_NAME = "GroupTTLDiskStorage"
# Keys of the extra config that SGLang itself reads (or that carry our settings file).
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


@dataclass(frozen=True)
class DiskTierOptions:
    """Our keys of `--hicache-storage-backend-extra-config` (bytes and seconds)."""

    disk_dir: str = "/tmp/sglang-hicache-ext-disk"
    capacity_bytes: float = 16 * 2**30
    disk_budget_bytes: float | None = None  # average bytes the TTLs may cost; default capacity/2
    ttl_policy: str = "group"
    ttl_period_s: float = 300.0
    ttl_window_s: float = 3600.0
    ttl_groups: int = 8
    max_ttl_s: float = 86_400.0
    initial_ttl_s: float = 600.0
    pace_first_period: bool = True  # until the first plan: TTL paced from budget and write rate
    static_ttls: dict[str, float] | None = None  # group -> TTL for ttl_policy = "static"
    purge_interval_s: float = 5.0
    ttl_history_save_s: float | None = None  # how often the access history is saved; default
    # min(planning period, 60 s), and always on close

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> DiskTierOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known - SGLANG_KEYS)
        if unknown:
            raise ValueError(
                f"{BACKEND_NAME}: unknown option(s) {', '.join(unknown)}; "
                f"allowed: {', '.join(sorted(known))}"
            )
        if not extra.get("interface_v1"):
            raise ValueError(f'{BACKEND_NAME} needs "interface_v1": 1 (zero-copy page I/O)')
        options = cls(**{k: v for k, v in extra.items() if k in known})
        if not (math.isfinite(options.capacity_bytes) and options.capacity_bytes > 0):
            raise ValueError(f"{BACKEND_NAME}: capacity_bytes must be > 0")
        if not options.purge_interval_s > 0:
            raise ValueError(f"{BACKEND_NAME}: purge_interval_s must be > 0")
        save_s = options.ttl_history_save_s
        if save_s is not None and not (math.isfinite(save_s) and save_s > 0):
            raise ValueError(f"{BACKEND_NAME}: ttl_history_save_s must be > 0")
        options.ttl_config()  # validates the TTL options
        return options

    def ttl_config(self) -> OnlineTtlConfig:
        budget = (
            self.capacity_bytes / 2 if self.disk_budget_bytes is None else self.disk_budget_bytes
        )
        return OnlineTtlConfig(
            policy=self.ttl_policy,
            disk_budget_bytes=float(budget),
            capacity_bytes=float(self.capacity_bytes),
            period_s=float(self.ttl_period_s),
            window_s=float(self.ttl_window_s),
            top_k=int(self.ttl_groups),
            max_ttl_s=float(self.max_ttl_s),
            initial_ttl_s=float(self.initial_ttl_s),
            pace_first_period=bool(self.pace_first_period),
            static_ttls=tuple(sorted((self.static_ttls or {}).items())),
        )

    @property
    def history_save_s(self) -> float:
        # SGLang stops schedulers by signal, without close(): a stop loses what is not saved.
        if self.ttl_history_save_s is None:
            return float(min(self.ttl_period_s, _DEFAULT_HISTORY_SAVE_S))
        return float(self.ttl_history_save_s)


def disk_tier_extra_config(disk_dir: str | Path, **options: Any) -> dict[str, Any]:
    """`--hicache-storage-backend-extra-config` (as a dict, to pass as JSON) that loads this
    backend through SGLang's dynamic factory, with our `DiskTierOptions` as keyword options."""
    return {
        "backend_name": BACKEND_NAME,
        "module_path": MODULE_PATH,
        "class_name": CLASS_NAME,
        "interface_v1": 1,
        "disk_dir": str(disk_dir),
        **options,
    }
