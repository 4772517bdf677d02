"""Exclusive wall time per named stage, collected by wrapping functions in place.

`StageTimer.wrap(owner, name, stage)` replaces `owner.name` with a timed call; a call made
while another timed call is running is charged to its own stage and subtracted from the outer
one, except where it `inherits` (then the outer stage keeps it: RoPE inside a load is load).
`restore()` puts every original back. Nothing in the wrapped code changes. `clock` is wall time
by default; `time.thread_time` (CPU time of the calling thread) measures the work itself on a
machine shared with other jobs, when torch computes in that one thread.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any


class StageTimer:
    """Per-stage exclusive seconds over the calls made since `reset()`."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: defaultdict[str, int] = defaultdict(int)
        self._stack: list[list[Any]] = []  # [stage, started, child seconds]
        self._originals: list[tuple[Any, str, Any]] = []

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def wrap(self, owner: Any, name: str, stage: str, inherits: bool = False) -> None:
        own = vars(owner).get(name)  # None: inherited, or a bound method of an instance
        self._originals.append((owner, name, own))
        setattr(owner, name, self.timed(getattr(owner, name), stage, inherits))

    def timed(
        self, fn: Callable[..., Any], stage: str, inherits: bool = False
    ) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if inherits and self._stack:
                return fn(*args, **kwargs)
            frame = [stage, self.clock(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                total = self.clock() - frame[1]
                self.seconds[stage] += total - frame[2]
                self.calls[stage] += 1
                if self._stack:
                    self._stack[-1][2] += total

        return call

    def restore(self) -> None:
        for owner, name, own in reversed(self._originals):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
        self._originals.clear()
