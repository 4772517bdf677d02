"""Disk tier with subtree-grouped TTLs as a SGLang HiCache storage backend.

Loaded by SGLang's dynamic backend factory::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
        "backend_name": "hicache_ext_disk",
        "module_path": "sglang_hicache_ext.sglang_ext.disk_tier.storage_backend",
        "class_name": "GroupTTLDiskStorage", "interface_v1": 1,
        "disk_dir": "/var/cache/sglang-disk", "capacity_bytes": 64e9,
        "disk_budget_bytes": 32e9, "ttl_policy": "group"}'

The keys beside SGLang's are the settings' `disk_tier` part (`DiskTierSettings` in
`sglang_ext/config/disk_tier_settings.py`, whose `disk_tier_extra_config` builds that config).
Pages go to `sglang_hicache_ext.tiers.pages.page_store.PageStore` (crash-safe files, hard byte
capacity, TTL expiry) with the group and TTL that our cache controller (`controller`) passes
with every write (`write_info`).
`sglang_hicache_ext.tuning.ttl.online.OnlineTtl` owns the access log and re-plans TTLs every
period.

Faults never reach SGLang's threads (`fault_guard`): every entry point the controller calls
turns an unexpected exception into a miss / False, logged and counted
(`status()["errors"]["exceptions"]`).

Ownership: a server claims `disk_dir` at launch (`dir_claim.hold_disk_dir`, from the preflight
check, in the launching process, for its lifetime); each scheduler's store claims its shard
folder `disk_dir/<model>-tp<r>of<n>` (`PageStore`). The TTL access history (`history`) is saved
in the shard folder every `ttl_history_save_s` and on close, and reloaded at start.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from sglang_hicache_ext.radix.groups import RESIDUAL_GROUP
from sglang_hicache_ext.sglang_ext.config.disk_tier_settings import (
    BACKEND_NAME,
    CLASS_NAME,
    MODULE_PATH,
    DiskTierSettings,
    disk_tier_extra_config,
)
from sglang_hicache_ext.sglang_ext.disk_tier.dir_claim import (
    SERVER_LOCK_NAME,
    hold_disk_dir,
    release_disk_dir,
)
from sglang_hicache_ext.sglang_ext.disk_tier.fault_guard import (
    EntryPointFaults,
    all_false,
    all_none,
    false,
    never_raises,
    none,
    zero,
)
from sglang_hicache_ext.sglang_ext.disk_tier.history import HISTORY_FILE_NAME, TtlHistoryFile
from sglang_hicache_ext.sglang_ext.disk_tier.metrics_export import DiskTierMetricsExport
from sglang_hicache_ext.sglang_ext.disk_tier.write_info import PageWriteInfo, passed_write_info
from sglang_hicache_ext.sglang_ext.metrics.prometheus_metrics import ExtensionMetrics
from sglang_hicache_ext.tiers.pages.page_store import PageStore
from sglang_hicache_ext.tuning.ttl.online import OnlineTtl

# What the preflight check, the launchers and older imports take from this module.
__all__ = [
    "BACKEND_NAME",
    "CLASS_NAME",
    "MODULE_PATH",
    "SERVER_LOCK_NAME",
    "DiskTierSettings",
    "GroupTTLDiskStorage",
    "disk_tier_extra_config",
    "hold_disk_dir",
    "release_disk_dir",
]

logger = logging.getLogger(__name__)


class GroupTTLDiskStorage(HiCacheStorage):
    """HiCache L3 on local disk; groups and TTLs per page; zero-copy `interface_v1` only."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.settings = DiskTierSettings.from_extra_config(storage_config.extra_config or {})
        model = (storage_config.model_name or "model").replace("/", "-")
        shard = f"{model}-tp{storage_config.tp_rank}of{storage_config.tp_size}"
        if storage_config.pp_size > 1:
            shard += f"-pp{storage_config.pp_rank}of{storage_config.pp_size}"
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {
            "writes_without_groups": 0,
            "page_size_mismatch": 0,
            "read_failures": 0,  # a page batch_exists reported could not be read
            "purge_errors": 0,
        }
        self.faults = EntryPointFaults(BACKEND_NAME)
        shard_dir = Path(self.settings.disk_dir) / shard
        self.online = OnlineTtl(self.settings.ttl_config())
        self.history = TtlHistoryFile(shard_dir / HISTORY_FILE_NAME, self.online, BACKEND_NAME)
        # Before the store opens: its index computes expiries from the restored TTLs.
        self.restored = self.history.restore()
        self.store = PageStore(shard_dir, int(self.settings.capacity_bytes), self.online.policy)
        self.history.remove_stray_temps()  # only now: we own the folder
        self._closed = False
        self.metrics_export = DiskTierMetricsExport()
        # SGLang constructs this backend; the assembly hands it the scheduler's series when it
        # installs the tier (`controller.install`). None until then, and with metrics off.
        self.metrics: ExtensionMetrics | None = None
        self._stop = threading.Event()
        self._maintenance = threading.Thread(
            target=self._maintenance_loop, name="hicache-ext-disk-maintenance", daemon=True
        )
        self._maintenance.start()
        self.online.start()
        logger.info(
            "%s: %s, capacity %.3g GB, TTL policy %s, %d pages found, %d page accesses of TTL"
            " history reloaded%s",
            BACKEND_NAME,
            self.store.root,
            self.settings.capacity_bytes / 1e9,
            self.settings.ttl_policy,
            self.store.stats().entries,
            self.restored.page_accesses,
            " (with the last plan's TTLs)" if self.restored.plan_restored else "",
        )

    # -- zero-copy page I/O (what the controller calls) ------------------------------------

    @never_raises(all_false)
    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        info = passed_write_info(extra_info)
        if info is None or len(info.groups) != len(keys):
            # A stock controller (or one without our subclass) gives no groups: derive them.
            self._count("writes_without_groups")
            info = PageWriteInfo.of_pages(self.online, keys, extra_info)
        page_size = self.mem_pool_host.page_size
        metrics = self.metrics
        results = []
        for i, key in enumerate(keys):
            try:  # per page: the pages stored before a failure stay reported as stored
                page = self.mem_pool_host.get_data_page(int(host_indices[i * page_size]), flat=True)
                payload = page.contiguous().view(torch.uint8).numpy().tobytes()
                self.online.set_page_bytes(len(payload))
                stored = self.store.put(key, payload, info.groups[i], info.ttls_s[i])
                if stored and metrics is not None:
                    metrics.disk_written(info.groups[i], len(payload))
                results.append(stored)
            except Exception:
                self.faults.record("batch_set_v1")
                results.append(False)
        return results

    @never_raises(all_false)
    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        page_size = self.mem_pool_host.page_size
        results = [False] * len(keys)
        hit_groups, hit_bytes = [], []
        for i, key in enumerate(keys):
            try:
                loaded = self._read_into(key, int(host_indices[i * page_size]))
            except Exception:
                self.faults.record("batch_get_v1")
                loaded = 0
            if not loaded:
                break  # the controller uses the leading run of successes only
            results[i] = True
            page = self.store.info(key)
            hit_groups.append(page.group if page is not None else RESIDUAL_GROUP)
            hit_bytes.append(loaded)
        self.online.record_disk_hits(hit_groups)
        if (metrics := self.metrics) is not None:
            for group, nbytes in zip(hit_groups, hit_bytes, strict=True):
                metrics.disk_read(group, nbytes)
        return results

    @never_raises(zero)
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        for i, key in enumerate(keys):
            if not self.store.contains(key):
                return i
        return len(keys)

    @never_raises(false)
    def exists(self, key: str) -> bool:
        return self.store.contains(key)

    @never_raises(zero)
    def touch(self, keys: list[str], groups: list[str] | None = None) -> int:
        """Refresh the TTLs (and current groups) of stored pages a request just accessed."""
        return self.store.touch(keys, groups)

    # -- copying API of HiCacheStorage (abstract there; the controller uses interface_v1) ---

    @never_raises(none)
    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        payload = self.store.get(key)
        if payload is None or target_location is None:
            return None
        return _fill(target_location, payload)

    @never_raises(all_none)
    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        targets = target_locations or [None] * len(keys)
        return [self.get(key, target) for key, target in zip(keys, targets, strict=True)]

    @never_raises(false)
    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        if value is None:
            return False
        payload = value.contiguous().view(torch.uint8).numpy().tobytes()
        return self.store.put(key, payload, RESIDUAL_GROUP)

    @never_raises(false)
    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return all(self.set(key, value) for key, value in zip(keys, values or [], strict=True))

    @never_raises(none)
    def clear(self) -> None:
        for page in self.store.infos():
            self.store.delete(page.key)

    @never_raises(none)
    def close(self) -> None:
        """Stop the threads, save the TTL history, give the shard folder up (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._maintenance is not threading.current_thread():
            self._maintenance.join(timeout=30)
        self.online.stop()
        self.history.save()
        self.store.close()

    # -- reporting -------------------------------------------------------------------------

    def status(self, pages: int = 0) -> dict[str, Any]:
        """Disk usage, expiries and hit ratios per tier and group, current TTLs."""
        stats = self.store.stats()
        report: dict[str, Any] = {
            "backend": BACKEND_NAME,
            "root": str(self.store.root),
            "disk": stats.__dict__,
            "by_group": self.store.group_usage(),
            "ttl": self.online.status(),
            "ttl_history": self.history.status(self.settings.history_save_s),
            "errors": self.error_counts(),
        }
        if pages:
            report["pages"] = [p.__dict__ for p in self.store.infos()[:pages]]
        return report

    def error_counts(self) -> dict[str, Any]:
        """Faults answered as misses, by kind; entry-point exceptions under `exceptions`."""
        with self._lock:
            counts: dict[str, Any] = dict(self._counts)
        counts.update(self.history.error_counts(), exceptions=self.faults.counts())
        return counts

    # -- internals -------------------------------------------------------------------------

    def _read_into(self, key: str, host_index: int) -> int:
        """Bytes loaded into the host pool page (0: not loaded)."""
        payload = self.store.get(key)
        if payload is None:
            self._count("read_failures")
            return 0
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
            return 0
        self.mem_pool_host.set_from_flat_data_page(host_index, _fill(target, payload))
        return len(payload)

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _maintenance_loop(self) -> None:
        """Purge expired pages every `purge_interval_s`; save the TTL history when due."""
        while not self._stop.wait(self.settings.purge_interval_s):
            try:
                self.store.purge_expired()
            except Exception:
                self._count("purge_errors")
                logger.exception("%s: purging expired pages failed", BACKEND_NAME)
            if self.history.save_due(self.settings.history_save_s):
                self.history.save()
            self.metrics_export.export(self, self.metrics)


if (__name__, GroupTTLDiskStorage.__name__) != (MODULE_PATH, CLASS_NAME):
    raise ImportError(f"disk_tier_settings.MODULE_PATH / CLASS_NAME do not name {__name__}")


def _fill(target: torch.Tensor, payload: bytes) -> torch.Tensor:
    flat = target.view(-1).view(torch.uint8)
    flat.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    return target
