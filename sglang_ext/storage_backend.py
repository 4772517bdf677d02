"""Disk tier with subtree-grouped TTLs (Kareto) as a SGLang HiCache storage backend.

Loaded by SGLang's dynamic backend factory::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
        "backend_name": "hicache_ext_disk", "module_path": "sglang_ext.storage_backend",
        "class_name": "KaretoDiskStorage", "interface_v1": 1,
        "disk_dir": "/var/cache/sglang-disk", "capacity_bytes": 64e9,
        "disk_budget_bytes": 32e9, "ttl_policy": "group"}'

Pages go to `tiers.disk_store.DiskStore` (crash-safe files, hard byte capacity, TTL expiry) with
the group and TTL that our cache controller (`sglang_ext.ttl_controller`) passes with every
write. `tuning.ttl.online.OnlineTtl` owns the access log and re-plans TTLs every period.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from radix.groups import RESIDUAL_GROUP
from tiers.disk_store import DiskStore
from tuning.ttl.online import OnlineTtl, OnlineTtlConfig

logger = logging.getLogger(__name__)

BACKEND_NAME = "hicache_ext_disk"
# Where the controller puts the per-page groups and TTLs of a write (HiCacheStorageExtraInfo).
WRITE_INFO_KEY = "hicache_ext"
# Keys of the extra config that SGLang itself reads (or that carry our settings file).
_SGLANG_KEYS = frozenset(
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
MODULE_PATH = __name__


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
    static_ttls: dict[str, float] | None = None  # group -> TTL for ttl_policy = "static"
    purge_interval_s: float = 5.0

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> DiskTierOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known - _SGLANG_KEYS)
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
        options.ttl_config()  # validates the TTL options
        return options

    def ttl_config(self) -> OnlineTtlConfig:
        budget = (
            self.capacity_bytes / 2 if self.disk_budget_bytes is None else self.disk_budget_bytes
        )
        return OnlineTtlConfig(
            policy=self.ttl_policy,
            disk_budget_bytes=float(budget),
            period_s=float(self.ttl_period_s),
            window_s=float(self.ttl_window_s),
            top_k=int(self.ttl_groups),
            max_ttl_s=float(self.max_ttl_s),
            initial_ttl_s=float(self.initial_ttl_s),
            static_ttls=tuple(sorted((self.static_ttls or {}).items())),
        )


@dataclass(frozen=True)
class PageWriteInfo:
    """What the controller passes with a batch write: one group and TTL per page."""

    groups: tuple[str, ...]
    ttls_s: tuple[float, ...]


class KaretoDiskStorage(HiCacheStorage):
    """HiCache L3 on local disk; groups and TTLs per page; zero-copy `interface_v1` only."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.options = DiskTierOptions.from_extra_config(dict(storage_config.extra_config or {}))
        model = (storage_config.model_name or "model").replace("/", "-")
        shard = f"{model}-tp{storage_config.tp_rank}of{storage_config.tp_size}"
        if storage_config.pp_size > 1:
            shard += f"-pp{storage_config.pp_rank}of{storage_config.pp_size}"
        self.online = OnlineTtl(self.options.ttl_config())
        self.store = DiskStore(
            Path(self.options.disk_dir) / shard,
            int(self.options.capacity_bytes),
            self.online.policy,
        )
        self._lock = threading.Lock()
        self._counts = {"writes_without_groups": 0, "page_size_mismatch": 0, "read_failures": 0}
        self._stop = threading.Event()
        self._purger = threading.Thread(
            target=self._purge_loop, name="hicache-ext-purge", daemon=True
        )
        self._purger.start()
        self.online.start()
        logger.info(
            "%s: %s, capacity %.3g GB, TTL policy %s, %d pages found",
            BACKEND_NAME,
            self.store.root,
            self.options.capacity_bytes / 1e9,
            self.options.ttl_policy,
            self.store.stats().entries,
        )

    # -- zero-copy page I/O (what the controller calls) ------------------------------------

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        info = _write_info(extra_info)
        if info is None or len(info.groups) != len(keys):
            # A stock controller (or one without our subclass) gives no groups: derive them.
            self._count("writes_without_groups")
            prefix = list(getattr(extra_info, "prefix_keys", None) or [])
            groups = self.online.groups_of(prefix + list(keys))[len(prefix) :]
            info = PageWriteInfo(tuple(groups), tuple(self.online.ttl_of(g) for g in groups))
        page_size = self.mem_pool_host.page_size
        results = []
        for i, key in enumerate(keys):
            page = self.mem_pool_host.get_data_page(int(host_indices[i * page_size]), flat=True)
            payload = page.contiguous().view(torch.uint8).numpy().tobytes()
            self.online.set_page_bytes(len(payload))
            results.append(self.store.put(key, payload, info.groups[i], info.ttls_s[i]))
        return results

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        page_size = self.mem_pool_host.page_size
        results = [False] * len(keys)
        hit_groups = []
        for i, key in enumerate(keys):
            if not self._read_into(key, int(host_indices[i * page_size])):
                break  # the controller uses the leading run of successes only
            results[i] = True
            page = self.store.info(key)
            hit_groups.append(page.group if page is not None else RESIDUAL_GROUP)
        self.online.record_disk_hits(hit_groups)
        return results

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        for i, key in enumerate(keys):
            if not self.store.contains(key):
                return i
        return len(keys)

    def exists(self, key: str) -> bool:
        return self.store.contains(key)

    def touch(self, keys: list[str], groups: list[str] | None = None) -> int:
        """Refresh the TTLs (and current groups) of stored pages a request just accessed."""
        return self.store.touch(keys, groups)

    # -- copying API of HiCacheStorage (abstract there; the controller uses interface_v1) ---

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        payload = self.store.get(key)
        if payload is None or target_location is None:
            return None
        return _fill(target_location, payload)

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        targets = target_locations or [None] * len(keys)
        return [self.get(key, target) for key, target in zip(keys, targets, strict=True)]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        if value is None:
            return False
        payload = value.contiguous().view(torch.uint8).numpy().tobytes()
        return self.store.put(key, payload, RESIDUAL_GROUP)

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return all(self.set(key, value) for key, value in zip(keys, values or [], strict=True))

    def clear(self) -> None:
        for page in self.store.infos():
            self.store.delete(page.key)

    def close(self) -> None:
        self._stop.set()
        self.online.stop()

    # -- reporting -------------------------------------------------------------------------

    def status(self, pages: int = 0) -> dict[str, Any]:
        """Disk usage, expiries and hit ratios per tier and group, current TTLs."""
        stats = self.store.stats()
        with self._lock:
            counts = dict(self._counts)
        report: dict[str, Any] = {
            "backend": BACKEND_NAME,
            "root": str(self.store.root),
            "disk": stats.__dict__,
            "by_group": self.store.group_usage(),
            "ttl": self.online.status(),
            "errors": counts,
        }
        if pages:
            report["pages"] = [p.__dict__ for p in self.store.infos()[:pages]]
        return report

    # -- internals -------------------------------------------------------------------------

    def _read_into(self, key: str, host_index: int) -> bool:
        payload = self.store.get(key)
        if payload is None:
            return False
        target = self.mem_pool_host.get_dummy_flat_data_page()
        if target.numel() * target.element_size() != len(payload):
            # A page from another model or page size: never load it into the pool.
            self._count("page_size_mismatch")
            logger.error(
                "%s: page %s has %d bytes, the pool expects %d; dropped",
                BACKEND_NAME,
                key[:16],
                len(payload),
                target.numel() * target.element_size(),
            )
            self.store.delete(key)
            return False
        self.mem_pool_host.set_from_flat_data_page(host_index, _fill(target, payload))
        return True

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _purge_loop(self) -> None:
        while not self._stop.wait(self.options.purge_interval_s):
            try:
                self.store.purge_expired()
            except OSError:
                logger.exception("%s: purging expired pages failed", BACKEND_NAME)


def _write_info(extra_info: Any) -> PageWriteInfo | None:
    extra = getattr(extra_info, "extra_info", None) or {}
    info = extra.get(WRITE_INFO_KEY)
    return info if isinstance(info, PageWriteInfo) else None


def _fill(target: torch.Tensor, payload: bytes) -> torch.Tensor:
    flat = target.view(-1).view(torch.uint8)
    flat.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    return target
