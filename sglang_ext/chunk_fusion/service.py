"""The fusion service: one per scheduler process, everything a fused request uses there.

Built once, by `sglang_ext/assembly.py`, from the settings and the parts it builds (the chunk
registry with its tiers, capture of traffic's documents, the model check, the ratio policy and
the live fidelity window); nothing here constructs a part. The SGLang hooks find it on the
objects SGLang hands them (`service_of`): the tree cache (`HiCacheExtRadixCache.fusion`) and the
model runner, where the assembly attaches it.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_hicache_ext.fusion.fused_rows import FusedRows
from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.tensor_parallel import TensorParallel
from sglang_hicache_ext.sglang_ext.chunk_fusion.auto_capture import AutoCapture
from sglang_hicache_ext.sglang_ext.chunk_fusion.decode_keep import KeptRowsTable
from sglang_hicache_ext.sglang_ext.chunk_fusion.model_check import ModelCheck
from sglang_hicache_ext.sglang_ext.chunk_fusion.registration import registration_id
from sglang_hicache_ext.sglang_ext.chunk_fusion.registry import ChunkRegistry
from sglang_hicache_ext.sglang_ext.chunk_fusion.request_options import FusionOptions, parse_options
from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings
from sglang_hicache_ext.sglang_ext.metrics.prometheus_metrics import ExtensionMetrics
from sglang_hicache_ext.sglang_ext.sglang_types import ScheduledRequest
from sglang_hicache_ext.tuning.ratio.live_fidelity import LiveFidelity
from sglang_hicache_ext.tuning.ratio.self_tuned import SelfTunedRatios
from sglang_hicache_ext.tuning.ratio.table import RatioTable, load_ratio_table

# The registry's generation, a prompt's chunk spans [start, end) and its fusion options.
AdmissionGuess = tuple[int, list[tuple[int, int]], FusionOptions | None]

# The attribute under which the assembly attaches the service to SGLang's objects.
SERVICE_ATTRIBUTE = "hicache_ext_fusion"


@dataclass(eq=False)
class FusionService:
    """Per scheduler process: the parts fusion uses, the live requests and the counters."""

    settings: ExtensionSettings
    registry: ChunkRegistry
    # The served model's adapter and the gate that proves it exact before fusing.
    model: ModelCheck
    # "auto" without a ratio table: ratios from this server's own prefills and loads.
    self_tuned: SelfTunedRatios
    # The shadow checks' results: the live window and, with a target, each tier's ratio.
    fidelity: LiveFidelity
    # With the setting auto_chunks: fused prompts' own documents kept as chunks.
    auto_capture: AutoCapture | None
    tp: TensorParallel  # this scheduler's rank (`--tp-size`)
    metrics: ExtensionMetrics | None  # None: SGLang's metrics are off
    # The attention backend's kept rows of decode-time eviction (None: not torch_position).
    kept_rows: KeptRowsTable | None
    requests: weakref.WeakValueDictionary[str, ScheduledRequest] = field(
        default_factory=weakref.WeakValueDictionary
    )
    # Fused requests split across chunked-prefill rounds: the rows of their later rounds
    # (host memory), dropped with the request, when it finishes or is aborted.
    pending: weakref.WeakKeyDictionary[ScheduledRequest, FusedRows] = field(
        default_factory=weakref.WeakKeyDictionary
    )
    # Fused requests whose later round had to take SGLang's forward (a mixed batch): the rest
    # of their prompt is computed normally over their fused rows, never fused again.
    interrupted: weakref.WeakSet[ScheduledRequest] = field(default_factory=weakref.WeakSet)
    # Admission: where each prompt's chunks sit (none: not fusable) and its options,
    # recomputed when the set of registered chunks changes.
    admission: weakref.WeakKeyDictionary[ScheduledRequest, AdmissionGuess] = field(
        default_factory=weakref.WeakKeyDictionary
    )
    counters: Counter[str] = field(default_factory=Counter)
    _ratio_table: RatioTable | None = field(default=None, repr=False)

    def ratio_table(self) -> RatioTable:
        """The tuned ratios of `fusion_ratio_table` (read once; ValueError when unusable)."""
        if self._ratio_table is None:
            if not self.settings.fusion_ratio_table:
                raise ValueError("no fusion_ratio_table is set")
            self._ratio_table = load_ratio_table(
                Path(self.settings.fusion_ratio_table).expanduser()
            )
        return self._ratio_table

    def options(self, req: ScheduledRequest, count: bool = True) -> FusionOptions | None:
        """The request's fusion options; None (counted as `bad_options` when `count`) when its
        `custom_params` are invalid (validated at the HTTP layer; an engine API caller may
        bypass it)."""
        try:
            return parse_options(getattr(req.sampling_params, "custom_params", None), self.settings)
        except ValueError:
            if count:
                self.fallback("bad_options")
            return None

    def asks_for_fusion(self, req: ScheduledRequest) -> bool:
        """The request asked for fusion (its `custom_params.fusion`, or `fusion_by_default`)."""
        if registration_id(req) is not None:
            return False
        options = self.options(req, count=False)
        return options is not None and options.enabled

    def fallback(self, reason: str) -> None:
        """Count one request that asked for fusion and gets the normal prefill."""
        self.counters[f"fallback_{reason}"] += 1
        if self.metrics is not None:
            self.metrics.fusion_fallback(reason)

    def drop_finished(self) -> None:
        """Forget the kept rows of requests that finished or were aborted between rounds."""
        for req in [req for req in self.pending if req.finished()]:
            del self.pending[req]

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters,
            "decode_steps_over_kept_rows": 0
            if self.kept_rows is None
            else self.kept_rows.decode_steps,
            "auto_ratio": self.self_tuned.status(),
            "shadow": self.fidelity.status(),
            "model_check": self.model.stats(),
        }


def service_of(owner: object) -> FusionService | None:
    """The service the assembly attached to `owner` (SGLang's tree cache or model runner);
    None when fusion is not served there (another radix backend, a draft model's runner, or a
    model chunk reuse cannot serve)."""
    service = getattr(owner, SERVICE_ATTRIBUTE, None)
    return service if isinstance(service, FusionService) else None
