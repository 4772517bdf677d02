"""The one TTL policy of the project: a TTL per group, expiry on write, refresh on access.

Used by the page store (`tiers/pages/page_store.py`), the trace replay (`tuning/ttl/replay.py`)
and any later simulator or SGLang storage backend, so that "when does a page expire" has a single
definition.

Semantics (those of Redis `EXPIRE`): every write *and* every read of a page sets its expiry to
`now + ttl(group)`. A new TTL table applies to pages from their next write or access on; pages
already stored keep the expiry they were given. A page is live while `now <= expiry`, so a page
re-accessed exactly `ttl` seconds after its last access is still a hit; this matches the
optimiser's H(t) = #{reuse intervals <= t}.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class TtlTable:
    """TTL in seconds per group; groups not listed (the residual group) get `default_ttl`."""

    default_ttl: float
    ttls: Mapping[str, float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for name, ttl in [("<default>", self.default_ttl), *self.ttls.items()]:
            if not math.isfinite(ttl) or ttl < 0:
                raise ValueError(f"TTL of group {name!r} must be finite and >= 0, got {ttl!r}")
        # Freeze a private copy: a caller mutating its dict must not change a published table.
        object.__setattr__(self, "ttls", MappingProxyType(dict(self.ttls)))

    def ttl(self, group: str) -> float:
        return self.ttls.get(group, self.default_ttl)

    def as_dict(self) -> dict[str, float]:
        return {"default": self.default_ttl, **self.ttls}


class TtlPolicy:
    """Thread-safe holder of the current `TtlTable`; computes expiries."""

    def __init__(self, table: TtlTable) -> None:
        self._table = table
        self._lock = threading.Lock()

    @property
    def table(self) -> TtlTable:
        return self._table

    def update(self, table: TtlTable) -> None:
        """Publish a new table (e.g. from the optimiser); applies to later writes/accesses."""
        with self._lock:
            self._table = table

    def ttl(self, group: str) -> float:
        return self._table.ttl(group)

    def expiry_on_access(self, group: str, now: float) -> float:
        """Expiry of a page of `group` written or read at `now` (refresh on access)."""
        return now + self._table.ttl(group)

    @staticmethod
    def is_live(expiry: float, now: float) -> bool:
        return now <= expiry
