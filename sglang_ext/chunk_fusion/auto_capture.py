"""Documents of ordinary traffic kept as chunks (setting `auto_chunks`): no `POST /chunks`.

When a request's prompt has been prefilled (its last prefill round, fused or not), its pieces
(`radix/segments.py`: paragraphs, long ones cut where their content says) that no stored chunk
already covers are kept as chunks from the rows the prefill computed: keys rotated back to
pre-RoPE from the positions they were computed at, like a registration's capture
(`registry.capture`), recording the prompt before the piece as the prefix it was computed after.
A later prompt holding the piece at any position then matches it through the chunk index like a
registered chunk. Why the request's own rows and not a second prefill after the system prompt:
the fidelity harness measured both the same (`benchmarks/results/auto_chunk_source_qwen.json`),
and the rows cost a copy where a second prefill costs the prompt's compute again.

Only rows the model computed for this prompt are kept: in a fused prefill the pieces overlapping
a reused chunk hold recovered rows, so only pieces computed whole are taken. At most
`auto_chunks_per_minute` pieces are kept per minute (each costs a copy of its rows, and with a
disk tier a write, on the scheduler thread); pieces over the cap are counted, not kept.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from sglang_hicache_ext.fusion.chunk import chunk_hash
from sglang_hicache_ext.fusion.frequency import stacked_frequency_scores
from sglang_hicache_ext.radix.segments import SegmentRule, document_segments
from sglang_hicache_ext.sglang_ext.chunk_fusion.pool_rows import pre_rope_rows
from sglang_hicache_ext.sglang_ext.chunk_fusion.registry import ChunkRegistry
from sglang_hicache_ext.sglang_ext.server.prometheus_metrics import extension_metrics
from sglang_hicache_ext.sglang_ext.server.settings import ExtensionSettings

logger = logging.getLogger(__name__)

# A piece this much covered by stored chunks is reused already: keeping it again would store a
# second copy of the same document (e.g. behind another "Document N." label).
_COVERED = 0.9
_SEEN_REQUESTS = 4096  # the tree checkpoints a request more than once at its full length
_WINDOW_S = 60.0
OUTCOMES = ("captured", "covered", "over_cap", "not_computed", "failed")


class AutoCapture:
    """Keeps the uncovered pieces of each prefilled prompt as chunks, under a per-minute cap."""

    def __init__(
        self,
        registry: ChunkRegistry,
        breaks: frozenset[int],
        rule: SegmentRule,
        per_minute: int,
        codec: str | None = None,
        clock: Any = time.monotonic,
    ) -> None:
        self.registry = registry
        self.breaks = breaks
        self.rule = rule
        self.per_minute = per_minute
        self.codec = codec
        self.counts: Counter[str] = Counter({outcome: 0 for outcome in OUTCOMES})
        self.tokens_captured = 0
        self.seconds = 0.0  # on the scheduler thread, cutting, matching and keeping
        self._clock = clock
        self._recent: deque[float] = deque()
        self._seen: OrderedDict[str, None] = OrderedDict()

    @classmethod
    def for_settings(
        cls, settings: ExtensionSettings, registry: ChunkRegistry, breaks: frozenset[int]
    ) -> AutoCapture:
        rule = SegmentRule(
            settings.auto_chunk_min_tokens,
            settings.auto_chunk_max_tokens,
            cut_every=settings.auto_chunk_max_tokens // 2,
        )
        logger.info(
            "hicache_ext auto_chunks: pieces of %d-%d tokens, at most %d per minute",
            rule.min_tokens,
            rule.max_tokens,
            settings.auto_chunks_per_minute,
        )
        return cls(registry, breaks, rule, settings.auto_chunks_per_minute, settings.chunk_codec)

    def capture(
        self,
        rid: str,
        tokens: Sequence[int],
        kv_pool: Any,
        slots: torch.Tensor,
        fused: bool = False,
    ) -> int:
        """Keep the prompt's uncovered pieces whose rows sit at `slots` (one per token, at
        positions 0..n-1); `fused`: the rows of chunk-covered tokens are recovered, not
        computed. Returns how many pieces were kept."""
        if rid in self._seen:
            return 0
        began = time.perf_counter()
        self._seen[rid] = None
        if len(self._seen) > _SEEN_REQUESTS:
            self._seen.popitem(last=False)
        tokens = list(tokens)
        pieces = document_segments(tokens, self.breaks, self.rule)
        if not pieces:
            return 0
        covered = np.zeros(len(tokens), dtype=bool)
        for match in self.registry.index.find(tokens):
            covered[match.prompt_start : match.prompt_end] = True
        todo: list[tuple[int, int]] = []
        todo_ids: set[str] = set()
        for start, end in pieces:
            chunk_id = chunk_hash(tokens[start:end])
            share = float(covered[start:end].mean())
            # Stored already, or earlier in this prompt: also a chunk the index cannot match
            # (its anchors are too common, e.g. one token repeated).
            if share >= _COVERED or chunk_id in todo_ids or chunk_id in self.registry.store:
                self._count("covered", end - start)
            elif fused and share > 0:
                self._count("not_computed", end - start)
            elif not self._take_slot():
                self._count("over_cap", end - start)
            else:
                todo.append((start, end))
                todo_ids.add(chunk_id)
        kept = self._keep(tokens, todo, kv_pool, slots) if todo else 0
        self.seconds += time.perf_counter() - began
        return kept

    def _keep(
        self,
        tokens: Sequence[int],
        spans: list[tuple[int, int]],
        kv_pool: Any,
        slots: torch.Tensor,
    ) -> int:
        """Every piece's rows in one gather per layer (the scheduler waits for this)."""
        index = torch.cat([torch.arange(s, e) for s, e in spans]).to(slots.device)
        keys, values = pre_rope_rows(
            kv_pool, slots[index].to(torch.long), index, self.registry.rope
        )
        # Stacked once for every piece's scores ([N, L, H, D]).
        all_keys, all_values = torch.stack(keys, dim=1), torch.stack(values, dim=1)
        offset = kept = 0
        for start, end in spans:
            rows = slice(offset, offset + end - start)
            stored = self.registry.store_rows(
                [int(t) for t in tokens[start:end]],
                # Copies: a view would keep the whole prompt's rows alive as long as any
                # one piece of it stays stored.
                [k[rows].clone() for k in keys],
                [v[rows].clone() for v in values],
                self.codec,
                tuple(int(t) for t in tokens[:start]),
                quiet=True,
                freq_scores=stacked_frequency_scores(
                    all_keys[rows], all_values[rows], self.registry.alpha
                ),
            )
            self._count("captured" if stored else "failed", end - start)
            kept += stored
            offset += end - start
        return kept

    def _take_slot(self) -> bool:
        now = self._clock()
        while self._recent and now - self._recent[0] >= _WINDOW_S:
            self._recent.popleft()
        if len(self._recent) >= self.per_minute:
            return False
        self._recent.append(now)
        return True

    def _count(self, outcome: str, num_tokens: int) -> None:
        self.counts[outcome] += 1
        if outcome == "captured":
            self.tokens_captured += num_tokens
        elif outcome == "over_cap" and _worth_a_line(self.counts[outcome]):
            logger.warning(
                "auto_chunks: %d pieces over the cap of %d per minute not kept so far",
                self.counts[outcome],
                self.per_minute,
            )
        metrics = extension_metrics()
        if metrics is not None:
            metrics.auto_chunk(outcome, num_tokens)

    def stats(self) -> dict[str, Any]:
        return {
            **self.counts,
            "tokens_captured": self.tokens_captured,
            "seconds": round(self.seconds, 3),
            "per_minute": self.per_minute,
            "min_tokens": self.rule.min_tokens,
            "max_tokens": self.rule.max_tokens,
        }


def _worth_a_line(count: int) -> bool:
    # A steady overload would log every request: the 1st, 10th, 100th, then every 1000th.
    return count in (1, 10, 100) or count % 1000 == 0
