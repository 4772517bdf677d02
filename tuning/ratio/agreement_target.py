"""A recompute ratio per chunk tier that meets a token-agreement target, from live shadow checks.

The server's shadow checks (`sglang_ext/server/shadow_checks.py`) measure, for a sample of fused
requests, the share of served tokens that are the normal prefill's greedy choice
(`evaluation/token_agreement.py`). With `fusion_recompute_ratio: "auto"` and a target
(`fusion_target_agreement`), each tier's ratio follows those checks. Its floor is the ratio
"auto" gives the tier without a target (tuned, or self-tuned: `self_tuned.py`): from a fast tier
that is the model's quality floor, from a slow one the ratio where loading the reused rows stops
costing more than recomputing them, so going lower would cost fidelity and buy no time. It
starts there (or at a given start above it: a model with no measured floor starts at the
conservative ratio and only checks lower it) and moves only on evidence, judged once per block
of `min_samples` new checks at the current ratio (judging after every check of a sliding window
would trigger on noise far more often than one standard error says):

- raise when the checks at the current ratio agree less than the target by more than their
  standard error, by a step proportional to the gap (`gain`, clipped to [MIN_STEP, MAX_STEP]);
- lower when they agree more than target + margin by more than their standard error (the margin
  is the hysteresis: a ratio just above the target stays, so the ratio does not oscillate around
  it), never below the floor;
- otherwise hold; the checks at the current ratio keep sliding (`MAX_SAMPLES`), so a workload
  that changes later moves it again.

Each move starts a new sample (only checks of requests fused at the tier's current ratio count),
so a check that was queued while the ratio moved never pushes it twice. A floor that rises (a
slow tier's measured balance point moves with every timing) lifts the ratio only by MIN_STEP or
more, so timing noise does not keep wiping the sample. Thread-safe: the scheduler asks for
ratios, the control channel records checks.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from dataclasses import dataclass, field

# Defaults chosen on the retention harness's ratio curve (docs/fusion-quality.md, "Fidelity in
# production"): agreement moves ~0.3-0.5 per unit of ratio there, so a gap of 0.1 asks for a
# step of ~0.25.
DEFAULT_MARGIN = 0.05
DEFAULT_GAIN = 2.5
MIN_SAMPLES = 8
MAX_SAMPLES = 32
MIN_STEP = 0.02
MAX_STEP = 0.25
# The spread assumed of a window whose checks all agree equally (a standard error of 0 would
# let one lucky sample move the ratio).
MIN_SPREAD = 0.1


@dataclass
class _TierState:
    ratio: float
    floor: float
    samples: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    since_judged: int = 0  # checks since the last decision
    moves: int = 0


class AgreementTarget:
    """Per-tier ratios driven toward `target` token agreement by shadow checks."""

    def __init__(
        self,
        target: float,
        margin: float = DEFAULT_MARGIN,
        gain: float = DEFAULT_GAIN,
        min_samples: int = MIN_SAMPLES,
    ) -> None:
        if not 0.0 <= target <= 1.0:
            raise ValueError(f"the agreement target must be in [0, 1], got {target}")
        if not 0.0 <= margin <= 1.0 or gain <= 0 or min_samples < 2:
            raise ValueError("margin in [0, 1], gain > 0 and min_samples >= 2")
        self.target = target
        self.margin = margin
        self.gain = gain
        self.min_samples = min_samples
        self._tiers: dict[str, _TierState] = {}
        self._lock = threading.Lock()

    def ratio(self, tier: str, floor: float, start: float | None = None) -> float:
        """The tier's ratio now. `floor` is the ratio "auto" gives the tier without a target:
        the ratio never goes below it; the first call starts at `start` (default: the floor).
        A floor that rises by MIN_STEP or more above the ratio lifts it."""
        floor = round(floor, 2)
        with self._lock:
            state = self._tiers.get(tier)
            if state is None:
                begin = floor if start is None else max(floor, round(start, 2))
                state = self._tiers[tier] = _TierState(begin, floor)
            state.floor = floor
            if floor - state.ratio >= MIN_STEP:
                state.ratio = floor
                state.samples.clear()
                state.since_judged = 0
            return state.ratio

    def record(self, tier: str, ratio: float, agreement: float) -> float | None:
        """One check of a request fused at `ratio` whose chunks came mostly from `tier`.
        Returns the tier's new ratio when this check moved it, else None. A check taken at
        another ratio than the tier's current one (queued while it moved) is not counted."""
        if not 0.0 <= agreement <= 1.0:
            raise ValueError(f"token agreement must be in [0, 1], got {agreement}")
        with self._lock:
            state = self._tiers.get(tier)
            if state is None or not math.isclose(ratio, state.ratio, abs_tol=1e-9):
                return None
            state.samples.append(agreement)
            state.since_judged += 1
            if state.since_judged < self.min_samples:
                return None
            state.since_judged = 0
            return self._move(state)

    def _move(self, state: _TierState) -> float | None:
        n = len(state.samples)
        mean = statistics.fmean(state.samples)
        error = max(statistics.stdev(state.samples), MIN_SPREAD) / math.sqrt(n)
        if self.target - mean > error and state.ratio < 1.0:
            step = _clip(self.gain * (self.target - mean))
            new = min(1.0, state.ratio + step)
        elif mean - (self.target + self.margin) > error and state.ratio > state.floor:
            step = _clip(self.gain * (mean - self.target - self.margin))
            new = max(state.floor, state.ratio - step)
        else:
            return None
        state.ratio = round(new, 4)
        state.samples.clear()
        state.moves += 1
        return state.ratio

    def status(self) -> dict[str, object]:
        with self._lock:
            return {
                "target": self.target,
                "margin": self.margin,
                "tiers": {
                    tier: {
                        "ratio": state.ratio,
                        "floor": state.floor,
                        "samples_at_ratio": len(state.samples),
                        "agreement_at_ratio": statistics.fmean(state.samples)
                        if state.samples
                        else None,
                        "moves": state.moves,
                    }
                    for tier, state in self._tiers.items()
                },
            }


def _clip(step: float) -> float:
    return min(MAX_STEP, max(MIN_STEP, step))
