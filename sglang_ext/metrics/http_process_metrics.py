"""The extension's series observed in SGLang's HTTP process: the TTFT of fused requests (where
SGLang measures its own TTFT) and the shadow checks (which run there, `server/shadow_checks.py`).

The scheduler process's series are `metrics/prometheus_metrics.py`; both write to SGLang's
multiprocess directory and `/metrics` merges them. These are created by their users on first
use, with the labels of SGLang's HTTP-process series (`model_name`, no `tp_rank`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sglang_hicache_ext.sglang_ext.metrics.prometheus_metrics import (
    PREFIX,
    RECOMPUTE_RATIO_BUCKETS,
)

# Client-visible time to the first token of a fused request: tens of milliseconds on a GPU to
# minutes for long prompts on a CPU (SGLang's own TTFT histogram spans a similar range).
TTFT_SECONDS_BUCKETS = (
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
)  # fmt: skip


class FusedTtftMetrics:
    """The TTFT of fused requests, observed in SGLang's HTTP process, where TTFT is measured.

    Same clock and same moment as SGLang's `sglang:time_to_first_token_seconds` (its
    `TokenizerManager.collect_metrics`), split off for requests whose prefill was fused, so the
    two histograms compare directly.
    """

    def __init__(self, labels: Mapping[str, str], registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Histogram

        self.labels = dict(labels)
        self._ttft = Histogram(
            f"{PREFIX}fused_time_to_first_token_seconds",
            "Time to first token of requests whose prefill ran through chunk fusion (every "
            "round fused), as SGLang measures its time_to_first_token_seconds.",
            [*self.labels, "selector"],
            buckets=TTFT_SECONDS_BUCKETS,
            registry=registry if registry is not None else REGISTRY,
        )

    def observe(self, selector: str, seconds: float) -> None:
        self._ttft.labels(**self.labels, selector=selector).observe(seconds)


# Token agreement of one checked request: 16 served tokens move it in steps of 1/16.
AGREEMENT_BUCKETS = (0.25, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99, 1.0)


def ratio_bucket(ratio: float) -> str:
    """A recompute ratio as a label of few values (a label per exact ratio would let a moving
    target create a series per step): the upper bound of its RECOMPUTE_RATIO_BUCKETS bucket."""
    return f"{next(b for b in RECOMPUTE_RATIO_BUCKETS if ratio <= b + 1e-9):g}"


class ShadowCheckMetrics:
    """The shadow checks of fused answers (`server/shadow_checks.py`), in SGLang's HTTP process
    where they run: how many ran, were dropped or failed, and the agreement they measured by
    selector and ratio bucket."""

    def __init__(self, labels: Mapping[str, str], registry: Any = None) -> None:
        from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

        self.labels = dict(labels)
        where: CollectorRegistry = registry if registry is not None else REGISTRY
        by_kind = [*self.labels, "selector", "ratio_bucket"]
        self._checks = Counter(
            f"{PREFIX}fusion_shadow_checks_total",
            "Fused requests checked against the normal prefill (the prompt and served tokens "
            "prefilled with fusion off), by selector and recompute-ratio bucket.",
            by_kind,
            registry=where,
        )
        self._first_agree = Counter(
            f"{PREFIX}fusion_shadow_first_token_agreements_total",
            "Checked requests whose first served token is the normal prefill's greedy choice.",
            by_kind,
            registry=where,
        )
        self._agreement = Histogram(
            f"{PREFIX}fusion_shadow_token_agreement",
            "Per checked request: the share of its served tokens (the first "
            "fusion_shadow_tokens) that are the normal prefill's greedy choice.",
            by_kind,
            buckets=AGREEMENT_BUCKETS,
            registry=where,
        )
        self._dropped = Counter(
            f"{PREFIX}fusion_shadow_dropped_total",
            "Checks not run, by reason: queue_full (no spare capacity before fusion_shadow_queue "
            "filled), preempted (a user request came during the check, three times).",
            [*self.labels, "reason"],
            registry=where,
        )
        self._failed = Counter(
            f"{PREFIX}fusion_shadow_failed_total",
            "Checks whose normal prefill failed (logged; the checked request was answered).",
            [*self.labels],
            registry=where,
        )

    def checked(self, selector: str, ratio: float, agreement: float, first_token: bool) -> None:
        labels = {**self.labels, "selector": selector, "ratio_bucket": ratio_bucket(ratio)}
        self._checks.labels(**labels).inc()
        self._agreement.labels(**labels).observe(agreement)
        if first_token:
            self._first_agree.labels(**labels).inc()

    def dropped(self, reason: str) -> None:
        self._dropped.labels(**self.labels, reason=reason).inc()

    def failed(self) -> None:
        self._failed.labels(**self.labels).inc()
