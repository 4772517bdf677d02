"""Disk tier with subtree-grouped TTLs (Kareto) as a SGLang HiCache storage backend.

Loaded by SGLang's dynamic backend factory::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
        "backend_name": "hicache_ext_disk", "module_path": "sglang_hicache_ext.sglang_ext.disk_tier.storage_backend",
        "class_name": "KaretoDiskStorage", "interface_v1": 1,
        "disk_dir": "/var/cache/sglang-disk", "capacity_bytes": 64e9,
        "disk_budget_bytes": 32e9, "ttl_policy": "group"}'

Pages go to `sglang_hicache_ext.tiers.disk_store.DiskStore` (crash-safe files, hard byte capacity, TTL expiry) with
the group and TTL that our cache controller (`sglang_hicache_ext.sglang_ext.disk_tier.controller`) passes with every
write. `sglang_hicache_ext.tuning.ttl.online.OnlineTtl` owns the access log and re-plans TTLs every period.

Faults never reach SGLang's threads: every entry point the controller calls turns an unexpected
exception into a miss / False, logged and counted (`status()["errors"]["exceptions"]`).

Ownership: a server claims `disk_dir` at launch (`hold_disk_dir`, from the preflight check, in
the launching process, for its lifetime); each scheduler's store claims its shard folder
`disk_dir/<model>-tp<r>of<n>` (`DiskStore`). The TTL access history is saved in the shard
folder every `ttl_history_save_s` and on close, and reloaded at start.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang_hicache_ext.radix.groups import RESIDUAL_GROUP
from sglang_hicache_ext.tiers.dir_lock import DirectoryLock
from sglang_hicache_ext.tiers.disk_store import DiskStore
from sglang_hicache_ext.tuning.ttl.history_file import (
    HistoryFileError,
    load_history,
    save_history,
    stray_temp_files,
)
from sglang_hicache_ext.tuning.ttl.online import OnlineTtl, OnlineTtlConfig, RestoredHistory

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
_DEFAULT_HISTORY_SAVE_S = 60.0
SERVER_LOCK_NAME = "server.lock"  # in disk_dir: one server per disk_dir
HISTORY_FILE_NAME = "ttl-history.bin"  # in the shard folder, beside the store's `pages/`


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
    ttl_history_save_s: float | None = None  # how often the access history is saved; default
    # min(planning period, 60 s), and always on close

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
            period_s=float(self.ttl_period_s),
            window_s=float(self.ttl_window_s),
            top_k=int(self.ttl_groups),
            max_ttl_s=float(self.max_ttl_s),
            initial_ttl_s=float(self.initial_ttl_s),
            static_ttls=tuple(sorted((self.static_ttls or {}).items())),
        )

    @property
    def history_save_s(self) -> float:
        # SGLang stops schedulers by signal, without close(): a stop loses what is not saved.
        if self.ttl_history_save_s is None:
            return float(min(self.ttl_period_s, _DEFAULT_HISTORY_SAVE_S))
        return float(self.ttl_history_save_s)


_server_locks: dict[Path, DirectoryLock] = {}
_server_locks_mutex = threading.Lock()


def hold_disk_dir(disk_dir: str | Path) -> Path:
    """Claim `disk_dir` for the server this process launches, until the process exits.

    Called by the preflight check in the launching process, before SGLang starts its
    schedulers: a second server on the same folder must fail there, in one line, not in a
    scheduler's traceback. Re-entrant within a process (an `Engine` started again).
    Raises `sglang_hicache_ext.tiers.dir_lock.DirectoryLockedError` (holder's PID) or OSError.
    """
    path = Path(disk_dir).expanduser().absolute()
    with _server_locks_mutex:
        held = _server_locks.get(path)
        if held is not None and held.held:
            return path
        path.mkdir(parents=True, exist_ok=True)
        _server_locks[path] = DirectoryLock(path, SERVER_LOCK_NAME)
    return path


def release_disk_dir(disk_dir: str | Path) -> None:
    """Give up a claim of `hold_disk_dir` (tests, or an embedding application shutting down)."""
    with _server_locks_mutex:
        lock = _server_locks.pop(Path(disk_dir).expanduser().absolute(), None)
    if lock is not None:
        lock.release()


@dataclass(frozen=True)
class PageWriteInfo:
    """What the controller passes with a batch write: one group and TTL per page."""

    groups: tuple[str, ...]
    ttls_s: tuple[float, ...]


Method = TypeVar("Method", bound=Callable[..., Any])

# Entry points SGLang may call; each has its own count of unexpected exceptions.
_ENTRY_POINTS = (
    "batch_set_v1",
    "batch_get_v1",
    "batch_exists",
    "exists",
    "touch",
    "get",
    "batch_get",
    "set",
    "batch_set",
    "clear",
    "close",
)


def _never_raises(fallback: Callable[..., Any]) -> Callable[[Method], Method]:
    """An unexpected exception in the method is logged and counted, and `fallback(*args)` (a
    miss, False, 0) returned instead: nothing may raise into SGLang's controller threads."""

    def decorate(method: Method) -> Method:
        name = method.__name__

        @functools.wraps(method)
        def guarded(self: KaretoDiskStorage, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except Exception:
                self._count_exception(name)
                return fallback(*args, **kwargs)

        return guarded  # type: ignore[return-value]

    return decorate


def _length(keys: Any) -> int:
    try:
        return len(keys)
    except Exception:
        return 0


def _all_false(keys: Any, *args: Any, **kwargs: Any) -> list[bool]:
    return [False] * _length(keys)


def _all_none(keys: Any, *args: Any, **kwargs: Any) -> list[None]:
    return [None] * _length(keys)


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _false(*args: Any, **kwargs: Any) -> bool:
    return False


def _none(*args: Any, **kwargs: Any) -> None:
    return None


class KaretoDiskStorage(HiCacheStorage):
    """HiCache L3 on local disk; groups and TTLs per page; zero-copy `interface_v1` only."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.options = DiskTierOptions.from_extra_config(dict(storage_config.extra_config or {}))
        model = (storage_config.model_name or "model").replace("/", "-")
        shard = f"{model}-tp{storage_config.tp_rank}of{storage_config.tp_size}"
        if storage_config.pp_size > 1:
            shard += f"-pp{storage_config.pp_rank}of{storage_config.pp_size}"
        self._lock = threading.Lock()
        self._counts: dict[str, Any] = {
            "writes_without_groups": 0,
            "page_size_mismatch": 0,
            "read_failures": 0,  # a page batch_exists reported could not be read
            "purge_errors": 0,
            "history_load_errors": 0,
            "history_save_errors": 0,
            "exceptions": dict.fromkeys(_ENTRY_POINTS, 0),
        }
        shard_dir = Path(self.options.disk_dir) / shard
        self.history_path = shard_dir / HISTORY_FILE_NAME
        self.online = OnlineTtl(self.options.ttl_config())
        # Before the store opens: its index computes expiries from the restored TTLs. Reading
        # without the folder's lock is safe (saves are atomic renames); nothing is written.
        self._history_load_error: str | None = None
        self.restored = self._restore_history()
        self.store = DiskStore(shard_dir, int(self.options.capacity_bytes), self.online.policy)
        self._remove_stray_history_temps()
        self._history_mutex = threading.Lock()  # the maintenance thread and close() both save
        self._saved_changes = self.online.changes  # what is on disk already (restored)
        self._last_save_try = time.monotonic()
        self._saved: dict[str, Any] = {
            "requests": self.restored.requests,
            "page_accesses": self.restored.page_accesses,
            "bytes": None,
            "at_s": None,
        }
        self._closed = False
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
            self.options.capacity_bytes / 1e9,
            self.options.ttl_policy,
            self.store.stats().entries,
            self.restored.page_accesses,
            " (with the last plan's TTLs)" if self.restored.plan_restored else "",
        )

    # -- zero-copy page I/O (what the controller calls) ------------------------------------

    @_never_raises(_all_false)
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
            try:  # per page: the pages stored before a failure stay reported as stored
                page = self.mem_pool_host.get_data_page(int(host_indices[i * page_size]), flat=True)
                payload = page.contiguous().view(torch.uint8).numpy().tobytes()
                self.online.set_page_bytes(len(payload))
                results.append(self.store.put(key, payload, info.groups[i], info.ttls_s[i]))
            except Exception:
                self._count_exception("batch_set_v1")
                results.append(False)
        return results

    @_never_raises(_all_false)
    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        page_size = self.mem_pool_host.page_size
        results = [False] * len(keys)
        hit_groups = []
        for i, key in enumerate(keys):
            try:
                loaded = self._read_into(key, int(host_indices[i * page_size]))
            except Exception:
                self._count_exception("batch_get_v1")
                loaded = False
            if not loaded:
                break  # the controller uses the leading run of successes only
            results[i] = True
            page = self.store.info(key)
            hit_groups.append(page.group if page is not None else RESIDUAL_GROUP)
        self.online.record_disk_hits(hit_groups)
        return results

    @_never_raises(_zero)
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        for i, key in enumerate(keys):
            if not self.store.contains(key):
                return i
        return len(keys)

    @_never_raises(_false)
    def exists(self, key: str) -> bool:
        return self.store.contains(key)

    @_never_raises(_zero)
    def touch(self, keys: list[str], groups: list[str] | None = None) -> int:
        """Refresh the TTLs (and current groups) of stored pages a request just accessed."""
        return self.store.touch(keys, groups)

    # -- copying API of HiCacheStorage (abstract there; the controller uses interface_v1) ---

    @_never_raises(_none)
    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        payload = self.store.get(key)
        if payload is None or target_location is None:
            return None
        return _fill(target_location, payload)

    @_never_raises(_all_none)
    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        targets = target_locations or [None] * len(keys)
        return [self.get(key, target) for key, target in zip(keys, targets, strict=True)]

    @_never_raises(_false)
    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        if value is None:
            return False
        payload = value.contiguous().view(torch.uint8).numpy().tobytes()
        return self.store.put(key, payload, RESIDUAL_GROUP)

    @_never_raises(_false)
    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return all(self.set(key, value) for key, value in zip(keys, values or [], strict=True))

    @_never_raises(_none)
    def clear(self) -> None:
        for page in self.store.infos():
            self.store.delete(page.key)

    @_never_raises(_none)
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
        self._save_history()
        self.store.close()

    # -- reporting -------------------------------------------------------------------------

    def status(self, pages: int = 0) -> dict[str, Any]:
        """Disk usage, expiries and hit ratios per tier and group, current TTLs."""
        stats = self.store.stats()
        with self._lock:
            counts = {**self._counts, "exceptions": dict(self._counts["exceptions"])}
            saved = dict(self._saved)
        report: dict[str, Any] = {
            "backend": BACKEND_NAME,
            "root": str(self.store.root),
            "disk": stats.__dict__,
            "by_group": self.store.group_usage(),
            "ttl": self.online.status(),
            "ttl_history": {
                "file": str(self.history_path),
                "save_interval_s": self.options.history_save_s,
                "reloaded_requests": self.restored.requests,
                "reloaded_page_accesses": self.restored.page_accesses,
                "reloaded_plan": self.restored.plan_restored,
                "load_error": self._history_load_error,
                "saved_requests": saved["requests"],
                "saved_page_accesses": saved["page_accesses"],
                "saved_bytes": saved["bytes"],
                "saved_at_s": saved["at_s"],
            },
            "errors": counts,
        }
        if pages:
            report["pages"] = [p.__dict__ for p in self.store.infos()[:pages]]
        return report

    # -- internals -------------------------------------------------------------------------

    def _read_into(self, key: str, host_index: int) -> bool:
        payload = self.store.get(key)
        if payload is None:
            self._count("read_failures")
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

    def _count_exception(self, entry_point: str) -> None:
        with self._lock:
            self._counts["exceptions"][entry_point] += 1
            first = self._counts["exceptions"][entry_point] == 1
        if first:  # the traceback once; then one line each, not a flood of them
            logger.exception("%s.%s failed; answered as a miss", BACKEND_NAME, entry_point)
        else:
            logger.error("%s.%s failed again; answered as a miss", BACKEND_NAME, entry_point)

    def _restore_history(self) -> RestoredHistory:
        """The TTL history of the last run, if its file is usable; else start from empty."""
        try:
            history = load_history(self.history_path)
            if history is None:
                return RestoredHistory(0, 0, False)
            return self.online.restore(history)
        except (OSError, HistoryFileError, ValueError) as error:
            self._counts["history_load_errors"] += 1
            self._history_load_error = f"{type(error).__name__}: {error}"
            logger.error(
                "%s: TTL history %s ignored (starting from empty): %s",
                BACKEND_NAME,
                self.history_path,
                error,
            )
            return RestoredHistory(0, 0, False)

    def _remove_stray_history_temps(self) -> None:
        """Interrupted saves of the last run (only now: we own the folder)."""
        for temp in stray_temp_files(self.history_path):
            try:
                temp.unlink(missing_ok=True)
            except OSError as error:
                self._counts["history_save_errors"] += 1
                logger.error("%s: cannot remove %s: %s", BACKEND_NAME, temp, error)

    def _save_history(self) -> bool:
        """Save the TTL history if it changed since the last save; False when that failed."""
        with self._history_mutex:
            self._last_save_try = time.monotonic()
            changes = self.online.changes
            if changes == self._saved_changes:
                return True
            try:
                history = self.online.history()
                size = save_history(self.history_path, history)
            except Exception as error:  # disk full, folder gone, ...: retried next interval
                self._count("history_save_errors")
                logger.error("%s: saving the TTL history failed: %s", BACKEND_NAME, error)
                return False
            self._saved_changes = changes
            with self._lock:
                self._saved = {
                    "requests": len(history.requests),
                    "page_accesses": history.page_accesses,
                    "bytes": size,
                    "at_s": history.saved_at_s,
                }
            return True

    def _maintenance_loop(self) -> None:
        """Purge expired pages every `purge_interval_s`; save the TTL history when due."""
        while not self._stop.wait(self.options.purge_interval_s):
            try:
                self.store.purge_expired()
            except Exception:
                self._count("purge_errors")
                logger.exception("%s: purging expired pages failed", BACKEND_NAME)
            if time.monotonic() - self._last_save_try >= self.options.history_save_s:
                self._save_history()


def disk_tier_extra_config(disk_dir: str | Path, **options: Any) -> dict[str, Any]:
    """`--hicache-storage-backend-extra-config` (as a dict, to pass as JSON) that loads this
    backend through SGLang's dynamic factory, with our `DiskTierOptions` as keyword options."""
    return {
        "backend_name": BACKEND_NAME,
        "module_path": MODULE_PATH,
        "class_name": KaretoDiskStorage.__name__,
        "interface_v1": 1,
        "disk_dir": str(disk_dir),
        **options,
    }


def _write_info(extra_info: Any) -> PageWriteInfo | None:
    extra = getattr(extra_info, "extra_info", None) or {}
    info = extra.get(WRITE_INFO_KEY)
    return info if isinstance(info, PageWriteInfo) else None


def _fill(target: torch.Tensor, payload: bytes) -> torch.Tensor:
    flat = target.view(-1).view(torch.uint8)
    flat.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    return target
