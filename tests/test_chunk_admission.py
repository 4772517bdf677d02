"""Chunk admission without SGLang: the frequency sketch (tiers/chunks/admission.py) and host
memory's admission by it (tiers/chunks/host_cache.py)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from sglang_hicache_ext.tiers.chunks.admission import (
    LEAD_MEMORY,
    MAX_COUNT,
    WARM_UP_CAP,
    WARM_UP_LEADS,
    FrequencyAdmission,
    FrequencySketch,
    StoreShadow,
    digest_of,
)
from sglang_hicache_ext.tiers.chunks.host_cache import (
    HostCacheFullError,
    HostChunkCache,
    NotAdmittedError,
)


def test_counts_sights_exactly_without_collisions() -> None:
    sketch = FrequencySketch.for_entries(1024)
    assert sketch.estimate("never") == 0
    for n in range(1, 6):
        sketch.record("doc")
        assert sketch.estimate("doc") == n  # the first sight in the doorkeeper, then counters
    for _ in range(40):
        sketch.record("doc")
    assert sketch.estimate("doc") == MAX_COUNT + 1  # counters saturate


def test_popular_documents_outrank_a_long_tail_of_one_offs() -> None:
    # 40 Zipf-popular documents among 20,000 pieces seen once, as issue 56's traces.
    rng = random.Random(0)
    popular = [f"popular-{i}" for i in range(40)]
    weights = [1 / (i + 1) for i in range(40)]
    sketch = FrequencySketch.for_entries(4096)
    one_offs = []
    for step in range(20_000):
        if step % 5 == 0:
            sketch.record(rng.choices(popular, weights)[0])
        else:
            one_offs.append(f"once-{step}")
            sketch.record(one_offs[-1])
    recent = one_offs[-2000:]  # within the window that decides
    tail_mean = sum(sketch.estimate(k) for k in recent) / len(recent)
    assert tail_mean < 1.05  # measured 1.001: collisions add little to a single sight
    seen_often = popular[:10]
    assert min(sketch.estimate(k) for k in seen_often) >= 3
    admission = FrequencyAdmission(sketch)
    assert all(admission.admit(k, [recent[0]]) for k in seen_often)
    assert not admission.admit(recent[1], [recent[2], seen_often[0]])
    assert (admission.admitted, admission.refused) == (10, 1)


def test_the_window_halves_counts_and_clears_the_doorkeeper() -> None:
    sketch = FrequencySketch(width=64, doorkeeper_bits=256, sample_size=20)
    for _ in range(9):
        sketch.record("doc")
    assert sketch.estimate("doc") == 9
    for i in range(11):  # the 20th sight ends the window
        sketch.record(f"other-{i}")
    assert sketch.halvings == 1
    assert sketch.estimate("doc") == 4  # (9 - 1) // 2 counted, the doorkeeper cleared
    assert sketch.sights == 10


def test_memory_is_fixed_whatever_the_number_of_keys() -> None:
    sketch = FrequencySketch.for_entries(10_000)
    before = sketch.memory_bytes
    for i in range(100_000):
        sketch.record(f"distinct-{i}")
    assert sketch.memory_bytes == before == 4 * 16384 + (1 << 21) // 8  # 64 KiB + 256 KiB


def test_state_survives_a_restart_and_refuses_foreign_bytes() -> None:
    sketch = FrequencySketch.for_entries(256)
    for i in range(500):
        sketch.record(f"k{i % 37}")
    again = FrequencySketch.from_bytes(sketch.to_bytes())
    assert all(again.estimate(f"k{i}") == sketch.estimate(f"k{i}") for i in range(60))
    assert again.sights == sketch.sights
    with pytest.raises(ValueError, match="bad magic"):
        FrequencySketch.from_bytes(b"XXXX" + sketch.to_bytes()[4:])
    with pytest.raises(ValueError, match="bytes of state"):
        FrequencySketch.from_bytes(sketch.to_bytes()[:-1])


@pytest.mark.parametrize(
    ("width", "door", "sample"), [(0, 64, 10), (100, 64, 10), (64, 100, 10), (64, 64, 0)]
)
def test_bad_sizes_are_refused(width: int, door: int, sample: int) -> None:
    with pytest.raises(ValueError):
        FrequencySketch(width=width, doorkeeper_bits=door, sample_size=sample)


@dataclass(frozen=True)
class _Blob:
    nbytes: int


def _host(capacity: int) -> HostChunkCache[_Blob]:
    return HostChunkCache(capacity, FrequencyAdmission.for_entries(64))


def test_host_memory_keeps_the_popular_chunk_against_a_one_off() -> None:
    host = _host(100)
    assert host.admission is not None
    for _ in range(3):
        host.admission.record("popular")
    host.admission.record("once")
    host.put("popular", _Blob(60), by_frequency=True)  # fits in the free bytes: no contest
    assert host.would_admit("once", 60) is False  # would evict a chunk seen three times
    with pytest.raises(NotAdmittedError, match="seen no more often"):
        host.put("once", _Blob(60), by_frequency=True)
    assert "popular" in host and "once" not in host
    host.put("small", _Blob(40), by_frequency=True)  # the free bytes are anyone's
    # A registration is explicit: admitted whatever its count, LRU evicting for it.
    assert host.put("registered", _Blob(60)) == ["popular"]
    stats = host.stats()
    assert (stats.refused_by_frequency, stats.admitted_by_frequency, stats.evictions) == (1, 0, 1)


def test_a_piece_seen_more_often_than_every_victim_takes_their_place() -> None:
    host = _host(100)
    assert host.admission is not None
    for key, sights in (("a", 1), ("b", 2), ("hot", 3)):
        for _ in range(sights):
            host.admission.record(key)
    host.put("a", _Blob(50), by_frequency=True)
    host.put("b", _Blob(50), by_frequency=True)
    # Needs both places: b was seen twice, hot three times; hot wins both.
    assert host.would_admit("hot", 100)
    assert host.put("hot", _Blob(100), by_frequency=True) == ["a", "b"]
    host.pin("hot")  # a pinned chunk is no victim: nothing can make room
    host.admission.record("hotter")
    assert host.would_admit("hotter", 10) is False
    with pytest.raises(HostCacheFullError, match="pinned"):
        host.put("hotter", _Blob(10), by_frequency=True)
    assert host.stats().admitted_by_frequency == 1


def test_without_admission_every_piece_evicts_by_recency() -> None:
    host: HostChunkCache[_Blob] = HostChunkCache(100)  # chunk_admission: "lru"
    host.put("a", _Blob(60), by_frequency=True)
    assert host.would_admit("b", 60)
    assert host.put("b", _Blob(60), by_frequency=True) == ["a"]


def _replay(admission: FrequencyAdmission, prompts: list[list[str]]) -> None:
    for prompt in prompts:
        admission.record_prompt([(key, 10) for key in prompt])


def test_adaptive_admission_follows_recency_where_reuse_is_a_second_sight() -> None:
    """A conversation: each turn's piece is seen again in the next turn, then never. By
    frequency each new piece ties with the pieces it would evict (all seen once) and is
    refused, so the next turn finds nothing; the adaptive admission's shadows see the
    recency rule serve those second sights and it admits every piece, counted as such."""
    adaptive = FrequencyAdmission.for_entries(64, capacity_bytes=30)
    turns = [[f"turn{t}", f"turn{t + 1}"] for t in range(40)]
    _replay(adaptive, turns)
    frequency, recency = adaptive.shadows["frequency"], adaptive.shadows["recency"]
    assert recency.hit_bytes > 0 and frequency.hit_bytes < recency.hit_bytes / 2
    assert adaptive.mode == "recency"
    host = HostChunkCache(30, adaptive)
    for key in ("a", "b", "c"):
        host.put(key, _Blob(10), by_frequency=True)
    assert host.put("turn41", _Blob(10), by_frequency=True) == ["a"]
    stats = host.stats()
    assert (stats.admitted_by_recency, stats.admitted_by_frequency) == (1, 0)


def test_adaptive_admission_follows_frequency_where_one_offs_would_push_popular_out() -> None:
    adaptive = FrequencyAdmission.for_entries(64, capacity_bytes=30)
    _replay(adaptive, [["popular", f"once{i}", f"other{i}", "hot"] for i in range(40)])
    assert adaptive.shadows["frequency"].hit_bytes > adaptive.shadows["recency"].hit_bytes
    assert adaptive.mode == "frequency"
    assert not adaptive.admit("once99", ["popular"], count=False)


def test_adaptive_shadows_stay_within_the_budget_and_their_lead_is_recent() -> None:
    """Seven keys of 10 bytes in a budget of 100, over and over: the shadows hold them all,
    and what each served is a decayed sum over about LEAD_MEMORY x 8 recent sights, so it
    settles at 10 x (1 / (1 - decay) - 1) = 310 instead of growing with the run."""
    adaptive = FrequencyAdmission.for_entries(64, capacity_bytes=100)
    _replay(adaptive, [[f"k{i % 7}"] for i in range(5000)])
    for shadow in adaptive.shadows.values():
        assert shadow.used <= 100 and len(shadow.entries) == 7
    decay = 1 - 1 / (LEAD_MEMORY * 8)
    assert adaptive.shadows["recency"].hit_bytes == pytest.approx(10 * decay / (1 - decay))
    with pytest.raises(ValueError, match="capacity_bytes"):
        FrequencyAdmission.for_entries(64, capacity_bytes=0)


def test_shadow_with_a_disk_below_serves_what_host_memory_wrote_through() -> None:
    """Host memory for one piece, a disk tier for ten: every piece host memory took is found
    below after host memory evicted it, and promoted back; one refused at host memory's door
    never reaches the disk."""
    sketch = FrequencySketch.for_entries(64)
    recency = StoreShadow(10, by_frequency=False, lower_bytes=100)
    for key in ("a", "b", "a"):  # a evicted from host memory by b, then found on disk
        sketch.record(key)
        recency.sight(digest_of(key), 10, sketch)
    assert recency.hit_bytes == 10 and list(recency.entries) == [digest_of("a")]
    assert recency.lower is not None and len(recency.lower.entries) == 2
    frequency = StoreShadow(10, by_frequency=True, lower_bytes=100)
    for key in ("a", "a", "b", "b", "c"):  # c was seen once: refused, not written below
        sketch.record(key)
        frequency.sight(digest_of(key), 10, sketch)
    assert frequency.lower is not None and digest_of("c") not in frequency.lower.entries


def test_adaptive_admission_stays_with_frequency_while_its_shadows_fill() -> None:
    """The conversation above, where recency serves more: for its first WARM_UP_LEADS lead
    spans of sights (LEAD_MEMORY x the entries held: 2 x 4 x 8 = 64 here) the rule is
    frequency's, however the shadows' lead stands; then recency's. A small sketch caps the
    warm-up (a sixteenth of its width in sights)."""
    adaptive = FrequencyAdmission.for_entries(4096, capacity_bytes=30)
    turns = [[f"turn{t}", f"turn{t + 1}"] for t in range(40)]
    _replay(adaptive, turns[:31])  # 62 sights
    assert adaptive.shadows["recency"].hit_bytes > adaptive.shadows["frequency"].hit_bytes
    assert adaptive.mode == "frequency"
    _replay(adaptive, turns[31:])
    assert adaptive.sights == 80 >= WARM_UP_LEADS * LEAD_MEMORY * 8
    assert adaptive.mode == "recency"
    small = FrequencyAdmission.for_entries(256, capacity_bytes=30)
    _replay(small, turns[:9])  # 18 sights >= 256 / WARM_UP_CAP
    assert small.mode == "recency" and small.sketch.width // WARM_UP_CAP <= small.sights == 18


def test_a_stored_key_is_estimated_by_the_key_its_sights_are_counted_under() -> None:
    """A piece stored under one id ("Document 3. " + text) and seen under its content's key:
    as a victim it is as often seen as that content, so a candidate seen once does not
    evict it; an id never named is estimated by itself."""
    admission = FrequencyAdmission.for_entries(64)
    for _ in range(3):
        admission.record_prompt([("sight:text", 10), ("sight:once", 10)])
    admission.record_prompt([("sight:new", 10)])
    assert not admission.admit("stored-id", ["other-id"], count=False)  # 0 > 0: refused
    admission.count_as("stored-id", "sight:text")
    admission.count_as("candidate-id", "sight:new")
    assert not admission.admit("candidate-id", ["stored-id"], count=False)  # 1 vs 3
    assert admission.admit("stored-id", ["candidate-id"], count=False)  # 3 vs 1
    assert admission.admit("candidate-id", ["never-named"], count=False)  # 1 vs 0
