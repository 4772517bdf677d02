"""The shared prefix (e.g. a system prompt) that (almost) every request starts with.

Groups are the subtrees at the first branching depth *below* this prefix: in a trace where every
request starts with the same block, grouping by the first block would put everything in one group.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

DEFAULT_MIN_SHARE = 0.9


def find_shared_prefix(
    paths: Sequence[Sequence[str]], min_share: float = DEFAULT_MIN_SHARE, max_depth: int = 256
) -> tuple[str, ...]:
    """Longest page path followed by at least `min_share` of all requests.

    Walks down from the root along the most common child while that child is still on the path of
    `min_share` of all requests; the result is empty when requests already diverge at page 0.
    """
    if not 0.0 < min_share <= 1.0:
        raise ValueError(f"min_share must be in (0, 1], got {min_share}")
    needed = min_share * len(paths)
    followers: Sequence[Sequence[str]] = paths
    spine: list[str] = []
    for depth in range(max_depth):
        counts = Counter(path[depth] for path in followers if len(path) > depth)
        if not counts:
            break
        page, count = counts.most_common(1)[0]
        if count < needed:
            break
        spine.append(page)
        followers = [path for path in followers if len(path) > depth and path[depth] == page]
    return tuple(spine)


def divergence_depth(path: Sequence[str], spine: Sequence[str]) -> int:
    """Index of the first page of `path` that is not on the spine."""
    for depth, page in enumerate(path):
        if depth >= len(spine) or page != spine[depth]:
            return depth
    return len(path)


def subtree_roots(path: Sequence[str], spine: Sequence[str]) -> list[str | None]:
    """Per page of `path`: the root page of its subtree, or None for pages on the spine."""
    depth = divergence_depth(path, spine)
    root = path[depth] if depth < len(path) else None
    return [None] * depth + [root] * (len(path) - depth)
