"""Subtree groups: the top-K subtrees by reuse are groups, the rest is the residual group."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sglang_hicache_ext.radix.shared_prefix import subtree_roots

RESIDUAL_GROUP = "residual"
SHARED_PREFIX_GROUP = "shared-prefix"
_SUBTREE_PREFIX = "subtree:"


def subtree_group_name(root: str) -> str:
    return _SUBTREE_PREFIX + root


@dataclass(frozen=True)
class SubtreeGrouping:
    """Maps every page to a group name.

    Pages on the shared prefix form their own group (they are reused by every request, and one
    TTL for a handful of pages costs next to nothing); pages below it belong to their subtree's
    group when that subtree is in the top-K, else to the residual group.
    """

    spine: tuple[str, ...] = ()
    top_subtrees: frozenset[str] = frozenset()

    def group_of_root(self, root: str | None) -> str:
        if root is None:
            return SHARED_PREFIX_GROUP
        return subtree_group_name(root) if root in self.top_subtrees else RESIDUAL_GROUP

    def groups_of_path(self, path: Sequence[str]) -> list[str]:
        return [self.group_of_root(root) for root in subtree_roots(path, self.spine)]

    @property
    def group_names(self) -> list[str]:
        """All groups, top subtrees first (sorted), then shared prefix and residual."""
        names = [subtree_group_name(root) for root in sorted(self.top_subtrees)]
        return [*names, SHARED_PREFIX_GROUP, RESIDUAL_GROUP]


def select_top_subtrees(reuse_by_root: Mapping[str, int], k: int) -> frozenset[str]:
    """The `k` roots with most reuse events (ties by name, for determinism); zero reuse never."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    ranked = sorted((item for item in reuse_by_root.items() if item[1] > 0), key=_rank_key)
    return frozenset(root for root, _ in ranked[:k])


def _rank_key(item: tuple[str, int]) -> tuple[int, str]:
    return (-item[1], item[0])
