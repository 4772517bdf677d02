"""The extension's series on SGLang's Prometheus `/metrics` of real servers (`--enable-metrics`).

Fusion on the session HiCache server (tests/conftest.py); the scrape is parsed with
prometheus-client's own parser and compared as deltas around each request, since other tests
share the server.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.server

PREFIX = "sglang:hicache_ext_"
DOCUMENT = (
    "The Bell Rock Lighthouse stands on a reef eleven miles off the coast of Angus in Scotland. "
    "Robert Stevenson built it between 1807 and 1810; the reef is under water for all but a few "
    "hours each day, so the masons worked only at low tide and lived on a ship moored nearby. "
    "Its tower of granite and sandstone rises thirty-five metres, and its light, first lit in "
    "February 1811, was kept by three keepers at a time until it was automated in 1988."
)

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Series:
    """The extension's samples on `/metrics`: (sample name, sorted labels) -> value."""
    response = requests.get(f"{url}/metrics", timeout=30)
    response.raise_for_status()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        if family.name.startswith(PREFIX)
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


def total(series: Series, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(
        value
        for (sample, sample_labels), value in series.items()
        if sample == PREFIX + name and labels.items() <= dict(sample_labels).items()
    )


def moved(before: Series, after: Series, name: str, **labels: str) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


def print_series(
    title: str, series: Mapping[tuple[str, tuple[tuple[str, str], ...]], float]
) -> None:
    print(f"\n{title}")
    for (name, labels), value in sorted(series.items()):
        if not name.endswith("_bucket"):
            print(f"  {name}{{{', '.join(f'{k}={v!r}' for k, v in labels)}}} {value:g}")


def _generate(url: str, prompt: str, **custom: object) -> dict:
    body = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "custom_params": custom},
    }
    response = requests.post(f"{url}/generate", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


def test_fusion_series_count_a_fused_request_and_a_fallback(hicache_server) -> None:
    url = hicache_server.url
    registered = requests.post(f"{url}/chunks", json={"text": DOCUMENT}, timeout=120)
    assert registered.status_code == 200, registered.text
    # A prompt only this test sends, fused first: nothing of it is cached, so it is fused.
    prompt = f"Metrics check. Documents:\n{DOCUMENT}\n\nQuestion: who built the tower?\nAnswer:"
    before = scrape(url)
    out = _generate(url, prompt, fusion=True, fusion_selector="a3", fusion_recompute_ratio=0.15)
    (info,) = out["meta_info"]["hicache_ext_fusion"]
    assert info["fused"] is True and info["chunks_hit"] == 1, info
    fallback = _generate(url, "No registered chunk is in this sentence.", fusion=True)
    assert fallback["meta_info"]["hicache_ext_fusion"][0]["fallback"] == "no_chunk_matched"
    after = scrape(url)

    a3 = {"selector": "a3"}
    assert moved(before, after, "fused_requests_total", **a3) == 1
    assert moved(before, after, "fusion_tokens_reused_total", **a3) == info["tokens_reused"] > 0
    assert moved(before, after, "fusion_tokens_recomputed_total", **a3) == info["tokens_recomputed"]
    assert moved(before, after, "fused_prefill_seconds_count", **a3) == 1
    assert moved(before, after, "fused_prefill_seconds_sum", **a3) > 0
    assert moved(before, after, "fusion_recompute_ratio_count", **a3) == 1
    assert moved(before, after, "fusion_recompute_ratio_sum", **a3) == pytest.approx(0.15)
    assert moved(before, after, "fusion_fallbacks_total", reason="no_chunk_matched") == 1
    assert moved(before, after, "chunk_hits_total", tier="host") == 1
    assert moved(before, after, "chunk_read_bytes_total", tier="host") > 0
    assert total(after, "chunk_stored_bytes", tier="host") > 0
    # SGLang's own labels on every series of ours.
    labels = {dict(key[1]).get("tp_rank") for key in after}
    assert labels == {"0"}, labels
    assert all(dict(key[1]).get("model_name") for key in after)
    print_series("fusion series after the test:", after)
