"""`--radix-cache-backend hicache_ext`: our subclass of SGLang's UnifiedRadixCache.

Built through SGLang's own `create_unified_radix_cache`, so component selection (full / SWA /
Mamba) and `init_hicache` (host tier, storage tier) stay SGLang's. The subclass pins the
Python tree core, which is the one that honours overridden Python methods, and is the owner
of the extension's per-tree state (chunk store, groups and TTLs come with later features).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from sglang_ext.settings import ExtensionSettings, load_settings

if TYPE_CHECKING:
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

logger = logging.getLogger(__name__)

BACKEND_NAME = "hicache_ext"
_cache_class: type | None = None


def cache_class() -> type:
    """The subclass, created on first use so this module imports without SGLang's tree code."""
    global _cache_class
    if _cache_class is None:
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        class HiCacheExtRadixCache(UnifiedRadixCache):
            """UnifiedRadixCache on the Python tree core, carrying the extension's state."""

            settings: ExtensionSettings = (
                ExtensionSettings()
            )  # replaced per instance by the factory

            def ext_status(self) -> dict[str, Any]:
                controller = self.cache_controller
                return {
                    "radix_cache_backend": BACKEND_NAME,
                    "tree_class": type(self).__name__,
                    "tree_core": self._tree_core_backend,
                    "hierarchical_cache": controller is not None,
                    "storage_backend": getattr(controller, "storage_backend_type", None)
                    if controller is not None
                    else None,
                    "settings": self.settings.as_dict(),
                }

        _cache_class = HiCacheExtRadixCache
    return _cache_class


def build_tree_cache(ctx: TreeCacheBuildContext) -> BasePrefixCache:
    """Radix-cache factory registered under `hicache_ext`."""
    from sglang.srt.mem_cache.registry import create_unified_radix_cache

    settings = load_settings(ctx.server_args.hicache_storage_backend_extra_config)
    ctx.params.tree_core_backend = settings.tree_core
    cache = create_unified_radix_cache(ctx, cache_class=cache_class())
    cache.settings = settings
    logger.info(
        "hicache_ext radix cache ready: tree_core=%s hierarchical_cache=%s",
        settings.tree_core,
        cache.cache_controller is not None,
    )
    return cache


def add_status_to_internal_state(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook on Scheduler.get_internal_state: expose our state in `/server_info`."""
    tree_cache = getattr(scheduler, "tree_cache", None)
    status = getattr(tree_cache, "ext_status", None)
    if status is not None and tree_cache.settings.report_in_server_info:
        result.internal_state["hicache_ext"] = status()
    return result
