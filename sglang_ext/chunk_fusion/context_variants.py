"""Documents' rows as a shadow check computed them beside the other documents of its prompt,
reused when the same set of documents comes back (setting `fusion_shadow_refresh`).

Why: a stored chunk's rows were computed once, alone or after the chat prefix; rows computed
inside a prompt holding the same documents (in another order) fuse closer to the full prefill:
the harness measured 0.88 of the KL gap closed against 0.71 for rows computed after the chat
prefix, whole answers 0.75 against 0.50 (Qwen2.5-0.5B, r = 0.15,
`benchmarks/results/auto_chunk_source_qwen.json`). A shadow check prefills the checked prompt
with fusion off (`server/shadow_checks.py`): its rows are exact, in their real context, and were
thrown away. Here the rows of each chunk span the check's prompt matched are kept as that
span's variant for its document set (the set of chunk ids the prompt matched, whatever their
order: Cache-Craft keeps variants per context the same way); a later fused prompt that matches
the same span in the same set reads the variant instead of the stored rows. A span, not the
whole chunk: a document captured by `auto_chunks` with its label ("Document 1. ...") matches
without it where the prompt labels it otherwise. The rows are taken after a check's last
prefill round (`shadow_request.keep_shadow_check_rows`).

A variant lives in this server's host memory only, beside the tiers, and is never written to
disk or the shared tier: the stored chunk never changes under a request or under another server
that reads it, and losing a variant (LRU beyond `fusion_context_variant_bytes`, a restart)
costs only what it gained. A chunk the registry forgets drops its variants.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import cachetools

from sglang_hicache_ext.fusion.chunk import PrecomputedChunk
from sglang_hicache_ext.radix.chunk_index import ChunkMatch
from sglang_hicache_ext.sglang_ext.metrics.prometheus_metrics import ExtensionMetrics

# The chunks a prompt matched, in no order. Not the prompt's start: the tokens before its first
# match hold the first document's leading tokens wherever the tokenizer merges them with the
# label before it ("Document 1. The" is not "Document 1." + the chunk's "The"), so a key with
# them missed most repeats of a set in another order (benchmarks/results/shadow_refresh_qwen_r0.5.json).
DocumentSet = frozenset[str]
_Key = tuple[DocumentSet, str, int, int]  # documents, chunk id, span start and end in the chunk


def document_set(matches: list[ChunkMatch]) -> DocumentSet:
    """The key of a prompt's variants: the chunks it matched, in no order."""
    return frozenset(match.chunk_id for match in matches)


class _VariantRows(cachetools.LRUCache[_Key, PrecomputedChunk]):
    """The variants' rows, LRU within `capacity_bytes` of their `nbytes`; each eviction (the
    `popitem` cachetools calls while an insert does not fit) is counted in `counts`."""

    def __init__(self, capacity_bytes: int, on_evict: Callable[[], None]) -> None:
        super().__init__(capacity_bytes, getsizeof=lambda chunk: chunk.nbytes)
        self._on_evict = on_evict

    def popitem(self) -> tuple[_Key, PrecomputedChunk]:
        evicted = super().popitem()
        self._on_evict()
        return evicted


class ContextVariants:
    """Per scheduler process: (document set, chunk span) -> the span's rows in that set, LRU."""

    def __init__(self, capacity_bytes: int, metrics: ExtensionMetrics | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.metrics = metrics
        self.counts = dict.fromkeys(
            ("kept", "replaced", "evicted", "too_large", "used", "failed"), 0
        )
        self._rows = _VariantRows(capacity_bytes, self._evicted)

    @property
    def bytes_used(self) -> int:
        """Bytes of the rows kept (at most `capacity_bytes`)."""
        return int(self._rows.currsize)

    def get(self, documents: DocumentSet, match: ChunkMatch) -> PrecomputedChunk | None:
        """The matched span's rows computed in a prompt of exactly `documents`, else None."""
        key = (documents, match.chunk_id, match.chunk_start, match.chunk_end)
        chunk = self._rows.get(key)  # a hit becomes the most recently used
        if chunk is not None:
            self.counts["used"] += 1
            self._metric("used")
        return chunk

    def fits(self, nbytes: int) -> bool:
        """Whether rows of `nbytes` can be kept at all (counted when not: asked before the
        rows are copied out of the pool)."""
        if nbytes > self.capacity_bytes:
            self.counts["too_large"] += 1
            return False
        return True

    def keep(self, documents: DocumentSet, match: ChunkMatch, chunk: PrecomputedChunk) -> bool:
        """Keep (or replace) the rows of a matched span; False when they exceed the capacity."""
        if not self.fits(chunk.nbytes):
            return False
        key = (documents, match.chunk_id, match.chunk_start, match.chunk_end)
        # The rows replaced (the latest check's: the same context, computed again) leave before
        # the insert, so that they are not evicted for it.
        if self._rows.pop(key, None) is not None:
            self.counts["replaced"] += 1
        self._rows[key] = chunk  # evicts the least recently used rows until it fits
        self.counts["kept"] += 1
        self._metric("kept")
        return True

    def forget(self, chunk_ids: Iterable[str]) -> None:
        """Drop every variant of these chunks and of the document sets holding them."""
        gone = set(chunk_ids)
        if not gone or not self._rows:
            return
        for key in [key for key in self._rows if not gone.isdisjoint(key[0])]:
            del self._rows[key]

    def stats(self) -> dict[str, Any]:
        return {
            **self.counts,
            "variants": len(self._rows),
            "document_sets": len({key[0] for key in self._rows}),
            # Per scheduler process (each tensor-parallel rank keeps its own), beside the tiers.
            "bytes_used": self.bytes_used,
            "capacity_bytes": self.capacity_bytes,
        }

    def failed_capture(self) -> None:
        self.counts["failed"] += 1
        self._metric("failed")

    def _evicted(self) -> None:
        self.counts["evicted"] += 1
        self._metric("evicted")

    def _metric(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.context_variant(outcome)
