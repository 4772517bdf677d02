"""What our controller passes with every storage write: one group and TTL per page."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sglang_hicache_ext.tuning.ttl.online import OnlineTtl

# Where the controller puts the per-page groups and TTLs of a write (HiCacheStorageExtraInfo).
WRITE_INFO_KEY = "hicache_ext"


@dataclass(frozen=True)
class PageWriteInfo:
    """One group and TTL per page of a batch write."""

    groups: tuple[str, ...]
    ttls_s: tuple[float, ...]

    @classmethod
    def of_pages(cls, online: OnlineTtl, keys: Sequence[str], extra_info: Any) -> PageWriteInfo:
        """The current groups and TTLs of `keys`; a page's group depends on its whole path, so
        the prefix keys SGLang passes in `extra_info` come first."""
        prefix = list(getattr(extra_info, "prefix_keys", None) or [])
        groups = online.groups_of(prefix + list(keys))[len(prefix) :]
        return cls(tuple(groups), tuple(online.ttl_of(g) for g in groups))


def passed_write_info(extra_info: Any) -> PageWriteInfo | None:
    """The `PageWriteInfo` our controller put into a write's extra info, if any."""
    extra = getattr(extra_info, "extra_info", None) or {}
    info = extra.get(WRITE_INFO_KEY)
    return info if isinstance(info, PageWriteInfo) else None
