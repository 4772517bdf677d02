"""SGLang plugin entry point (`sglang.srt.plugins`: `hicache_ext = sglang_hicache_ext.sglang_ext.plugin:register`).

`register()` runs in every SGLang process before the server arguments are parsed. It makes
`--radix-cache-backend hicache_ext` and `--attention-backend torch_position` available,
adds the `/chunks` routes, reports our state in `/server_info`, installs the CPU compatibility hooks when torch has no
CUDA device, and, in the launching process only, the preflight checks (settings always;
model folder and port unless `preflight_checks = false`).
"""

from __future__ import annotations

import logging
import multiprocessing

from sglang_hicache_ext.sglang_ext import assembly, radix_cache, scheduler_control
from sglang_hicache_ext.sglang_ext.chunk_fusion import fused_prefill
from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings, SettingsError
from sglang_hicache_ext.sglang_ext.config.settings_sources import load_settings
from sglang_hicache_ext.sglang_ext.cpu import compat as cpu_compat
from sglang_hicache_ext.sglang_ext.cpu import position_attention as attention_backend
from sglang_hicache_ext.sglang_ext.server import (
    generate_hooks,
    http_routes,
    preflight,
    shadow_check_hooks,
)

logger = logging.getLogger(__name__)


def _settings_for_registration() -> ExtensionSettings:
    # A bad file is reported by the preflight check (launch) or the cache factory (Engine);
    # registration itself must not fail halfway, so it proceeds on defaults.
    try:
        return load_settings()
    except SettingsError:
        return ExtensionSettings()


def register() -> None:
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    settings = _settings_for_registration()
    if get_radix_cache_factory(radix_cache.BACKEND_NAME) is None:
        register_radix_cache_backend(radix_cache.BACKEND_NAME, assembly.build_tree_cache)
    attention_backend.register()
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.get_internal_state",
        radix_cache.add_status_to_internal_state,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.handle_dumper_control",
        scheduler_control.handle_control,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler._create_generation_req",
        fused_prefill.remember_request,
        HookType.AFTER,
    )
    # auto_chunks: a prompt's pieces are captured once its first token is sent, and before KV
    # is allocated again (`AutoCapture.defer`).
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.process_batch_result",
        fused_prefill.captures_after_results,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
        fused_prefill.run_deferred_captures,
        HookType.BEFORE,
    )
    HookRegistry.register(
        "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
        fused_prefill.keep_batches_homogeneous,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req",
        fused_prefill.continue_shadow_check,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler._prefetch_kvcache",
        fused_prefill.no_storage_prefetch_for_checks,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.schedule_policy.SchedulePolicy.calc_priority",
        fused_prefill.shadow_checks_last,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner._forward_raw",
        fused_prefill.forward_with_fusion,
        HookType.AROUND,
    )
    hooked: list[str] = []
    if cpu_compat.cpu_compat_needed(settings.cpu_compat):
        hooked = cpu_compat.install(HookRegistry.register)
    if multiprocessing.parent_process() is None:
        http_routes.register_routes()
        HookRegistry.register(
            "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request",
            generate_hooks.validate_request,
            HookType.BEFORE,
        )
        HookRegistry.register(
            "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request",
            shadow_check_hooks.track_request,
            HookType.AROUND,
        )
        HookRegistry.register(
            "sglang.srt.managers.tokenizer_manager.TokenizerManager._tokenize_one_request",
            shadow_check_hooks.remember_prompt,
            HookType.AROUND,
        )
        HookRegistry.register(
            "sglang.srt.managers.tokenizer_manager.TokenizerManager.collect_metrics",
            generate_hooks.observe_fused_ttft,
            HookType.AROUND,
        )
        HookRegistry.register(
            "sglang.srt.server_args.ServerArgs.resolve_once",
            preflight.before_resolve,
            HookType.BEFORE,
        )
    logger.info(
        "sglang-hicache-ext registered: radix backend %r, attention backend %r, CPU hooks: %s",
        radix_cache.BACKEND_NAME,
        attention_backend.BACKEND_NAME,
        ", ".join(hooked) or "none",
    )
