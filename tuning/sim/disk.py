"""The disk tier: capacity, TTL (via the project's `TtlPolicy`) or LRU, one shared I/O channel."""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict

from sglang_hicache_ext.tiers.pages.ttl_policy import TtlPolicy
from sglang_hicache_ext.tuning.sim.channel import IoChannel

_GROUP = "default"  # the simulator applies one TTL to all blocks: the residual group


class DiskTier:
    """Blocks on a shared disk. `policy=None` means LRU eviction at capacity.

    A TTL disk never evicts a live block: a write that finds it full is dropped, which is what
    a capacity-bounded TTL store does. A block is readable once its write has completed.
    """

    def __init__(
        self,
        capacity_blocks: int,
        channel: IoChannel,
        block_bytes: int,
        policy: TtlPolicy | None,
        max_write_backlog_s: float,
    ) -> None:
        self.capacity_blocks = capacity_blocks
        self.channel = channel
        self.block_bytes = block_bytes
        self.policy = policy
        self.max_write_backlog_s = max_write_backlog_s
        # block -> (readable from, expiry); LRU order kept by the OrderedDict.
        self._entries: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._expiries: list[tuple[float, str]] = []
        self.writes = 0
        self.writes_dropped = 0

    def live(self, block: str, now: float) -> bool:
        entry = self._entries.get(block)
        if entry is None or entry[0] > now:
            return False
        return self.policy is None or self.policy.is_live(entry[1], now)

    def touch(self, block: str, now: float) -> bool:
        """Refresh a stored block on access (new expiry, or most recently used); False if absent."""
        entry = self._entries.get(block)
        if entry is None:
            return False
        if self.policy is None:
            self._entries.move_to_end(block)
            return True
        if not self.policy.is_live(entry[1], now):
            return False
        expiry = self.policy.expiry_on_access(_GROUP, now)
        self._entries[block] = (entry[0], expiry)
        heapq.heappush(self._expiries, (expiry, block))
        return True

    def write(self, block: str, now: float) -> bool:
        """Write-through copy of `block`; False when dropped (full of live blocks, or I/O backlog)."""
        if self.touch(block, now):
            return True
        if self.capacity_blocks == 0 or self.channel.backlog_s(now) > self.max_write_backlog_s:
            self.writes_dropped += 1
            return False
        self._entries.pop(block, None)
        if len(self._entries) >= self.capacity_blocks and not self._make_room(now):
            self.writes_dropped += 1
            return False
        _, done = self.channel.reserve(now, self.block_bytes)
        if self.policy is None:
            expiry = math.inf
        else:
            expiry = self.policy.expiry_on_access(_GROUP, now)
            heapq.heappush(self._expiries, (expiry, block))
        self._entries[block] = (done, expiry)
        self.writes += 1
        return True

    def _make_room(self, now: float) -> bool:
        if self.policy is None:
            self._entries.popitem(last=False)
            return True
        while self._expiries and self._expiries[0][0] < now:
            expiry, block = heapq.heappop(self._expiries)
            entry = self._entries.get(block)
            if entry is not None and entry[1] == expiry:  # else a stale heap entry (refreshed)
                del self._entries[block]
        return len(self._entries) < self.capacity_blocks
