"""The extension's series on SGLang's Prometheus `/metrics` of real servers (`--enable-metrics`).

Fusion on the session HiCache server, the disk tier on the session disk-tier server (both in
tests/conftest.py, shared with other modules). The scrape is parsed with prometheus-client's own
parser and compared as deltas around the requests.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from sglang_hicache_ext.sglang_ext.server.launcher import flush_cache
from tests.conftest import generate
from tests.test_server_disk_tier import _prompt, _status

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
    # TTFT, observed in the HTTP process where SGLang measures its own: the fused request only,
    # and never less than the scheduler's time for its fused prefill.
    assert moved(before, after, "fused_time_to_first_token_seconds_count", **a3) == 1
    assert moved(before, after, "fused_time_to_first_token_seconds_sum", **a3) >= moved(
        before, after, "fused_prefill_seconds_sum", **a3
    )
    # SGLang's own labels on every series of ours: the scheduler's (model, tp_rank) on the
    # scheduler's series, the tokenizer's (model) on those of the HTTP process (the TTFT
    # histogram, the shadow checks).
    http_process = (PREFIX + "fused_time_to_first_token_seconds", PREFIX + "fusion_shadow_")
    ranks = {dict(key[1]).get("tp_rank") for key in after if not key[0].startswith(http_process)}
    assert ranks == {"0"}, ranks
    assert all(dict(key[1]).get("model_name") for key in after)
    print_series("fusion series after the test:", after)


def _wait_until_written(url: str, before: Series, timeout_s: float = 30.0) -> Series:
    """The scrape once page writes to the disk tier started and then stopped for a while."""
    deadline = time.monotonic() + timeout_s
    last = -1.0
    while time.monotonic() < deadline:
        series = scrape(url)
        written = moved(before, series, "disk_written_bytes_total")
        if written > 0 and written == last:
            return series
        last = written
        time.sleep(0.5)
    raise AssertionError(f"disk writes did not settle in {timeout_s} s ({last} bytes so far)")


def test_disk_tier_series_count_pages_written_and_read(disk_server) -> None:
    url = disk_server.url
    # The disk tier tests' shared prefix: their plan's shared-prefix group stays shared.
    prompt = _prompt("weather stations", sentences=24)
    flush_cache(url)
    before = scrape(url)
    first = generate(url, prompt, max_new_tokens=4)
    written = _wait_until_written(url, before)
    flush_cache(url)  # drops device and host; the disk tier stays
    again = generate(url, prompt, max_new_tokens=4)
    details = again["meta_info"]["cached_tokens_details"]
    assert details["storage"] > 0 and details["device"] == 0, details
    assert again["output_ids"] == first["output_ids"]
    time.sleep(0.6)  # > purge_interval_s: the maintenance thread exported the counts it keeps
    after = scrape(url)

    status = _status(url)
    page_bytes = status["ttl"]["bytes_per_page"]
    hits = moved(written, after, "disk_hits_total")
    assert hits * 16 >= details["storage"]  # pages of 16 tokens read for the storage hit
    assert moved(written, after, "disk_read_bytes_total") == hits * page_bytes > 0
    written_bytes = moved(before, written, "disk_written_bytes_total")
    assert written_bytes >= page_bytes and written_bytes % page_bytes == 0
    # Exported by the maintenance thread: the TTL table and the plan count, as the JSON route.
    assert total(after, "ttl_seconds", group="default") == status["ttl"]["ttls"]["default"]
    assert total(after, "ttl_replans_total") == status["ttl"]["plans"]
    hit_groups = {dict(labels)["group"] for name, labels in after if "disk_hits" in name}
    assert hit_groups and hit_groups <= set(status["ttl"]["page_accesses"]), hit_groups
    print_series("disk tier series after the test:", after)
