"""Stored chunk rows loaded ahead of the compute, one layer at a time.

Chunks held in memory are indexed when a layer needs them. Chunks on a slower tier are read by
a reader thread: while the executor computes layer l, the rows of layer l+1 (those the request
will not recompute, known from its plan) are being read, so the transfer hides under the
compute (CacheTune §4.2, Eq. 9). `overlapped=False` reads at the point of use instead, the
baseline the overlap is measured against. The reader thread is shared by every request of the
process: it reads in submission order, and the executor submits layer by layer.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from sglang_hicache_ext.fusion.chunk import StoredChunk

_reader: ThreadPoolExecutor | None = None
_reader_lock = threading.Lock()


def _reader_pool() -> ThreadPoolExecutor:
    global _reader
    with _reader_lock:
        if _reader is None:
            _reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chunk-loader")
        return _reader


Rows = tuple[torch.Tensor, torch.Tensor]


class LayerLoader:
    """One request's loads: `submit` a layer's rows early, `get` them when the layer runs."""

    def __init__(self, overlapped: bool = True) -> None:
        self.overlapped = overlapped
        self.wait_s = 0.0  # time the compute stood still waiting for rows (the exposed transfer)
        self._pending: dict[tuple[int, int], tuple[torch.Tensor, Future[Rows]]] = {}
        # While `retain` is on (a scoring pass, which reads every row of its layers), what was
        # read is kept, so the prefill after it takes its rows from memory instead of the tier.
        self.retain = False
        self._kept: dict[tuple[int, int], tuple[torch.Tensor, Rows]] = {}

    def submit(self, layer: int, span: int, chunk: StoredChunk, rows: torch.Tensor) -> None:
        """Start reading `rows` of `chunk` (occurrence `span` of the request) at `layer`."""
        if not self.overlapped or chunk.in_memory or rows.numel() == 0:
            return
        if (layer, span) in self._pending or (layer, span) in self._kept:
            return
        future = _reader_pool().submit(chunk.rows, layer, rows.cpu())
        self._pending[layer, span] = (rows, future)

    def get(self, layer: int, span: int, chunk: StoredChunk, rows: torch.Tensor) -> Rows:
        """The rows; waits for a submitted read (the same rows) or reads them now."""
        if chunk.in_memory:
            return chunk.rows(layer, rows)
        kept = self._kept.get((layer, span))
        if kept is not None:
            return _subset(kept, rows)
        began = time.perf_counter()
        pending = self._pending.pop((layer, span), None)
        if pending is not None and torch.equal(pending[0].cpu(), rows.cpu()):
            result = pending[1].result()
        else:
            if pending is not None:  # planned other rows (cannot happen today): read afresh
                pending[1].cancel()
            result = chunk.rows(layer, rows.cpu())
        self.wait_s += time.perf_counter() - began
        for tensor in result:
            if tensor.is_cuda:
                # Copied on the chunk's copy stream, used on this one: the allocator must not
                # hand the memory back to the copy stream while this stream still reads it.
                tensor.record_stream(torch.cuda.current_stream(tensor.device))
        if self.retain:
            self._kept[layer, span] = (rows.cpu(), result)
        return result

    def close(self) -> None:
        """Cancel reads not started; wait for the one running (its chunk may be released next)."""
        for _, future in self._pending.values():
            future.cancel()
        for _, future in self._pending.values():
            if not future.cancelled():
                future.exception()
        self._pending.clear()
        self._kept.clear()


def _subset(kept: tuple[torch.Tensor, Rows], rows: torch.Tensor) -> Rows:
    """`rows` (sorted local indices, all among the kept ones) out of kept rows."""
    kept_rows, (keys, values) = kept
    where = torch.searchsorted(kept_rows, rows.cpu())
    if where.numel() and (
        int(where.max()) >= kept_rows.numel() or not torch.equal(kept_rows[where], rows.cpu())
    ):
        raise ValueError("rows asked for were not read by the scoring pass")
    index = where.to(keys.device)
    return keys[index], values[index]
