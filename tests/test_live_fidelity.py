"""The shadow checks' window in the scheduler (`tuning/ratio/live_fidelity.py`), without SGLang:
the window keeps the latest checks, a malformed result is refused, and every ratio the target
reads or moves reaches the observer (the server's gauge)."""

from __future__ import annotations

import pytest

from sglang_hicache_ext.tuning.ratio.agreement_target import AgreementTarget
from sglang_hicache_ext.tuning.ratio.live_fidelity import LiveFidelity


def _check(agreement: float, ratio: float = 0.3, **extra: object) -> dict[str, object]:
    return {
        "token_agreement": agreement,
        "first_token_agree": agreement == 1.0,
        "recompute_ratio": ratio,
        **extra,
    }


def test_the_window_keeps_the_latest_checks() -> None:
    live = LiveFidelity(None, window=3)
    for agreement in (0.0, 1.0, 1.0, 0.7):
        assert live.record(_check(agreement, counts={"checked": 1})) == {"moved_to": None}
    status = live.status()
    assert status["samples"] == 3
    assert status["token_agreement"] == pytest.approx(0.9)
    assert status["first_token_agreement"] == pytest.approx(2 / 3)
    assert status["checks"] == {"checked": 1} and "target" not in status


def test_a_malformed_result_is_refused() -> None:
    with pytest.raises(ValueError, match="malformed shadow check result"):
        LiveFidelity(None, window=3).record({"token_agreement": "high"})


def test_the_observer_sees_every_ratio_the_target_gives() -> None:
    seen: list[tuple[str, float]] = []
    live = LiveFidelity(AgreementTarget(0.9), window=8, on_ratio=lambda t, r: seen.append((t, r)))
    ratio = live.ratio("host", floor=0.15, start=0.3)
    assert seen == [("host", ratio)] and 0.15 <= ratio <= 1.0
    for _ in range(40):  # perfect agreement at this ratio: the target lowers it in time
        moved = live.record(_check(1.0, ratio, ratio_tier="host", tier_ratio=ratio))["moved_to"]
        if moved is not None:
            assert seen[-1] == ("host", moved) and moved < ratio
            break
    else:
        pytest.fail("the target never moved the ratio on perfect agreement")
    assert live.status()["target"]["target"] == 0.9
