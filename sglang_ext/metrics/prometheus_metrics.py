"""The extension's series on SGLang's own Prometheus endpoint (`--enable-metrics`, `GET /metrics`).

SGLang serves `/metrics` from its HTTP process with prometheus-client in multiprocess mode: it
sets `PROMETHEUS_MULTIPROC_DIR` before it starts the scheduler, every process writes its series
to files there, and the HTTP process merges them at scrape time. The extension's events happen in
the scheduler process (fusion plans and forwards, the chunk store, the disk tier's threads), so
the series are created there, by the assembly, and only when SGLang's metrics are on: with
metrics off `process_metrics()` is None and every part handed None skips its updates. The
series observed in the HTTP process itself (fused TTFT, shadow checks) are
`metrics/http_process_metrics.py`.

Names follow SGLang's own series: the `sglang:` prefix, counters ending in `_total`, units in the
name (`_seconds`, `_bytes`), the `model_name` and `tp_rank` labels of SGLang's scheduler series
(plus SGLang's `--extra-metric-labels`), and one label per dimension (`selector`, `reason`,
`tier`, `group`, `kind`). Gauges are per process (`tp_rank`), merged `mostrecent` as SGLang's
are. The JSON routes (`/server_info`, `/chunks`, `/hicache_ext/storage`) report the same counts
for humans; `docs/reference.md` lists every series (rendered from these objects).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

PREFIX = "sglang:hicache_ext_"
# Host memory's counts exported as `chunk_host_decisions_total{decision}`.
HOST_DECISIONS = (
    "admitted_by_frequency",
    "admitted_by_recency",
    "refused_by_frequency",
    "evictions",
    "compressed_to_int8",
    "compressed_to_int4",
    "compression_refused",
)
CHUNK_STORE_TIER = "host"  # registered chunks' KV lives in host memory (tiers/chunks/host_cache.py)

# Seconds of one fused prefill on CPU and GPU: milliseconds (small prompts, GPU) to minutes
# (long prompts on a CPU).
PREFILL_SECONDS_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
RECOMPUTE_RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)


class ExtensionMetrics:
    """Every series of the extension, labelled for one scheduler process."""

    def __init__(self, labels: Mapping[str, str], registry: Any = None) -> None:
        # Imported here: prometheus-client picks its multiprocess value class at import, after
        # SGLang has set PROMETHEUS_MULTIPROC_DIR.
        from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

        self.labels = dict(labels)
        base = list(self.labels)
        where: CollectorRegistry = registry if registry is not None else REGISTRY

        def counter(name: str, doc: str, *extra: str) -> Counter:
            return Counter(f"{PREFIX}{name}", doc, [*base, *extra], registry=where)

        def gauge(name: str, doc: str, label: str) -> Gauge:
            # One value per scheduler process (tp_rank): the latest write wins, as SGLang's own.
            return Gauge(
                f"{PREFIX}{name}",
                doc,
                [*base, label],
                multiprocess_mode="mostrecent",
                registry=where,
            )

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                f"{PREFIX}{name}", doc, [*base, "selector"], buckets=buckets, registry=where
            )

        self._fused = counter(
            "fused_requests_total", "Requests whose prefill ran through chunk fusion.", "selector"
        )
        self._reused = counter(
            "fusion_tokens_reused_total",
            "Chunk tokens of fused prefills whose stored KV was reused (not recomputed).",
            "selector",
        )
        self._recomputed = counter(
            "fusion_tokens_recomputed_total",
            "Tokens of fused prefills computed by the model: text tokens and the selected chunk "
            "tokens.",
            "selector",
        )
        self._fallbacks = counter(
            "fusion_fallbacks_total",
            "Requests that asked for fusion and got SGLang's normal prefill, by reason "
            "(docs/fusion-sglang.md, Fallbacks).",
            "reason",
        )
        self._prefill_seconds = histogram(
            "fused_prefill_seconds",
            "Scheduler wall time of one fused request's prefill forward: the fusion executor "
            "and the writes of its K/V into SGLang's pool (synchronized on CUDA). Not a TTFT: "
            "queueing, tokenizing and the response are in SGLang's time_to_first_token_seconds.",
            PREFILL_SECONDS_BUCKETS,
        )
        self._ratio = histogram(
            "fusion_recompute_ratio",
            "Recompute ratio each fused request used (its option, or the server default).",
            RECOMPUTE_RATIO_BUCKETS,
        )
        self._chunk_hits = counter(
            "chunk_hits_total",
            "Chunks matched in a prompt by a fusion plan and found in the tier.",
            "tier",
        )
        self._chunk_misses = counter(
            "chunk_misses_total",
            "Chunks matched in a prompt by a fusion plan but gone from the tier (evicted or "
            "deleted since the match).",
            "tier",
        )
        self._chunk_read_bytes = counter(
            "chunk_read_bytes_total",
            "KV bytes of the chunk spans fusion plans took from the tier.",
            "tier",
        )
        self._chunk_stored_bytes = gauge(
            "chunk_stored_bytes", "KV bytes of registered chunks held in the tier.", "tier"
        )
        self._disk_hits = counter(
            "disk_hits_total", "Pages read from the disk tier into host memory.", "group"
        )
        self._disk_read_bytes = counter(
            "disk_read_bytes_total", "Bytes of pages read from the disk tier.", "group"
        )
        self._disk_written_bytes = counter(
            "disk_written_bytes_total", "Bytes of pages written to the disk tier.", "group"
        )
        self._disk_expired = counter(
            "disk_expired_pages_total",
            "Pages removed from the disk tier at their TTL (by the purge, on an access, or when "
            "the store opens).",
            "group",
        )
        self._replans = counter(
            "ttl_replans_total",
            "Group TTL plans published by the disk tier (every ttl_period_s, or when POST "
            '/hicache_ext/storage/ttl {"replan": true} asks).',
        )
        self._ttl_seconds = gauge(
            "ttl_seconds",
            "Current TTL of a disk tier group, from the last plan or an operator's override; "
            'group="default" is the TTL of every group the plan does not list.',
            "group",
        )
        self._storage_errors = counter(
            "storage_errors_total",
            "Disk tier faults answered as misses, by kind: the keys of GET "
            "/hicache_ext/storage errors (entry-point exceptions as exception.<entry point>) "
            "and the page store's write_errors, corrupt_pages, io_errors.",
            "kind",
        )
        self._auto_chunks = counter(
            "auto_chunks_total",
            "Pieces of prompts auto_chunks looked at, by outcome: captured (kept as a chunk), "
            "covered (a stored chunk covers it), over_cap (auto_chunks_per_minute reached), "
            "partly_covered (a variant of a stored piece: another label, a word changed), "
            "not_computed (a fused prefill reused part of it), refused (admission), "
            "ranks_disagree, failed (no tier took it).",
            "outcome",
        )
        self._auto_chunk_tokens = counter(
            "auto_chunk_tokens_captured_total", "Tokens of the pieces auto_chunks kept."
        )
        self._host_decisions = counter(
            "chunk_host_decisions_total",
            "Chunks that did not fit in host memory's free bytes, by decision (chunk_admission):"
            " admitted_by_frequency (seen more often than each chunk it evicted), "
            "admitted_by_recency (the adaptive rule following recency), refused_by_frequency "
            "(refused at the door); evictions: chunks host memory dropped for another; "
            "compressed_to_int8 / compressed_to_int4: chunks compressed to make room "
            "(chunk_retention utility); compression_refused: compressions over "
            "chunk_retention_max_kv_error, not kept.",
            "decision",
        )
        self._host_decision_counts = CountMirror()
        self._host_bytes_by_form = gauge(
            "chunk_host_bytes_by_form",
            'KV bytes host memory holds per form ("none": dense rows; int8, int4: compressed '
            "by chunk_retention utility or registered so).",
            "form",
        )
        self._shared_found = counter(
            "shared_chunks_found_total",
            "Chunks other servers stored in the shared tier (registered or kept by auto_chunks) "
            "and announced in its catalogue, indexed by this server: summed over a fleet's "
            "servers, how far documents travel between them.",
        )
        self._context_variants = counter(
            "fusion_context_variants_total",
            "Documents' rows a shadow check computed in their prompt, kept for the same "
            "document set (fusion_shadow_refresh), by outcome: kept, used (read by a fused "
            "prompt of that set instead of the stored chunk), evicted (LRU beyond "
            "fusion_context_variant_bytes), failed (logged; the batch went on).",
            "outcome",
        )
        self._target_ratio = gauge(
            "fusion_target_ratio",
            'Recompute ratio "auto" uses for chunks of a tier with a token-agreement target '
            "(fusion_target_agreement), as the shadow checks move it.",
            "tier",
        )
        # Series that exist from the start (0), so that a rate over them is defined at once.
        for series in (self._chunk_hits, self._chunk_misses, self._chunk_read_bytes):
            series.labels(**self.labels, tier=CHUNK_STORE_TIER)

    # -- fusion -----------------------------------------------------------------------------

    def fused_request(
        self,
        selector: str,
        recompute_ratio: float,
        tokens_reused: int,
        tokens_recomputed: int,
        prefill_s: float,
    ) -> None:
        labels = {**self.labels, "selector": selector}
        self._fused.labels(**labels).inc()
        self._reused.labels(**labels).inc(tokens_reused)
        self._recomputed.labels(**labels).inc(tokens_recomputed)
        self._prefill_seconds.labels(**labels).observe(prefill_s)
        self._ratio.labels(**labels).observe(recompute_ratio)

    def target_ratio(self, tier: str, ratio: float) -> None:
        self._target_ratio.labels(**self.labels, tier=tier).set(ratio)

    def fusion_fallback(self, reason: str) -> None:
        self._fallbacks.labels(**self.labels, reason=reason).inc()

    def chunk_hit(self, nbytes: int, tier: str = CHUNK_STORE_TIER) -> None:
        self._chunk_hits.labels(**self.labels, tier=tier).inc()
        self._chunk_read_bytes.labels(**self.labels, tier=tier).inc(nbytes)

    def chunk_miss(self, tier: str = CHUNK_STORE_TIER) -> None:
        self._chunk_misses.labels(**self.labels, tier=tier).inc()

    def host_bytes_by_form(self, nbytes: Mapping[str, int]) -> None:
        for form in ("none", "int8", "int4"):
            self._host_bytes_by_form.labels(**self.labels, form=form).set(nbytes.get(form, 0))

    def chunk_stored_bytes(self, nbytes: int, tier: str = CHUNK_STORE_TIER) -> None:
        self._chunk_stored_bytes.labels(**self.labels, tier=tier).set(nbytes)

    def host_decisions(self, counts: Mapping[str, int]) -> None:
        """Host memory's running decision counts (`HOST_DECISIONS` of its stats): what grew
        since the last call is added to the counter."""
        for decision, grown in self._host_decision_counts.changes(counts).items():
            self._host_decisions.labels(**self.labels, decision=decision).inc(grown)

    def auto_chunk(self, outcome: str, num_tokens: int) -> None:
        self._auto_chunks.labels(**self.labels, outcome=outcome).inc()
        if outcome == "captured":
            self._auto_chunk_tokens.labels(**self.labels).inc(num_tokens)

    def context_variant(self, outcome: str) -> None:
        self._context_variants.labels(**self.labels, outcome=outcome).inc()

    def shared_chunks_found(self, count: int) -> None:
        self._shared_found.labels(**self.labels).inc(count)

    # -- disk tier ----------------------------------------------------------------------------

    def disk_read(self, group: str, nbytes: int) -> None:
        self._disk_hits.labels(**self.labels, group=group).inc()
        self._disk_read_bytes.labels(**self.labels, group=group).inc(nbytes)

    def disk_written(self, group: str, nbytes: int) -> None:
        self._disk_written_bytes.labels(**self.labels, group=group).inc(nbytes)

    def disk_expired(self, group: str, pages: int = 1) -> None:
        self._disk_expired.labels(**self.labels, group=group).inc(pages)

    def ttl_replans(self, plans: int) -> None:
        self._replans.labels(**self.labels).inc(plans)

    def ttl_seconds(self, ttls: Mapping[str, float]) -> None:
        """The current TTL per group (`default`: every group the table does not list)."""
        for group, seconds in ttls.items():
            self._ttl_seconds.labels(**self.labels, group=group).set(seconds)

    def storage_error(self, kind: str, count: int = 1) -> None:
        self._storage_errors.labels(**self.labels, kind=kind).inc(count)


class CountMirror:
    """Exports counts a core keeps itself (it imports no prometheus) as counter increments:
    each `changes` call returns what grew since the last call, per key."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}
        self._lock = threading.Lock()

    def changes(self, counts: Mapping[str, int]) -> dict[str, int]:
        grown: dict[str, int] = {}
        with self._lock:
            for key, value in counts.items():
                delta = int(value) - self._seen.get(key, 0)
                if delta > 0:
                    grown[key] = delta
                self._seen[key] = max(int(value), self._seen.get(key, 0))
        return grown


def process_metrics() -> ExtensionMetrics | None:
    """This scheduler process's series when SGLang's metrics are on, else None. Called once per
    scheduler, by the assembly (`sglang_ext/assembly.py`), after SGLang has published its
    configuration in the process; every part that counts is handed the result. The series get
    a registry of their own: in SGLang's multiprocess mode the values reach `/metrics` through
    the files every process writes, so a second server built in one process (tests) does not
    collide with the first's names."""
    try:
        from sglang.srt.runtime_context import get_observability
    except ImportError:
        return None
    try:
        observability = get_observability()
    except ValueError:  # SGLang's configuration is not published in this process
        return None
    if not observability.enable_metrics:
        return None
    from prometheus_client import CollectorRegistry

    return ExtensionMetrics(_sglang_labels(observability), registry=CollectorRegistry())


def _sglang_labels(observability: Any) -> dict[str, str]:
    """The labels SGLang puts on its scheduler series: model name and tensor-parallel rank."""
    from sglang.srt.runtime_context import get_parallel, get_serving

    try:
        tp_rank = get_parallel().tp_rank
    except RuntimeError:  # rank never written in this process: a single-process engine
        tp_rank = 0
    labels = {"model_name": str(get_serving().served_model_name), "tp_rank": str(tp_rank)}
    labels.update({str(k): str(v) for k, v in (observability.extra_metric_labels or {}).items()})
    return labels
