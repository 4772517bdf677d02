"""Host DRAM tier model for the replay: LRU over equally sized pages, capacity in bytes."""

from __future__ import annotations

from collections import OrderedDict


class DramLru:
    """LRU set of pages; `access` reports a hit and makes the page most recently used."""

    def __init__(self, capacity_bytes: float, page_bytes: int) -> None:
        if capacity_bytes < 0 or page_bytes <= 0:
            raise ValueError("DRAM capacity must be >= 0 and page size > 0")
        self.capacity_pages = int(capacity_bytes // page_bytes)
        self._pages: OrderedDict[str, None] = OrderedDict()

    def access(self, page: str) -> bool:
        if page in self._pages:
            self._pages.move_to_end(page)
            return True
        if self.capacity_pages > 0:
            self._pages[page] = None
            if len(self._pages) > self.capacity_pages:
                self._pages.popitem(last=False)
        return False
