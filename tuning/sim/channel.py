"""One I/O channel shared by disk reads (prefetch) and write-through copies, FIFO."""

from __future__ import annotations


class IoChannel:
    """Bandwidth-limited FIFO: a transfer starts when the channel is free and it was asked for."""

    def __init__(self, bytes_per_s: float) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"channel bandwidth must be > 0, got {bytes_per_s!r}")
        self.bytes_per_s = bytes_per_s
        self.free_at = 0.0

    def backlog_s(self, now: float) -> float:
        return max(0.0, self.free_at - now)

    def reserve(self, now: float, nbytes: float) -> tuple[float, float]:
        """Queue a transfer asked for at `now`; returns its (start, end) times."""
        start = max(now, self.free_at)
        self.free_at = start + nbytes / self.bytes_per_s
        return start, self.free_at

    def release(self, end: float, until: float) -> None:
        """Cut short the last reservation (ending at `end`) at time `until`: its tail is unused."""
        if self.free_at == end:
            self.free_at = min(self.free_at, until)
