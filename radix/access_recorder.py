"""Access recorder: per page, its subtree (hence group) and access times; per-group reuse intervals."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from sglang_hicache_ext.radix.groups import SubtreeGrouping, select_top_subtrees
from sglang_hicache_ext.radix.shared_prefix import (
    DEFAULT_MIN_SHARE,
    find_shared_prefix,
    subtree_roots,
)


class GroupReuse(NamedTuple):
    """Reuse statistics of one group in a window."""

    intervals: np.ndarray  # seconds between consecutive accesses of the same page, sorted
    unique_pages: int


class PageHistory(NamedTuple):
    subtree_root: str | None  # None: the page lies on the shared prefix
    times: tuple[float, ...]


@dataclass(frozen=True)
class WindowStats:
    """Grouping learnt from a window and the reuse of every group in it."""

    grouping: SubtreeGrouping
    reuse: dict[str, GroupReuse]
    start_s: float
    end_s: float
    accesses: int


class AccessRecorder:
    """Log of request page paths; derives groups and reuse intervals for any time window.

    Requests are kept whole because the shared prefix (and thus every page's subtree) is a
    property of the window, not of one request.
    """

    def __init__(self, min_share: float = DEFAULT_MIN_SHARE) -> None:
        self._min_share = min_share
        self._times: list[float] = []
        self._paths: list[tuple[str, ...]] = []
        self._page_accesses = 0

    def record_request(self, time_s: float, pages: Sequence[str]) -> None:
        if self._times and time_s < self._times[-1]:
            raise ValueError(f"requests must arrive in time order: {time_s} < {self._times[-1]}")
        path = tuple(pages)
        self._times.append(time_s)
        self._paths.append(path)
        self._page_accesses += len(path)

    def forget_before(self, time_s: float) -> None:
        """Drop requests older than `time_s` (bounded memory for a sliding window)."""
        cut = bisect.bisect_left(self._times, time_s)
        self._page_accesses -= sum(len(path) for path in self._paths[:cut])
        del self._times[:cut], self._paths[:cut]

    def __len__(self) -> int:
        return len(self._times)

    @property
    def page_accesses(self) -> int:
        """Page accesses of the recorded requests (the sum of their path lengths)."""
        return self._page_accesses

    def requests(self) -> list[tuple[float, tuple[str, ...]]]:
        """The recorded requests, oldest first (a copy)."""
        return list(zip(self._times, self._paths, strict=True))

    def page_history(
        self, page: str, start_s: float = -np.inf, end_s: float = np.inf
    ) -> PageHistory:
        times, paths = self._window(start_s, end_s)
        spine = find_shared_prefix(paths, self._min_share)
        root: str | None = None
        seen: list[float] = []
        for time_s, path in zip(times, paths, strict=True):
            if page in path:
                root = subtree_roots(path, spine)[path.index(page)]
                seen.append(time_s)
        return PageHistory(root, tuple(seen))

    def window_stats(
        self,
        k: int,
        start_s: float = -np.inf,
        end_s: float = np.inf,
        grouping: SubtreeGrouping | None = None,
        rank_from_s: float = -np.inf,
    ) -> WindowStats:
        """Top-`k` grouping of the requests in [start_s, end_s) and each group's reuse.

        Subtrees are ranked by their reuse events at or after `rank_from_s` (the recent part of
        the window: subtrees active now), while each group's intervals come from the whole window.
        With `grouping` given (e.g. learnt on an earlier window), pages are grouped by it instead.
        """
        times, paths = self._window(start_s, end_s)
        spine = grouping.spine if grouping else find_shared_prefix(paths, self._min_share)
        page_ids: dict[str, int] = {}
        root_ids: dict[str | None, int] = {None: 0}
        access_page: list[int] = []
        access_root: list[int] = []
        access_time: list[float] = []
        for time_s, path in zip(times, paths, strict=True):
            for page, root in zip(path, subtree_roots(path, spine), strict=True):
                access_page.append(page_ids.setdefault(page, len(page_ids)))
                access_root.append(root_ids.setdefault(root, len(root_ids)))
                access_time.append(time_s)
        pages = np.asarray(access_page, dtype=np.int64)
        roots = np.asarray(access_root, dtype=np.int64)
        stamps = np.asarray(access_time, dtype=np.float64)
        order = np.lexsort((stamps, pages))
        pages, roots, stamps = pages[order], roots[order], stamps[order]
        same_page = pages[1:] == pages[:-1]
        intervals = np.diff(stamps)[same_page]
        interval_roots = roots[1:][same_page]
        recent = stamps[1:][same_page] >= rank_from_s

        root_names = list(root_ids)
        reuse_per_root = np.bincount(interval_roots[recent], minlength=len(root_names))
        if grouping is None:
            reuse_by_root = {
                name: int(n) for name, n in zip(root_names, reuse_per_root, strict=True) if name
            }
            grouping = SubtreeGrouping(spine, select_top_subtrees(reuse_by_root, k))
        names = grouping.group_names
        group_index = {name: i for i, name in enumerate(names)}
        group_of_root = np.asarray(
            [group_index[grouping.group_of_root(name)] for name in root_names], dtype=np.int64
        )
        first_access = np.ones(len(pages), dtype=bool)
        first_access[1:] = ~same_page
        pages_per_group = np.bincount(group_of_root[roots[first_access]], minlength=len(names))
        interval_groups = group_of_root[interval_roots]
        reuse = {
            name: GroupReuse(np.sort(intervals[interval_groups == i]), int(pages_per_group[i]))
            for i, name in enumerate(names)
        }
        span = (stamps.min(), stamps.max()) if len(stamps) else (0.0, 0.0)
        return WindowStats(
            grouping=grouping,
            reuse=reuse,
            start_s=float(max(start_s, span[0])),
            end_s=float(min(end_s, span[1])),
            accesses=len(pages),
        )

    def _window(self, start_s: float, end_s: float) -> tuple[list[float], list[tuple[str, ...]]]:
        lo = bisect.bisect_left(self._times, start_s)
        hi = bisect.bisect_left(self._times, end_s)
        return self._times[lo:hi], self._paths[lo:hi]
