"""The placement inside the server, core side: what real requests did with each chunk
(`ChunkUsage`), the probes and the quality they measure, and the host form of each chunk
chosen by Algorithm 1 over the forms' measured bytes, decode times and qualities."""

from __future__ import annotations

import itertools

import pytest

from sglang_hicache_ext.evaluation.answer_quality import mean_answer_f1
from sglang_hicache_ext.tuning.placement.host_forms import (
    CODEC_ORDER,
    ChunkForms,
    Timing,
    host_choices,
    plan_host_forms,
)
from sglang_hicache_ext.tuning.placement.probes import probe_questions
from sglang_hicache_ext.tuning.placement.usage import DECAY, ChunkUsage

DENSE = 100_000
NBYTES = {"none": DENSE, "int8": 27_000, "int4": 15_000}
DECODE_S = {"none": 0.0, "int8": 0.004, "int4": 0.005}
# A slow disk (0.1 s per dense chunk): host memory is worth filling.
TIMING = Timing(disk_bytes_per_s=1e6)
ROBUST = {"none": 1.0, "int8": 1.0, "int4": 0.95}
SENSITIVE = {"none": 1.0, "int8": 0.97, "int4": 0.5}


def _chunk(key: str, quality: dict[str, float], registered: str = "none") -> ChunkForms:
    forms = host_choices(registered)
    return ChunkForms(
        key,
        200,
        registered,
        {f: NBYTES[f] for f in forms},
        {f: DECODE_S[f] for f in forms},
        {f: quality[f] for f in forms},
    )


def test_usage_counts_reads_decays_them_and_keeps_recent_questions() -> None:
    usage = ChunkUsage(questions_kept=2, question_tokens=3)
    usage.record(["a", "b", "a"], [9, 1, 2, 3])  # one request reading a twice counts once
    usage.record(["a"], [4, 5])
    usage.record(["a"], [4, 5])  # the same question again is not kept twice
    usage.record(["a"], [6])
    assert usage.use("a") == (4, ((4, 5), (6,)))
    assert usage.use("b").questions == ((1, 2, 3),)  # the last 3 tokens: the question
    uses = usage.end_round(["a", "b", "c"])
    assert (uses["a"].frequency, uses["b"].frequency, uses["c"].frequency) == (4, 1, 0)
    usage.record(["b"], [])
    assert usage.use("a").frequency == pytest.approx(DECAY * 4)
    assert usage.use("b").frequency == pytest.approx(1 + DECAY * 1)
    usage.forget(["a"])
    assert usage.use("a") == (0.0, ())


def test_reads_after_a_rounds_snapshot_stay_in_the_next_round() -> None:
    usage = ChunkUsage()
    usage.record(["a"], [1])
    usage.record(["a"], [1])
    snapshot = usage.reads()  # what the round planned with
    usage.record(["a"], [1])  # read while the round profiled
    usage.end_round(["a"], snapshot)
    assert usage.use("a").frequency == pytest.approx(1 + DECAY * 2)


def test_probes_prefer_recorded_questions_and_quality_is_token_f1() -> None:
    templates = [[100], [101], [102]]
    assert probe_questions([[1], [2]], templates, count=2) == [[2], [1]]  # most recent first
    assert probe_questions([[1]], templates, count=2) == [[1], [100]]
    assert probe_questions([], templates, count=2) == [[100], [101]]
    assert mean_answer_f1(["Paris, France", "1969"], ["paris france", "1969"]) == 1.0
    assert mean_answer_f1(["the red fox", ""], ["a blue whale", ""]) == pytest.approx(0.5)
    assert mean_answer_f1(["red fox jumps"], ["red fox"]) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="as many answers"):
        mean_answer_f1(["a"], ["a", "b"])


def test_forms_never_go_back_to_less_compressed_rows() -> None:
    assert host_choices("none") == CODEC_ORDER
    assert host_choices("int8") == ("int8", "int4")
    with pytest.raises(ValueError, match="unknown registered form"):
        host_choices("zstd")


@pytest.mark.parametrize(
    ("host_chunks", "floor", "alpha"),
    list(itertools.product([0.0, 0.5, 1.5, 3.0, 10.0], [0.0, 0.9, 0.96, 1.0], [0.0, 20.0])),
)
def test_host_forms_respect_capacity_floor_and_popularity(
    host_chunks: float, floor: float, alpha: float
) -> None:
    chunks = [_chunk(f"r{i}", ROBUST) for i in range(3)] + [
        _chunk(f"s{i}", SENSITIVE) for i in range(3)
    ]
    frequencies = {"r0": 9.0, "r1": 3.0, "r2": 1.0, "s0": 9.0, "s1": 3.0, "s2": 1.0}
    capacity = int(host_chunks * DENSE)
    forms, placement = plan_host_forms(
        chunks, frequencies, TIMING, {"host": capacity, "disk": 10 * DENSE}, alpha, floor
    )
    quality = {c.chunk_id: c.quality for c in chunks}
    held = {key: form for key, form in forms.items() if form is not None}
    assert sum(NBYTES[form] for form in held.values()) <= capacity
    assert placement.used_bytes["host"] <= capacity
    assert all(quality[key][form] >= floor for key, form in held.items())
    # Among chunks alike but for their popularity, a more read one is never held in fewer
    # bytes (or not at all) while a less read one is held in more.
    size = {key: NBYTES[form] if form else 0 for key, form in forms.items()}
    for group in ("r", "s"):
        assert size[f"{group}0"] >= size[f"{group}1"] >= size[f"{group}2"]
    if host_chunks >= 10:  # room for everything: every chunk dense in host memory
        assert set(forms.values()) == {"none"}


def test_a_compression_robust_chunk_is_compressed_before_a_sensitive_one_leaves() -> None:
    chunks = [_chunk("robust", ROBUST), _chunk("sensitive", SENSITIVE)]
    forms, _ = plan_host_forms(
        chunks,
        {"robust": 1.0, "sensitive": 1.0},
        TIMING,
        {"host": DENSE + 30_000, "disk": 10 * DENSE},
        20.0,
        0.9,
    )
    assert forms == {"robust": "int8", "sensitive": "none"}


def test_a_chunk_registered_compressed_is_held_in_its_form_or_smaller() -> None:
    chunks = [_chunk("a", ROBUST, registered="int8"), _chunk("b", ROBUST, registered="int8")]
    # alpha 0: only the TTFT counts, and int4 decodes faster than the disk reads int8.
    forms, _ = plan_host_forms(
        chunks, {"a": 5.0, "b": 1.0}, TIMING, {"host": 27_000 + 15_000, "disk": 0}, 0.0, 0.9
    )
    assert forms == {"a": "int8", "b": "int4"}


def test_unprofiled_forms_are_not_offered() -> None:
    unprofiled = ChunkForms("c", 200, "none", NBYTES, DECODE_S, {})
    forms, _ = plan_host_forms(
        [unprofiled], {"c": 1.0}, TIMING, {"host": 50_000, "disk": DENSE}, 20.0, 0.0
    )
    assert forms == {"c": None}  # dense does not fit, int8 / int4 were never probed


def test_timing_must_be_positive() -> None:
    with pytest.raises(ValueError, match="disk_bytes_per_s must be > 0"):
        Timing(0.0)
