"""`--radix-cache-backend hicache_ext`: our subclass of SGLang's UnifiedRadixCache.

Built by `assembly.build_tree_cache` through SGLang's own `create_unified_radix_cache`, so
component selection (full / SWA / Mamba) and `init_hicache` (host tier, storage tier) stay
SGLang's. The subclass pins the Python tree core, which is the one that honours overridden
Python methods, and holds what the assembly built for this scheduler: the fusion service and
the TTL disk tier. It is where SGLang's tree meets them: a checkpointed registration or fused
prompt is captured, a user's match is logged for the TTL plan, `/server_info` reports them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import cachetools
import torch

from sglang_hicache_ext.sglang_ext.chunk_fusion.pool_rows import capture_chunk
from sglang_hicache_ext.sglang_ext.chunk_fusion.registration import (
    registration_codec,
    registration_id,
    registration_prefix_tokens,
)
from sglang_hicache_ext.sglang_ext.chunk_fusion.service import FusionService
from sglang_hicache_ext.sglang_ext.chunk_fusion.shadow_request import shadow_of
from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings
from sglang_hicache_ext.sglang_ext.sglang_types import ScheduledRequest, SchedulerLike

if TYPE_CHECKING:
    from sglang_hicache_ext.sglang_ext.disk_tier.storage_backend import GroupTTLDiskStorage

logger = logging.getLogger(__name__)

BACKEND_NAME = "hicache_ext"
_cache_class: type | None = None
_RECORDED_RIDS = 4096


def cache_class() -> type:
    """The subclass, created on first use so this module imports without SGLang's tree code."""
    global _cache_class
    if _cache_class is None:
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        class HiCacheExtRadixCache(UnifiedRadixCache):
            """UnifiedRadixCache on the Python tree core, carrying the extension's state."""

            # Replaced per instance by the factory.
            settings: ExtensionSettings = ExtensionSettings()
            fusion: FusionService | None = None  # chunk registry, capture and fusion
            fusion_unavailable: str = "not initialised"  # why `fusion` is None
            disk_tier: GroupTTLDiskStorage | None = None  # the TTL disk tier when in use

            @property
            def hicache_ext_fusion(self) -> FusionService | None:
                # Where `service.service_of` finds the service on any object it is attached to.
                return self.fusion

            # The requests whose access was logged: a set bounded to the last _RECORDED_RIDS.
            _recorded_rids: cachetools.FIFOCache[str, None] | None = None

            def match_prefix(self, params: Any) -> Any:
                result = super().match_prefix(params)
                # A shadow check's match is not a user's access: the TTL plan must not learn it.
                if (
                    self.disk_tier is not None
                    and params.req is not None
                    and shadow_of(params.req) is None
                ):
                    self._record_access(params, result)
                return result

            def _record_access(self, params: Any, result: Any) -> None:
                """Log the request's pages (once per request) and which tier served them."""
                if self._recorded_rids is None:
                    self._recorded_rids = cachetools.FIFOCache(_RECORDED_RIDS)
                rid = params.req.rid
                # The scheduler may match a waiting request several times: count it once.
                if rid in self._recorded_rids:
                    return
                self._recorded_rids[rid] = None  # the oldest rid goes beyond _RECORDED_RIDS
                pages = self.page_keys(params.key)
                if not pages:
                    return
                assert self.disk_tier is not None  # match_prefix records only with a tier
                groups = self.disk_tier.online.record(
                    pages,
                    device_pages=int(result.device_prefix_len) // self.page_size,
                    host_pages=int(result.host_hit_length) // self.page_size,
                )
                self.cache_controller.refresh_ttls(pages, groups)

            def page_keys(self, key: Any) -> list[str]:
                """Storage keys of the full pages of `key` (the hash chain the controller uses)."""
                from sglang.srt.mem_cache.utils import get_storage_hash_str

                full = len(key) // self.page_size * self.page_size
                if full == 0:
                    return []
                return list(get_storage_hash_str(key[:full], None, page_size=self.page_size))

            def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
                # The request's KV rows are still valid here; they are freed right after.
                chunk_id = registration_id(req)
                # Chunked prefill checkpoints each round; only the last one has every row computed.
                if chunk_id is not None and up_to >= len(req.origin_input_ids):
                    self._capture_chunk(req, chunk_id)
                elif (
                    self.fusion is not None
                    and self.fusion.auto_capture is not None
                    and up_to >= len(req.origin_input_ids)
                ):
                    self._capture_pieces(req, self.fusion)
                super().checkpoint(req, up_to=up_to, **kwargs)

            def _capture_pieces(self, req: ScheduledRequest, fusion: FusionService) -> None:
                """auto_chunks: the prompt's documents kept from the rows just computed, when
                the request asked for fusion (only fused requests can reuse them)."""
                assert fusion.auto_capture is not None
                if not fusion.asks_for_fusion(req):
                    return
                tokens = req.origin_input_ids
                slots = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(tokens)]
                # Once the batch's first tokens are sent (`AutoCapture.defer`).
                fusion.auto_capture.defer(
                    req.rid, tokens, self.token_to_kv_pool_allocator.get_kvcache(), slots
                )

            def _capture_chunk(self, req: ScheduledRequest, chunk_id: str) -> None:
                if self.fusion is None:
                    logger.error(
                        "chunk %s not captured: %s", chunk_id[:12], self.fusion_unavailable
                    )
                    return
                tokens = list(req.origin_input_ids)
                slots = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(tokens)]
                kv_pool = self.token_to_kv_pool_allocator.get_kvcache()
                # The prefix's rows stay the tree's (cached like any prompt's); the chunk's
                # rows are those after it.
                start = registration_prefix_tokens(req)
                capture_chunk(
                    self.fusion.registry,
                    chunk_id,
                    tokens[start:],
                    kv_pool,
                    slots[start:].to(torch.long),
                    registration_codec(req),
                    tuple(tokens[:start]),
                )

            def ext_status(self) -> dict[str, Any]:
                controller = self.cache_controller
                fusion = self.fusion
                registry = fusion.registry if fusion is not None else None
                return {
                    "radix_cache_backend": BACKEND_NAME,
                    "tree_class": type(self).__name__,
                    "tree_core": self._tree_core_backend,
                    "hierarchical_cache": controller is not None,
                    "storage_backend": getattr(controller, "storage_backend_type", None)
                    if controller is not None
                    else None,
                    "settings": self.settings.as_dict(),
                    "chunks": registry.stats() if registry is not None else None,
                    "chunks_unavailable": None if fusion is not None else self.fusion_unavailable,
                    "fusion": fusion.stats() if fusion is not None else None,
                    "auto_chunks": fusion.auto_capture.stats()
                    if fusion is not None and fusion.auto_capture is not None
                    else None,
                    "context_variants": registry.context_variants.stats()
                    if registry is not None and registry.context_variants is not None
                    else None,
                    "disk_tier": self.disk_tier.status() if self.disk_tier is not None else None,
                }

        _cache_class = HiCacheExtRadixCache
    return _cache_class


def add_status_to_internal_state(
    result: Any, scheduler: SchedulerLike, *args: Any, **kwargs: Any
) -> Any:
    """AFTER hook on Scheduler.get_internal_state: expose our state in `/server_info`."""
    tree_cache = scheduler.tree_cache
    status = getattr(tree_cache, "ext_status", None)
    if status is not None and tree_cache.settings.report_in_server_info:
        result.internal_state["hicache_ext"] = status()
    return result
