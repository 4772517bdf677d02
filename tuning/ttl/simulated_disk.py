"""A TTL-governed disk simulated page by page: expiry on write and refresh on access, and an
optional hard capacity that evicts the soonest-expiring pages (as `tiers/pages/page_store.py` does).

Shared by the trace replay (the disk being measured) and the shadow guard (one simulated disk per
candidate planner, fed the same accesses), so both count a hit the same way.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from sglang_hicache_ext.tiers.pages.ttl_policy import TtlPolicy


class SimulatedDisk:
    """Pages on disk with their last access and expiry; counts hits and capacity evictions.

    With `keep_segments`, every residency segment [last access, min(expiry, next access)) is
    kept so that the caller can integrate the occupancy exactly (`segments`).
    """

    def __init__(self, capacity_pages: float = math.inf, keep_segments: bool = False) -> None:
        if not capacity_pages >= 0:
            raise ValueError(f"capacity_pages must be >= 0, got {capacity_pages}")
        self.capacity_pages = capacity_pages
        self.evictions = 0
        self._pages: dict[str, tuple[float, float]] = {}  # page -> (last access, expiry)
        self._keep_segments = keep_segments
        self._seg_start: list[float] = []
        self._seg_end: list[float] = []
        self._resident = 0
        self._heap: list[tuple[float, str]] = []  # (expiry, page); stale entries skipped

    def access(self, page: str, expiry: float, now: float) -> bool:
        """Read-or-write of `page` at `now`: whether it was live on disk, then (re)store it
        until `expiry`."""
        previous = self._pages.get(page)
        live = previous is not None and TtlPolicy.is_live(previous[1], now)
        if previous is not None and self._keep_segments:
            self._seg_start.append(previous[0])
            self._seg_end.append(min(previous[1], now))
        if not math.isinf(self.capacity_pages):
            # Account the pages that expired by now *before* this page's entry changes: its own
            # old heap entry must still match it to be counted as gone.
            self._expire(now)
        self._pages[page] = (now, expiry)
        if not math.isinf(self.capacity_pages):
            self._written(page, previous, expiry, now)
        return live

    def __len__(self) -> int:
        """Pages remembered (live, or expired and not yet forgotten)."""
        return len(self._pages)

    def forget_expired(self, now: float) -> None:
        """Drop pages expired before `now`: their next access is a miss either way. Keeps a
        long-running simulation (a live server's shadow) from growing with every page ever seen;
        not for a disk that keeps residency segments (they need each page's last access)."""
        if self._keep_segments:
            raise ValueError("a disk that keeps residency segments cannot forget pages")
        if not math.isinf(self.capacity_pages):
            self._expire(now)  # account them first: no live heap entry is left behind
        self._pages = {
            page: entry for page, entry in self._pages.items() if TtlPolicy.is_live(entry[1], now)
        }

    def segments(self, end_s: float) -> tuple[np.ndarray, np.ndarray]:
        """Residency segments so far, the open ones closed at min(expiry, `end_s`)."""
        starts = self._seg_start + [last for last, _ in self._pages.values()]
        ends = self._seg_end + [min(expiry, end_s) for _, expiry in self._pages.values()]
        return np.asarray(starts, dtype=float), np.asarray(ends, dtype=float)

    def _written(
        self, page: str, previous: tuple[float, float] | None, expiry: float, now: float
    ) -> None:
        was_resident = previous is not None and previous[1] >= now
        if expiry < now:  # kept for no time at all: not resident
            self._resident -= was_resident
            return
        if was_resident and previous is not None and previous[1] == expiry:
            return  # same expiry again: its heap entry still stands
        self._resident += not was_resident
        heapq.heappush(self._heap, (expiry, page))
        while self._resident > self.capacity_pages:
            soonest, victim = heapq.heappop(self._heap)
            entry = self._pages.get(victim)
            if entry is None or entry[1] != soonest:
                continue  # refreshed (or forgotten) since: a stale entry
            # Moving the expiry to just before now ends its residency and makes its next
            # access a miss.
            self._pages[victim] = (entry[0], float(np.nextafter(now, -np.inf)))
            self._resident -= 1
            self.evictions += 1

    def _expire(self, now: float) -> None:
        while self._heap and self._heap[0][0] < now:
            expiry, page = heapq.heappop(self._heap)
            entry = self._pages.get(page)
            if entry is not None and entry[1] == expiry:
                self._resident -= 1
