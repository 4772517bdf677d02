"""Block set with least-recently-used eviction: the simulator's GPU prefix cache and DRAM tier,
and the TTL replay's DRAM tier."""

from __future__ import annotations

from collections import OrderedDict


class BlockLru:
    """At most `capacity` blocks; `access`, `insert` and `insert_all` make a block most recently
    used (at capacity 0 nothing is ever held)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"LRU capacity must be >= 0 blocks, got {capacity}")
        self.capacity = capacity
        self._blocks: OrderedDict[str, None] = OrderedDict()

    @classmethod
    def of_bytes(cls, capacity_bytes: float, block_bytes: int) -> BlockLru:
        """As many whole blocks of `block_bytes` as fit in `capacity_bytes`."""
        if capacity_bytes < 0 or block_bytes <= 0:
            raise ValueError("LRU capacity must be >= 0 bytes and block size > 0")
        return cls(int(capacity_bytes // block_bytes))

    def __contains__(self, block: str) -> bool:
        return block in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def access(self, block: str) -> bool:
        """Whether `block` was held (a hit); it is held afterwards, most recently used."""
        entries = self._blocks
        if block in entries:
            entries.move_to_end(block)
            return True
        if self.capacity > 0:
            entries[block] = None
            if len(entries) > self.capacity:
                entries.popitem(last=False)
        return False

    def insert(self, block: str) -> None:
        self.access(block)

    def insert_all(self, blocks: tuple[str, ...]) -> None:
        """`insert` of each block in order, inlined (hot path: one call per prefill)."""
        if self.capacity == 0:
            return
        entries, capacity = self._blocks, self.capacity
        for block in blocks:
            if block in entries:
                entries.move_to_end(block)
            else:
                entries[block] = None
                if len(entries) > capacity:
                    entries.popitem(last=False)
