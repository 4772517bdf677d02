"""Pieces of a prompt (`radix/segments.py`): the same wherever a document sits."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_hicache_ext.radix.segments import SegmentRule, document_segments
from sglang_hicache_ext.sglang_ext.config.extra_config import SettingsError
from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings

BREAK = 0  # the test vocabulary's line break


def _paragraph(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(1, 50_000, n)]


def _pieces(ids: list[int], rule: SegmentRule | None = None) -> list[tuple[int, ...]]:
    rule = rule or SegmentRule()
    return [tuple(ids[s:e]) for s, e in document_segments(ids, {BREAK}, rule)]


@pytest.mark.parametrize("length", [40, 300, 2000])
@pytest.mark.parametrize("offset", [0, 1, 57, 999])
def test_a_paragraphs_pieces_do_not_depend_on_its_position(length: int, offset: int) -> None:
    rng = np.random.default_rng(length)
    doc = _paragraph(rng, length)
    alone = _pieces([BREAK, *doc, BREAK])
    around = _pieces([*_paragraph(rng, offset), BREAK, *doc, BREAK, *_paragraph(rng, 5)])
    assert alone and all(piece in around for piece in alone)
    assert sum(map(len, alone)) == length  # every token of the paragraph is in a piece


def test_long_paragraphs_are_cut_within_the_bounds_at_the_same_places() -> None:
    rule = SegmentRule(min_tokens=32, max_tokens=256, cut_every=64)
    doc = _paragraph(np.random.default_rng(1), 3000)
    spans = document_segments(doc, {BREAK}, rule)
    lengths = [e - s for s, e in spans]
    assert len(spans) > 3000 // 256
    assert all(rule.min_tokens <= n <= rule.max_tokens + rule.min_tokens for n in lengths)
    # A label before the paragraph changes only the first piece: the cuts are content's.
    labelled = _pieces([7, 8, 9, *doc], rule)
    assert set(_pieces(doc, rule)[1:]) <= set(labelled)


def test_short_paragraphs_and_break_runs_are_not_pieces() -> None:
    rng = np.random.default_rng(2)
    ids = [*_paragraph(rng, 10), BREAK, BREAK, *_paragraph(rng, 31), BREAK]
    assert document_segments(ids, {BREAK}) == []
    assert document_segments([], {BREAK}) == []


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"auto_chunk_min_tokens": 4}, "auto_chunk_min_tokens = 4 must be >= 8"),
        ({"auto_chunks_per_minute": 0}, "auto_chunks_per_minute = 0 must be positive"),
        (
            {"auto_chunk_min_tokens": 100, "auto_chunk_max_tokens": 150},
            "auto_chunk_max_tokens = 150 must be at least twice auto_chunk_min_tokens = 100",
        ),
        ({"auto_chunks": "yes"}, "auto_chunks = 'yes' should be of type bool"),
    ],
)
def test_bad_auto_chunk_settings_are_one_line(values: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError) as caught:
        ExtensionSettings(**values)
    assert str(caught.value) == message
