"""What the extension keeps in SGLang's HTTP process, one per tokenizer manager.

Built in one place (`http_state`), on the first request that needs it, and attached to SGLang's
tokenizer manager, whose lifetime is the server's: the settings the server was launched with
(validated at launch, read once), the `POST /chunks` rate limiter and chunk lookups, the shadow checks, the
placement rounds and the fused-TTFT series. The routes and the tokenizer manager's hooks reach it through the manager they are
given (`control_routes.tokenizer_manager()` for the routes).
"""

from __future__ import annotations

from typing import Any

from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings
from sglang_hicache_ext.sglang_ext.config.settings_sources import load_settings
from sglang_hicache_ext.sglang_ext.metrics.http_process_metrics import FusedTtftMetrics
from sglang_hicache_ext.sglang_ext.server.control_routes import ChunkLookups
from sglang_hicache_ext.sglang_ext.server.placement_round import PlacementRounds
from sglang_hicache_ext.sglang_ext.server.request_limits import RateLimiter
from sglang_hicache_ext.sglang_ext.server.shadow_checks import ShadowChecks

_ATTRIBUTE = "hicache_ext_http"


class HttpProcessState:
    """One server's extension state in its HTTP process."""

    def __init__(self, manager: Any, settings: ExtensionSettings) -> None:
        self.settings = settings
        # One registration rate limiter per server.
        self.registrations = RateLimiter(
            settings.chunk_registrations_per_minute, "chunk_registrations_per_minute"
        )
        self.shadow_checks = ShadowChecks(manager, settings)
        # Registrations posted together ask the scheduler about their chunks in one call.
        self.chunk_lookups = ChunkLookups()
        # The placement's profiles and rounds (`POST /hicache_ext/placement`, the timer's).
        self.placement_rounds = PlacementRounds()
        self._manager = manager
        self._fused_ttft: FusedTtftMetrics | None = None

    def fused_ttft(self) -> FusedTtftMetrics:
        """The fused-TTFT series (created on the first fused request: only with metrics on)."""
        if self._fused_ttft is None:
            self._fused_ttft = FusedTtftMetrics(self._manager.metrics_collector.labels)
        return self._fused_ttft


def http_state(manager: Any) -> HttpProcessState:
    """The state of the server `manager` (SGLang's TokenizerManager) serves, built once. Every
    caller runs on the HTTP process's event loop (the routes and the manager's hooks), so two
    first requests cannot build two."""
    state = current_http_state(manager)
    if state is None:
        settings = load_settings(manager.server_args.hicache_storage_backend_extra_config)
        state = HttpProcessState(manager, settings)
        setattr(manager, _ATTRIBUTE, state)
    return state


def current_http_state(manager: Any) -> HttpProcessState | None:
    """The state if a request has built it, else None (nothing is built to answer a status)."""
    state = getattr(manager, _ATTRIBUTE, None)
    return state if isinstance(state, HttpProcessState) else None
