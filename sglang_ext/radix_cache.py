"""`--radix-cache-backend hicache_ext`: our subclass of SGLang's UnifiedRadixCache.

Built through SGLang's own `create_unified_radix_cache`, so component selection (full / SWA /
Mamba) and `init_hicache` (host tier, storage tier) stay SGLang's. The subclass pins the
Python tree core, which is the one that honours overridden Python methods, and is the owner
of the extension's per-tree state (chunk store, groups and TTLs come with later features).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cachetools
import torch

from sglang_hicache_ext.fusion.rope import layer_rope_specs
from sglang_hicache_ext.radix.segments import break_token_ids
from sglang_hicache_ext.sglang_ext.chunk_fusion import fused_prefill
from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.registry import (
    NoAdapterError,
    adapter_class,
)
from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.tensor_parallel import TensorParallel
from sglang_hicache_ext.sglang_ext.chunk_fusion.auto_capture import AutoCapture
from sglang_hicache_ext.sglang_ext.chunk_fusion.context_variants import ContextVariants
from sglang_hicache_ext.sglang_ext.chunk_fusion.registration import (
    registration_codec,
    registration_id,
    registration_prefix_tokens,
)
from sglang_hicache_ext.sglang_ext.chunk_fusion.registry import ChunkRegistry
from sglang_hicache_ext.sglang_ext.chunk_fusion.shadow_request import shadow_of
from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings
from sglang_hicache_ext.sglang_ext.config.settings_sources import load_settings
from sglang_hicache_ext.tiers.chunks.disk_tier import ChunkDiskTier
from sglang_hicache_ext.tiers.chunks.mooncake_client import MooncakeClient, MooncakeConfig
from sglang_hicache_ext.tiers.chunks.remote_tier import ChunkRemoteTier
from sglang_hicache_ext.tiers.chunks.tier import chunk_namespace

if TYPE_CHECKING:
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

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
            chunks: ChunkRegistry | None = None
            chunks_unavailable: str = "not initialised"
            auto_capture: AutoCapture | None = None  # with the setting auto_chunks
            disk_tier: Any = None  # sglang_hicache_ext.sglang_ext.disk_tier.storage_backend.GroupTTLDiskStorage when in use
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
                elif self.auto_capture is not None and up_to >= len(req.origin_input_ids):
                    self._capture_pieces(req)
                super().checkpoint(req, up_to=up_to, **kwargs)

            def _capture_pieces(self, req: Any) -> None:
                """auto_chunks: the prompt's documents kept from the rows just computed, when
                the request asked for fusion (only fused requests can reuse them)."""
                assert self.auto_capture is not None
                if not fused_prefill.asks_for_fusion(req):
                    return
                tokens = req.origin_input_ids
                slots = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(tokens)]
                self.auto_capture.capture(
                    req.rid, tokens, self.token_to_kv_pool_allocator.get_kvcache(), slots
                )

            def _capture_chunk(self, req: Any, chunk_id: str) -> None:
                if self.chunks is None:
                    logger.error(
                        "chunk %s not captured: %s", chunk_id[:12], self.chunks_unavailable
                    )
                    return
                tokens = list(req.origin_input_ids)
                slots = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(tokens)]
                kv_pool = self.token_to_kv_pool_allocator.get_kvcache()
                # The prefix's rows stay the tree's (cached like any prompt's); the chunk's
                # rows are those after it.
                start = registration_prefix_tokens(req)
                self.chunks.capture(
                    chunk_id,
                    tokens[start:],
                    kv_pool,
                    slots[start:].to(torch.long),
                    registration_codec(req),
                    tuple(tokens[:start]),
                )

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
                    "chunks": self.chunks.stats() if self.chunks is not None else None,
                    "chunks_unavailable": None
                    if self.chunks is not None
                    else self.chunks_unavailable,
                    "fusion": fused_prefill.runtime().stats() if fused_prefill.runtime() else None,
                    "auto_chunks": self.auto_capture.stats() if self.auto_capture else None,
                    "context_variants": self.chunks.context_variants.stats()
                    if self.chunks is not None and self.chunks.context_variants is not None
                    else None,
                    "disk_tier": self.disk_tier.status() if self.disk_tier is not None else None,
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
    tp = TensorParallel.of_scheduler()
    cache.chunks, cache.chunks_unavailable = _chunk_registry(ctx, settings, tp)
    if cache.chunks is not None:
        _log_fusion_adapter(ctx.model_config.hf_config)
    if cache.chunks is not None and settings.auto_chunks:
        # The preflight refuses auto_chunks with --skip-tokenizer-init: the scheduler has one.
        cache.auto_capture = AutoCapture.for_settings(
            settings, cache.chunks, break_token_ids(ctx.tp_worker.tokenizer), tp
        )
    if cache.chunks is not None and settings.fusion_shadow_refresh:
        cache.chunks.context_variants = ContextVariants(settings.fusion_context_variant_bytes)
    cache.disk_tier = _install_disk_tier(cache)
    model_name = Path(str(ctx.model_config.model_path).rstrip("/")).name
    fused_prefill.install_runtime(cache.chunks, settings, model_name, cache.auto_capture, tp)
    logger.info(
        "hicache_ext radix cache ready: tree_core=%s hierarchical_cache=%s",
        settings.tree_core,
        cache.cache_controller is not None,
    )
    return cache


def _install_disk_tier(cache: Any) -> Any:
    from sglang_hicache_ext.sglang_ext.disk_tier import controller as ttl_controller

    return ttl_controller.install(cache)


def _chunk_registry(
    ctx: TreeCacheBuildContext, settings: ExtensionSettings, tp: TensorParallel
) -> tuple[ChunkRegistry | None, str]:
    """A chunk registry, or None with the reason chunk reuse cannot work for this server.

    Under `--tp-size N` each rank keeps its own shard of every chunk (its KV heads): the disk
    tier in a folder of its own, the shared tier under a namespace naming the rank."""
    if reason := _unsupported_parallelism(ctx.server_args):
        return None, reason
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm:
        return None, "chunk registration needs a full-attention model (no SWA / Mamba layers)"
    try:
        rope = layer_rope_specs(ctx.model_config.hf_config)
    except (ValueError, AttributeError, KeyError) as err:
        return None, f"cannot recover RoPE positions for this model: {err}"
    disk = None
    if "disk" in settings.chunk_tier_names:
        assert settings.chunk_disk_dir is not None  # the settings check both or neither
        disk = ChunkDiskTier(
            chunk_disk_directory(settings.chunk_disk_dir, ctx.model_config, ctx.server_args, tp),
            settings.chunk_disk_bytes,
            read_bytes_per_s=settings.chunk_disk_read_bytes_per_s or None,
        )
        logger.info(
            "hicache_ext chunk disk tier: %s (%d chunks, budget %d bytes)",
            disk.directory,
            disk.stats().entries,
            settings.chunk_disk_bytes,
        )
    remote = None
    if "mooncake" in settings.chunk_tier_names:
        remote = _mooncake_tier(settings, ctx, tp)
    registry = ChunkRegistry(
        settings.chunk_store_bytes,
        rope,
        disk=disk,
        remote=remote,
        promote_on_read=settings.chunk_promote_on_read,
        disk_read_bytes_per_s=settings.chunk_disk_read_bytes_per_s or None,
        # A row that fails its checksum mid-prefill on one rank would leave the other ranks
        # waiting in the layer's collective: under TP, disk chunks are read whole and checked
        # while planning, where the ranks compare what they found (`rank_agreement`).
        stream_from_disk=tp.size == 1,
    )
    return registry, ""


def _unsupported_parallelism(server_args: Any) -> str:
    """Why the server's parallelism cannot run the fused prefill ("" when it can): fusion runs
    every layer in each process over its tensor-parallel shard of the heads."""
    refused = {
        "--pp-size > 1 (each rank holds only some layers)": getattr(server_args, "pp_size", 1) > 1,
        "--enable-dp-attention (attention heads are not split across the tensor-parallel "
        "group)": bool(getattr(server_args, "enable_dp_attention", False)),
        "--ep-size > 1 (experts are dispatched, not summed)": getattr(server_args, "ep_size", 1)
        > 1,
    }
    named = [what for what, on in refused.items() if on]
    return f"chunk fusion does not support {named[0]}" if named else ""


def _log_fusion_adapter(hf_config: Any) -> None:
    """The launch log's line on fusion for this model: the adapter that will serve it, or why
    none will and which families have one."""
    from sglang.srt.models.registry import ModelRegistry

    try:
        model_class, _ = ModelRegistry.resolve_model_cls(hf_config.architectures)
    except Exception as err:  # SGLang resolves it again to load the model; it reports this
        logger.debug("hicache_ext fusion: model class not resolved here: %s", err)
        return
    try:
        adapter = adapter_class(model_class)
    except NoAdapterError as err:
        logger.warning("hicache_ext fusion: %s; fused requests fall back (no_adapter)", err)
        return
    logger.info(
        "hicache_ext fusion: %s through the %s (checked against the normal prefill on the "
        "first fused batch)",
        model_class.__name__,
        adapter.__name__,
    )


def _mooncake_tier(
    settings: ExtensionSettings, ctx: TreeCacheBuildContext, tp: TensorParallel
) -> ChunkRemoteTier:
    """The shared chunk tier (its master was found listening by the launch checks)."""
    assert settings.chunk_mooncake_master is not None  # the settings check both or neither
    config = MooncakeConfig(
        master=settings.chunk_mooncake_master,
        metadata_server=settings.chunk_mooncake_metadata_server,
        local_hostname=settings.chunk_mooncake_local_hostname,
        segment_bytes=settings.chunk_mooncake_segment_bytes,
    )
    # Keys name the model by its folder's name, not its path: servers on other machines
    # share chunks of the same model (and the identity hash keeps other models' KV apart).
    model_name = Path(str(ctx.model_config.model_path).rstrip("/")).name
    namespace = tp.scoped(
        chunk_namespace(model_name, _kv_identity(ctx.model_config, ctx.server_args))
    )
    logger.info("hicache_ext chunk tier mooncake: master %s", config.master)
    # The catalogue names each chunk's writer by the address clients reach it at.
    args = ctx.server_args
    writer = f"{args.host}:{args.port}" if settings.chunk_mooncake_catalog else None
    if writer is not None and tp.size > 1:
        # Each rank would index another server's announcements when its own catalogue shows
        # them, at a time of its own: admission would differ between the ranks. Registering the
        # same text still finds the chunk in the store (by its key, on every rank).
        logger.warning(
            "hicache_ext chunk tier mooncake: the catalogue is off under --tp-size %d", tp.size
        )
        writer = None
    return ChunkRemoteTier(MooncakeClient(config), namespace, writer=writer)


def _kv_identity(model_config: Any, server_args: Any) -> str:
    """Everything besides the weights that shapes a chunk's KV."""
    return "\n".join(
        (
            str(getattr(model_config, "revision", None)),
            str(getattr(model_config, "dtype", None)),
            str(getattr(server_args, "kv_cache_dtype", None)),
            model_config.hf_config.to_json_string(),
        )
    )


def chunk_disk_directory(
    chunk_disk_dir: str, model_config: Any, server_args: Any, tp: TensorParallel
) -> Path:
    """`chunk_disk_dir/chunks/<model>-<hash of what shapes its KV>`, and `-tp<r>of<n>` after
    it for rank r of `--tp-size n` (one rank's shard of the heads)."""
    model_path = str(model_config.model_path)
    if Path(model_path).expanduser().exists():  # a folder, not a hub id: the same from any cwd
        model_path = str(Path(model_path).expanduser().absolute())
    identity = _kv_identity(model_config, server_args)
    folder = tp.scoped(chunk_namespace(model_path, identity))
    return Path(chunk_disk_dir).expanduser() / "chunks" / folder


def add_status_to_internal_state(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook on Scheduler.get_internal_state: expose our state in `/server_info`."""
    tree_cache = getattr(scheduler, "tree_cache", None)
    status = getattr(tree_cache, "ext_status", None)
    if status is not None and tree_cache.settings.report_in_server_info:
        result.internal_state["hicache_ext"] = status()
    return result
