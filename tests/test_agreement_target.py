"""The ratio that meets a token-agreement target (tuning/ratio/agreement_target.py): it starts at
the tier's floor, moves only on evidence, settles near the target on a noisy workload, and never
counts a check taken at another ratio."""

from __future__ import annotations

import random
import statistics

import pytest

from sglang_hicache_ext.tuning.ratio.agreement_target import MIN_SAMPLES, AgreementTarget
from sglang_hicache_ext.tuning.ratio.self_tuned import (
    CHECKED_FLOOR,
    CONSERVATIVE_FLOOR,
    SelfTunedRatios,
)


def _workload(ratio: float, draw: random.Random) -> float:
    """One checked request's token agreement at `ratio`: the answer is the full prefill's with a
    probability that grows with the ratio (as on the harness's curve), else partly so."""
    same = 0.45 + 0.55 * ratio
    return 1.0 if draw.random() < same else draw.uniform(0.1, 0.9)


def _expected(ratio: float) -> float:
    same = 0.45 + 0.55 * ratio
    return same + (1 - same) * 0.5


@pytest.mark.parametrize("target", [0.85, 0.92])
def test_settles_near_the_target_within_a_hundred_checks(target: float) -> None:
    draw = random.Random(7)
    control = AgreementTarget(target)
    for _ in range(100):
        ratio = control.ratio("host", 0.15)
        control.record("host", ratio, _workload(ratio, draw))
    settled = control.ratio("host", 0.15)
    assert abs(_expected(settled) - target) <= 0.05
    # Held: the next 50 checks agree, on average, within 0.05 of the target.
    after = []
    for _ in range(50):
        ratio = control.ratio("host", 0.15)
        after.append(_workload(ratio, draw))
        control.record("host", ratio, after[-1])
    assert abs(statistics.fmean(after) - target) <= 0.05


def test_starts_at_the_floor_and_never_goes_below_it() -> None:
    control = AgreementTarget(0.5)
    assert control.ratio("disk", 0.4) == 0.4
    for _ in range(3 * MIN_SAMPLES):  # every check agrees: lower, but not below the floor
        control.record("disk", control.ratio("disk", 0.4), 1.0)
    assert control.ratio("disk", 0.4) == 0.4
    # A floor that rises (a slow tier's measured balance point) lifts the ratio with it.
    assert control.ratio("disk", 0.6) == 0.6


def test_raises_on_evidence_and_lowers_back_with_hysteresis() -> None:
    control = AgreementTarget(0.8, margin=0.05)
    ratio = control.ratio("host", 0.1)
    for _ in range(MIN_SAMPLES - 1):
        assert control.record("host", ratio, 0.5) is None  # too few checks to move
    raised = control.record("host", ratio, 0.5)
    assert raised is not None and raised > ratio
    # Between the target and target + margin: held however many checks come.
    for index in range(40):
        assert control.record("host", raised, 0.82 if index % 2 else 0.80) is None
    assert control.ratio("host", 0.1) == raised
    # Clearly above target + margin once the window is full of it: lowered toward the floor.
    moved = [control.record("host", raised, 1.0) for _ in range(32)]
    lowered = [ratio for ratio in moved if ratio is not None]
    assert len(lowered) == 1 and 0.1 <= lowered[0] < raised


def test_a_check_taken_at_another_ratio_is_not_counted() -> None:
    control = AgreementTarget(0.9)
    ratio = control.ratio("host", 0.2)
    for _ in range(3 * MIN_SAMPLES):
        assert control.record("host", ratio + 0.1, 0.0) is None  # queued before a move
        assert control.record("mooncake", ratio, 0.0) is None  # a tier never asked for
    assert control.status()["tiers"]["host"]["samples_at_ratio"] == 0
    assert control.ratio("host", 0.2) == ratio


@pytest.mark.parametrize("kwargs", [{"target": 1.5}, {"target": -0.1}, {"target": 0.5, "gain": 0}])
def test_refuses_bounds_outside_their_range(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        AgreementTarget(**kwargs)
    with pytest.raises(ValueError, match="token agreement"):
        AgreementTarget(0.5).record("host", 0.1, 1.5)


def test_a_model_without_a_measured_floor_starts_lower_when_checks_guard_it() -> None:
    # No measured floor: the conservative 0.3, or the papers' 0.15 when a target's live checks
    # raise the ratio where answers need it; a measured floor is kept either way.
    assert SelfTunedRatios.for_model("SmolLM2-135M-Instruct").floor == CONSERVATIVE_FLOOR
    assert SelfTunedRatios.for_model("SmolLM2-135M-Instruct", checked=True).floor == CHECKED_FLOOR
    measured = SelfTunedRatios.for_model("Qwen2.5-Coder-0.5B-Instruct", checked=True)
    assert measured.floor == SelfTunedRatios.for_model("Qwen2.5-Coder-0.5B-Instruct").floor
    assert measured.floor not in (CONSERVATIVE_FLOOR, CHECKED_FLOOR)
