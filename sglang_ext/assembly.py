"""The one place the extension's per-scheduler objects are made.

`build_tree_cache` is the radix-cache factory SGLang calls for `--radix-cache-backend
hicache_ext` (registered by `plugin.py`). It builds the tree through SGLang's own
`create_unified_radix_cache` (so component selection and `init_hicache` stay SGLang's), then the
extension's parts from the settings, in one order, each handed the parts it uses:

1. the metrics observer (`ExtensionMetrics`, None with SGLang's metrics off);
2. the chunk tiers below host memory, from `chunk_tier_names` through `CHUNK_TIERS`;
3. the chunk registry (catalogue and tiered store) and, with `fusion_shadow_refresh`, the
   context variants it keeps;
4. with `auto_chunks`, capture of fused prompts' documents;
5. the fusion service (`chunk_fusion/service.py`): the model check, the ratio policy, the live
   fidelity window, attached to the tree cache and the model runner, where the hooks find it;
6. the TTL disk tier when HiCache's storage backend is ours.

Nothing else in `sglang_ext` constructs these (`tests/test_assembly.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from sglang_hicache_ext.fusion.rope import LayerRopes, layer_rope_specs
from sglang_hicache_ext.radix.segments import break_token_ids
from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.registry import (
    NoAdapterError,
    adapter_class,
)
from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.tensor_parallel import TensorParallel
from sglang_hicache_ext.sglang_ext.chunk_fusion.auto_capture import AutoCapture
from sglang_hicache_ext.sglang_ext.chunk_fusion.context_variants import ContextVariants
from sglang_hicache_ext.sglang_ext.chunk_fusion.model_check import ModelCheck
from sglang_hicache_ext.sglang_ext.chunk_fusion.registry import (
    ChunkRegistry,
    HostChunk,
    host_chunk,
)
from sglang_hicache_ext.sglang_ext.chunk_fusion.service import SERVICE_ATTRIBUTE, FusionService
from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings
from sglang_hicache_ext.sglang_ext.config.settings_sources import load_settings
from sglang_hicache_ext.sglang_ext.disk_tier import controller as ttl_controller
from sglang_hicache_ext.sglang_ext.metrics.prometheus_metrics import (
    ExtensionMetrics,
    process_metrics,
)
from sglang_hicache_ext.sglang_ext.radix_cache import cache_class
from sglang_hicache_ext.tiers.chunks.admission import FrequencyAdmission
from sglang_hicache_ext.tiers.chunks.disk_tier import ChunkDiskTier
from sglang_hicache_ext.tiers.chunks.mooncake_client import MooncakeClient, MooncakeConfig
from sglang_hicache_ext.tiers.chunks.remote_tier import ChunkRemoteTier
from sglang_hicache_ext.tiers.chunks.retention import (
    PRIOR_LOWER_BYTES_PER_S,
    RetentionCosts,
    UtilityRetention,
)
from sglang_hicache_ext.tiers.chunks.stored_forms import StoredChunkForms
from sglang_hicache_ext.tiers.chunks.tier import chunk_namespace
from sglang_hicache_ext.tuning.ratio.agreement_target import AgreementTarget
from sglang_hicache_ext.tuning.ratio.live_fidelity import LiveFidelity
from sglang_hicache_ext.tuning.ratio.self_tuned import SelfTunedRatios

if TYPE_CHECKING:
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

logger = logging.getLogger(__name__)


def build_tree_cache(ctx: TreeCacheBuildContext) -> BasePrefixCache:
    """Radix-cache factory registered under `hicache_ext`."""
    from sglang.srt.mem_cache.registry import create_unified_radix_cache

    settings = load_settings(ctx.server_args.hicache_storage_backend_extra_config)
    ctx.params.tree_core_backend = settings.tree_core
    cache = create_unified_radix_cache(ctx, cache_class=cache_class())
    cache.settings = settings
    tp = TensorParallel.of_scheduler()
    metrics = process_metrics()
    cache.fusion, cache.fusion_unavailable = _fusion_service(ctx, settings, tp, metrics)
    if cache.fusion is not None:
        setattr(ctx.tp_worker.model_runner, SERVICE_ATTRIBUTE, cache.fusion)
        _log_fusion_adapter(ctx.model_config.hf_config)
    cache.disk_tier = ttl_controller.install(cache, metrics)
    logger.info(
        "hicache_ext radix cache ready: tree_core=%s hierarchical_cache=%s",
        settings.tree_core,
        cache.cache_controller is not None,
    )
    return cache


def _fusion_service(
    ctx: TreeCacheBuildContext,
    settings: ExtensionSettings,
    tp: TensorParallel,
    metrics: ExtensionMetrics | None,
) -> tuple[FusionService | None, str]:
    """The fusion service, or None with the reason chunk reuse cannot work for this server."""
    if reason := _unsupported_parallelism(ctx.server_args):
        return None, reason
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm:
        return None, "chunk registration needs a full-attention model (no SWA / Mamba layers)"
    try:
        rope = layer_rope_specs(ctx.model_config.hf_config)
    except (ValueError, AttributeError, KeyError) as err:
        return None, f"cannot recover RoPE positions for this model: {err}"
    # Only pieces kept from traffic compete for host memory by frequency; registered chunks
    # are admitted always, so without auto_chunks there is nothing to decide.
    admission: FrequencyAdmission | None = None
    entries = settings.chunk_admission_sketch_entries
    if settings.auto_chunks and settings.chunk_admission == "frequency":
        admission = FrequencyAdmission.for_entries(entries)
    elif settings.auto_chunks and settings.chunk_admission == "adaptive":
        admission = FrequencyAdmission.for_entries(
            entries, settings.chunk_store_bytes, _disk_budget(settings)
        )
    self_tuned = SelfTunedRatios.for_model(
        _model_name(ctx.model_config),
        checked=settings.fusion_target_agreement is not None and settings.fusion_shadow_rate > 0,
    )
    retention: UtilityRetention[HostChunk] | None = None
    if settings.chunk_retention == "utility" and tp.size > 1:
        # Each rank would measure its own shard's compression errors and times, and could keep
        # a chunk another rank dropped: the ranks' host memories must stay alike.
        logger.warning(
            "hicache_ext: chunk_retention utility needs --tp-size 1; host memory "
            "drops the least recently used under --tp-size %d",
            tp.size,
        )
    elif settings.chunk_retention == "utility":
        retention = UtilityRetention(
            settings.chunk_retention_max_kv_error,
            RetentionCosts(
                measured_prefill=_prefill_s_per_token(
                    self_tuned, int(ctx.model_config.num_hidden_layers)
                ),
                lower_bytes_per_s=settings.chunk_disk_read_bytes_per_s or PRIOR_LOWER_BYTES_PER_S,
            ),
            admission=admission,
        )
    registry = _chunk_registry(ctx, settings, tp, rope, metrics, admission, retention)
    auto_capture = None
    if settings.auto_chunks:
        # The preflight refuses auto_chunks with --skip-tokenizer-init: the scheduler has one.
        auto_capture = AutoCapture.for_settings(
            settings, registry, break_token_ids(ctx.tp_worker.tokenizer), tp, metrics, admission
        )
    runner = ctx.tp_worker.model_runner
    service = FusionService(
        settings=settings,
        registry=registry,
        model=ModelCheck(tp=tp),
        self_tuned=self_tuned,
        fidelity=LiveFidelity(
            AgreementTarget(settings.fusion_target_agreement)
            if settings.fusion_target_agreement is not None
            else None,
            settings.fusion_shadow_window,
            None if metrics is None else metrics.target_ratio,
        ),
        auto_capture=auto_capture,
        tp=tp,
        metrics=metrics,
        kept_rows=getattr(getattr(runner, "attn_backend", None), "kept_rows", None),
    )
    return service, ""


def _prefill_s_per_token(
    self_tuned: SelfTunedRatios, num_layers: int
) -> Callable[[], float | None]:
    """The prefill seconds per token the fused prefills measured, for the retention's utility."""

    def measured() -> float | None:
        per_layer = self_tuned.compute_s_per_token_layer()
        return None if per_layer is None else per_layer * num_layers

    return measured


def _disk_budget(settings: ExtensionSettings) -> int | None:
    """The chunk disk tier's budget, None without one: what host memory writes through to,
    which the adaptive admission's shadows replay below host memory."""
    return settings.chunk_disk_bytes if "disk" in settings.chunk_tier_names else None


def _chunk_registry(
    ctx: TreeCacheBuildContext,
    settings: ExtensionSettings,
    tp: TensorParallel,
    rope: LayerRopes,
    metrics: ExtensionMetrics | None,
    admission: FrequencyAdmission | None,
    retention: UtilityRetention[HostChunk] | None,
) -> ChunkRegistry:
    """The registry over host memory and the tiers `chunk_tier_names` lists below it.

    Under `--tp-size N` each rank keeps its own shard of every chunk (its KV heads): the disk
    tier in a folder of its own, the shared tier under a namespace naming the rank."""
    # Host memory is the registry's own; the settings refuse an unknown tier name at launch.
    lower = {
        name: CHUNK_TIERS[name](settings, ctx, tp)
        for name in settings.chunk_tier_names
        if name != "host"
    }
    disk, remote = lower.get("disk"), lower.get("mooncake")
    assert disk is None or isinstance(disk, ChunkDiskTier)
    assert remote is None or isinstance(remote, ChunkRemoteTier)
    if retention is not None:  # dropped from host memory, a chunk a lower tier keeps is not lost
        kept = [tier for tier in (disk, remote) if tier is not None]
        retention.bind(StoredChunkForms(host_chunk, lambda key: any(key in t for t in kept)))
        if disk is not None:  # the disk's budget gives up the least reused first too
            disk.keep_score = retention.frequency
    return ChunkRegistry(
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
        context_variants=ContextVariants(settings.fusion_context_variant_bytes, metrics)
        if settings.fusion_shadow_refresh
        else None,
        metrics=metrics,
        admission=admission,
        retention=retention,
    )


def _disk_tier(
    settings: ExtensionSettings, ctx: TreeCacheBuildContext, tp: TensorParallel
) -> ChunkDiskTier:
    """The chunk disk tier (`chunk_disk_dir`), in a folder per model, KV shape and rank."""
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
    return disk


def _model_name(model_config: Any) -> str:
    return Path(str(model_config.model_path).rstrip("/")).name


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
    namespace = tp.scoped(
        chunk_namespace(
            _model_name(ctx.model_config), _kv_identity(ctx.model_config, ctx.server_args)
        )
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


# The chunk tiers below host memory, by their name in `chunk_tier_names` (host memory is always
# the first: the registry's own).
ChunkTierBuilder = Callable[
    [ExtensionSettings, Any, TensorParallel], ChunkDiskTier | ChunkRemoteTier
]
CHUNK_TIERS: Mapping[str, ChunkTierBuilder] = MappingProxyType(
    {"disk": _disk_tier, "mooncake": _mooncake_tier}
)
