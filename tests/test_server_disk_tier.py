"""End-to-end: the Kareto disk tier as SGLang's HiCache storage backend on a real CPU server.

Pages written through our controller carry their group; short TTLs expire on time; an expired
prefix is recomputed with the same output; a live prefix is served from disk with the same output.
The server is the session's `disk_server` (tests/conftest.py), shared with test_server_metrics.py.
"""

from __future__ import annotations

import time

import pytest
import requests

from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig, flush_cache
from tests.conftest import generate

pytestmark = pytest.mark.server

SYSTEM = "You are a careful archivist. Answer from the records below, briefly. " * 6


def _prompt(topic: str, sentences: int = 40) -> str:
    body = " ".join(
        f"Record {i} on {topic}: entry {i * 7 % 11} was filed in {1900 + i}."
        for i in range(sentences)
    )
    return f"{SYSTEM}\n{body}\nQuestion: what are these records about?\nAnswer:"


def _status(url: str, pages: int = 0) -> dict:
    response = requests.get(f"{url}/hicache_ext/storage", params={"pages": pages}, timeout=30)
    response.raise_for_status()
    return response.json()


def _set_ttls(url: str, body: dict) -> dict:
    response = requests.post(f"{url}/hicache_ext/storage/ttl", json=body, timeout=120)
    response.raise_for_status()
    return response.json()


def _wait_written(url: str, pages: int, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = _status(url, pages=10_000)
        if status["disk"]["entries"] >= pages:
            return status
        time.sleep(0.2)
    raise AssertionError(f"fewer than {pages} pages reached the disk tier: {status['disk']}")


def _groups(status: dict) -> set[str]:
    return {page["group"] for page in status["pages"]}


def _wait_for_groups(url: str, subtrees: int, timeout_s: float = 20.0) -> dict:
    """The storage status once the disk holds pages of the shared prefix and of `subtrees`
    subtree groups, or at the timeout (the caller's asserts say what is missing): HiCache
    writes pages through asynchronously, so one document's pages may land after the next
    request has returned."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = _status(url, pages=10_000)
        groups = _groups(status)
        subtree_groups = sum(g.startswith("subtree:") for g in groups)
        if "shared-prefix" in groups and subtree_groups >= subtrees:
            return status
        if time.monotonic() >= deadline:
            return status
        time.sleep(0.2)


def _wait_settled(url: str, quiet_s: float = 2.0, timeout_s: float = 30.0) -> None:
    """Until the disk tier has taken no page for `quiet_s`: HiCache writes pages through
    asynchronously, so an earlier test's last pages may still be on their way."""
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        disk = _status(url)["disk"]
        now = (disk["entries"], disk["used_bytes"])
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.2)
    raise AssertionError(f"the disk tier kept taking pages for {timeout_s} s: {last}")


def test_pages_carry_their_subtree_group(disk_server: ServerConfig) -> None:
    url = disk_server.url
    flush_cache(url)
    # Two hot documents behind one shared system prompt, each asked about several times.
    for _ in range(3):
        for topic in ("lighthouses", "glaciers"):
            generate(url, _prompt(topic), max_new_tokens=1)
    plan = _set_ttls(url, {"replan": True})
    assert plan["replanned"], plan
    ttl = plan["ttl"]
    assert ttl["last_plan"]["groups"] == 2, ttl["last_plan"]
    # The next accesses put the stored pages into their planned groups.
    for topic in ("lighthouses", "glaciers"):
        generate(url, _prompt(topic), max_new_tokens=1)
    status = _wait_for_groups(url, subtrees=2)
    groups = _groups(status)
    assert "shared-prefix" in groups, groups
    assert sum(g.startswith("subtree:") for g in groups) == 2, groups
    assert status["ttl"]["page_accesses"]["shared-prefix"] > 0
    assert status["errors"]["writes_without_groups"] == 0
    print(f"\ngroups on disk: {status['by_group']}; TTLs: {ttl['ttls']}")


def test_short_ttl_expires_on_time_and_expired_prefix_is_recomputed(
    disk_server: ServerConfig,
) -> None:
    url = disk_server.url
    ttl_s = 3.0
    # The previous test's pages keep their planned TTL: none may land after the change below.
    _wait_settled(url)
    _set_ttls(url, {"default_ttl_s": ttl_s, "ttls": {}})
    # Pages written or read from now on take the new TTL; pages the previous test wrote a few
    # seconds ago keep their planned one, so they are told apart by last access, not write time.
    changed_at = time.time()
    flush_cache(url)
    prompt = _prompt("harbour cranes")
    first = generate(url, prompt, max_new_tokens=12)
    key_pages = first["meta_info"]["prompt_tokens"] // 16
    status = _wait_written(url, pages=key_pages - 1)
    fresh = [p for p in status["pages"] if p["last_access"] >= changed_at]
    assert fresh
    for page in fresh:
        assert page["expiry"] - page["last_access"] == pytest.approx(ttl_s, abs=1e-3), page
    time.sleep(ttl_s + 1.5)  # past expiry, and a purge interval
    status = _status(url, pages=10_000)
    assert not [p for p in status["pages"] if p["key"] in {q["key"] for q in fresh}]
    assert status["disk"]["expired"] >= len(fresh)
    lifetimes = [p["expiry"] - p["last_access"] for p in fresh]
    print(
        f"\n{len(fresh)} pages, expiry - last access {min(lifetimes):.3f}..{max(lifetimes):.3f} s;"
        f" gone {ttl_s + 1.5:.1f} s later; expired count {status['disk']['expired']}"
    )

    flush_cache(url)
    again = generate(url, prompt, max_new_tokens=12)
    assert again["meta_info"]["cached_tokens"] == 0, again["meta_info"]
    assert again["output_ids"] == first["output_ids"]
    print("recomputed after expiry: cached_tokens=0, same output ids")


def test_live_prefix_is_served_from_disk_with_identical_output(disk_server: ServerConfig) -> None:
    url = disk_server.url
    _set_ttls(url, {"default_ttl_s": 600.0, "ttls": {}})
    flush_cache(url)
    prompt = _prompt("river barges")
    first = generate(url, prompt, max_new_tokens=12)
    prompt_tokens = first["meta_info"]["prompt_tokens"]
    _wait_written(url, pages=prompt_tokens // 16 - 1)
    before = _status(url)["ttl"]["hit_ratio"]["disk"]
    flush_cache(url)  # drops device and host; the disk tier stays
    from_disk = generate(url, prompt, max_new_tokens=12)
    details = from_disk["meta_info"]["cached_tokens_details"]
    assert details["storage"] > prompt_tokens // 2, details
    assert details["device"] == 0 and details["host"] == 0, details
    assert from_disk["output_ids"] == first["output_ids"]
    assert _status(url)["ttl"]["hit_ratio"]["disk"] > before
    print(f"\nfrom disk: {details} of {prompt_tokens} prompt tokens, same output ids")


def test_bad_ttl_request_is_rejected(disk_server: ServerConfig) -> None:
    url = disk_server.url
    response = requests.post(
        f"{url}/hicache_ext/storage/ttl", json={"default_ttl_s": -1}, timeout=30
    )
    assert response.status_code == 400
    assert "must be a finite number of seconds >= 0" in response.json()["error"]
    response = requests.post(f"{url}/hicache_ext/storage/ttl", json={"foo": 1}, timeout=30)
    assert response.status_code == 400
    assert generate(url, "Hello", max_new_tokens=2)["meta_info"]["prompt_tokens"] > 0
