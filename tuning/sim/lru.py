"""Block set with least-recently-used eviction: the GPU prefix cache and the host DRAM tier."""

from __future__ import annotations

from collections import OrderedDict


class BlockLru:
    """At most `capacity` blocks; `insert` and `touch` make a block most recently used."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"LRU capacity must be >= 0 blocks, got {capacity}")
        self.capacity = capacity
        self._blocks: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, block: str) -> bool:
        return block in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def touch(self, block: str) -> None:
        self._blocks.move_to_end(block)

    def insert(self, block: str) -> None:
        if self.capacity == 0:
            return
        if block in self._blocks:
            self._blocks.move_to_end(block)
            return
        self._blocks[block] = None
        if len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def insert_all(self, blocks: tuple[str, ...]) -> None:
        """`insert` of each block in order (hot path: one call per prefill)."""
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
