"""Budgets: users give average disk bytes; the optimiser works in page-seconds over a window."""

from __future__ import annotations

import math


def average_pages(avg_disk_bytes: float, bytes_per_page: int) -> float:
    """Average bytes on disk as an average number of resident pages."""
    if not math.isfinite(avg_disk_bytes) or avg_disk_bytes < 0:
        raise ValueError(f"disk budget must be finite and >= 0 bytes, got {avg_disk_bytes}")
    if bytes_per_page <= 0:
        raise ValueError(f"bytes_per_page must be > 0, got {bytes_per_page}")
    return avg_disk_bytes / bytes_per_page


def page_seconds(avg_pages: float, window_s: float) -> float:
    """Budget B of Algorithm 2 for a window: sum_g C_g(t_g) <= B keeps the window's average."""
    if avg_pages < 0 or window_s < 0:
        raise ValueError("average pages and window length must be >= 0")
    return avg_pages * window_s


def paced_ttl(budget_pages: float, page_writes: int, elapsed_s: float, max_ttl_s: float) -> float:
    """A TTL that keeps the disk near the budget before any history exists (Little's law).

    Pages written at rate w and kept t seconds each occupy w * t pages on average, so
    t = budget / w with w measured since the start. Counting every write (refreshes included)
    overstates the occupancy, which errs on the side of the budget.
    """
    if page_writes <= 0:
        return 0.0 if elapsed_s <= 0 else max_ttl_s
    return float(min(max_ttl_s, budget_pages * max(elapsed_s, 0.0) / page_writes))
