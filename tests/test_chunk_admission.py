"""The frequency sketch behind chunk admission (tiers/chunks/admission.py), without SGLang."""

from __future__ import annotations

import random

import pytest

from sglang_hicache_ext.tiers.chunks.admission import (
    MAX_COUNT,
    FrequencyAdmission,
    FrequencySketch,
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
    assert all(admission.admit(k, recent[0]) for k in seen_often)
    assert not admission.admit(recent[1], seen_often[0])
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
