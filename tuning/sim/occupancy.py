"""Disk footprint of a TTL policy on a trace, to provision the disk volume."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sglang_hicache_ext.tuning.trace import SimRequest


def ttl_peak_blocks(requests: Sequence[SimRequest], ttl_s: float) -> int:
    """Peak number of distinct blocks alive on disk if every access refreshes a `ttl_s` expiry.

    A block occupies the disk from each access until min(access + ttl, its next access).
    """
    if not requests or ttl_s <= 0:
        return 0
    times = np.repeat(
        np.fromiter((r.arrival_s for r in requests), float, len(requests)),
        [len(r.blocks) for r in requests],
    )
    index: dict[str, int] = {}
    ids = np.fromiter(
        (index.setdefault(b, len(index)) for r in requests for b in r.blocks), dtype=np.int64
    )
    order = np.lexsort((times, ids))
    ids, times = ids[order], times[order]
    next_time = np.full(times.shape, np.inf)
    same = ids[1:] == ids[:-1]
    next_time[:-1][same] = times[1:][same]
    ends = np.minimum(times + ttl_s, next_time)
    events = np.concatenate((times, ends))
    steps = np.concatenate((np.ones(times.size), -np.ones(ends.size)))
    # At equal times, departures first: a refresh ends one segment where the next begins.
    order = np.lexsort((steps, events))
    return int(np.cumsum(steps[order]).max())
