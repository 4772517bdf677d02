"""Our subclass of SGLang's HiCache controller: every storage write carries groups and TTLs.

SGLang builds the controller inside the tree's constructor with no way to choose its class, so
`install()` re-classes the built instance (the subclass adds methods only, no state) when our
disk backend (`sglang_hicache_ext.sglang_ext.disk_tier.storage_backend`) is attached, and makes the tree pass prefix keys:
a page's group depends on its whole path from the sequence start.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_hicache_ext.sglang_ext.disk_tier.storage_backend import GroupTTLDiskStorage
from sglang_hicache_ext.sglang_ext.disk_tier.write_info import WRITE_INFO_KEY, PageWriteInfo
from sglang_hicache_ext.sglang_ext.metrics.prometheus_metrics import ExtensionMetrics

logger = logging.getLogger(__name__)

_classes: dict[type, type] = {}


def disk_backend(cache: Any) -> GroupTTLDiskStorage | None:
    """Our backend when it is the tree's storage tier."""
    controller = getattr(cache, "cache_controller", None)
    backend = getattr(controller, "storage_backend", None)
    return backend if isinstance(backend, GroupTTLDiskStorage) else None


def install(cache: Any, metrics: ExtensionMetrics | None) -> GroupTTLDiskStorage | None:
    """Switch `cache`'s controller to the TTL-passing subclass and hand the backend the
    scheduler's series; the backend, or None when HiCache's storage tier is not ours."""
    backend = disk_backend(cache)
    if backend is None:
        return None
    backend.metrics = metrics
    controller = cache.cache_controller
    controller.__class__ = controller_class(type(controller))
    # Bound at attach time to the base class's functions; rebind to ours.
    controller.page_set_func = controller._page_set_zero_copy
    cache.hicache_storage_pass_prefix_keys = True
    logger.info(
        "hicache_ext: %s passes groups and TTLs to %s",
        type(controller).__name__,
        backend.store.root,
    )
    return backend


def controller_class(base: type) -> type:
    """The TTL-passing subclass of `base` (SGLang's HybridCacheController or a subclass)."""
    if base.__name__.startswith("TtlPassing"):
        return base
    if base not in _classes:

        class TtlPassingController(base):
            """Passes the group and current TTL of every page it writes to storage."""

            def _page_set_zero_copy(
                self, hash_values: list[str], host_indices: Any, extra_info: Any = None
            ) -> bool:
                from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

                try:
                    online = self.storage_backend.online
                    info = PageWriteInfo.of_pages(online, hash_values, extra_info)
                    if extra_info is None:
                        extra_info = HiCacheStorageExtraInfo()
                    extra_info.extra_info = {
                        **(extra_info.extra_info or {}),
                        WRITE_INFO_KEY: info,
                    }
                except Exception:
                    # This runs in the controller's backup thread: write without our groups
                    # (the backend derives them, counted as writes_without_groups).
                    logger.exception("hicache_ext: grouping a storage write failed")
                return super()._page_set_zero_copy(hash_values, host_indices, extra_info)

            def refresh_ttls(self, pages: list[str], groups: list[str]) -> int:
                """Every access refreshes the pages' TTLs on disk, also when a faster tier
                serves it (TTLs are refreshed on access, whatever the tier)."""
                return self.storage_backend.touch(pages, groups)

        TtlPassingController.__name__ = TtlPassingController.__qualname__ = (
            f"TtlPassing{base.__name__}"
        )
        _classes[base] = TtlPassingController
    return _classes[base]
