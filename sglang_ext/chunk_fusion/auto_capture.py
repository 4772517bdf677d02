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
`auto_chunks_per_minute` pieces are kept per minute; pieces over the cap are counted, not kept.

Under memory pressure (`chunk_admission: "adaptive"` or `"frequency"`) a piece must win its
place: every sight of a piece, and of each stored chunk a prompt holds, is recorded in a
frequency sketch (and, adaptive, replayed with its bytes by two key-only shadows of host memory),
and a piece that does not fit in host memory's free bytes is kept only when it was seen more
often than each chunk its eviction would drop, or, while the shadow admitting everything leads,
always (`tiers/chunks/admission.py`). The question is asked
before its rows are copied out, so a piece that would be refused costs nothing but a count
("refused"); it is asked again when the piece is stored, where the answer counts.

What the scheduler thread pays: cutting the prompt, matching it, and one copy of the kept
pieces' rows out of the pool (they are the pool's only until then), after the batch's first
tokens are sent and before KV is allocated again (`defer`). Rotating the keys back,
scoring and copying each piece out run in the background, one prompt's pieces at a time, each
on a thread that ends with them (`tiers/short_lived_worker.py` says why), so the request that brought the
documents answers without waiting for them; on CPU the next forward waits for what is left of
them (`before_forward` says why). Finished pieces are stored and indexed on the
scheduler thread, where every other reader of the registry runs: when a later request is
planned, when a control request or a status reads the registry (these wait for every pending
piece), and before the next capture. A later prompt that would match a piece still being
prepared (pending pieces have an index of their own, like the registry's) waits for it: a
document's second sight is reused however soon it comes.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

import cachetools
import numpy as np
import torch

from sglang_hicache_ext.fusion.captured_piece import CapturedPiece, prepared_pieces
from sglang_hicache_ext.fusion.chunk import chunk_hash
from sglang_hicache_ext.radix.chunk_index import ChunkIndex
from sglang_hicache_ext.radix.segments import SegmentRule, document_segments, sight_key
from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.tensor_parallel import TensorParallel
from sglang_hicache_ext.sglang_ext.chunk_fusion.pool_rows import bytes_per_token, layer_rows
from sglang_hicache_ext.sglang_ext.chunk_fusion.registry import ChunkRegistry
from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings
from sglang_hicache_ext.sglang_ext.metrics.prometheus_metrics import ExtensionMetrics
from sglang_hicache_ext.tiers.chunks.admission import FrequencyAdmission
from sglang_hicache_ext.tiers.chunks.host_cache import NotAdmittedError
from sglang_hicache_ext.tiers.short_lived_worker import ShortLivedWorker

logger = logging.getLogger(__name__)

# A piece this much covered by stored chunks is reused already: keeping it again would store a
# second copy of the same document (e.g. behind another "Document N." label).
_COVERED = 0.9
# Covered this much, a piece computed in full is a variant of a stored one, not kept again; less
# covered, its own content is most of it, and it is kept.
_MOSTLY_COVERED = 0.5
_SEEN_REQUESTS = 4096  # the tree checkpoints a request more than once at its full length
_WINDOW_S = 60.0
OUTCOMES = (
    "captured",
    "covered",
    "partly_covered",
    "over_cap",
    "not_computed",
    "refused",
    "failed",
    "ranks_disagree",
)


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
        background: bool = True,
        tp: TensorParallel | None = None,
        metrics: ExtensionMetrics | None = None,
        admission: FrequencyAdmission | None = None,
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        # The sketch host memory's admission reads (the registry's, handed in by the assembly):
        # sights are recorded here, where prompts are cut into pieces.
        self.admission = admission
        # Under --tp-size N each rank keeps its shard of the same pieces: the ranks' choices
        # (their clocks for the cap) are compared before anything is kept.
        self._tp = tp or TensorParallel()
        self.breaks = breaks
        self.rule = rule
        self.per_minute = per_minute
        self.codec = codec
        self.counts: Counter[str] = Counter({outcome: 0 for outcome in OUTCOMES})
        self.tokens_captured = 0
        # On the scheduler thread: cutting, matching, copying rows out, storing, waiting.
        self.seconds = 0.0
        self._clock = clock
        self._recent: deque[float] = deque()
        # The requests already captured: a set bounded to the last _SEEN_REQUESTS of them.
        self._seen: cachetools.FIFOCache[str, None] = cachetools.FIFOCache(_SEEN_REQUESTS)
        # background=False prepares pieces on the caller's thread (tests, in-process use).
        self._worker = ShortLivedWorker("hicache-ext-capture") if background else None
        self._jobs: deque[tuple[Future[list[CapturedPiece]], frozenset[str]]] = deque()
        # Rows in host memory: the forward runs on the cores the preparation would use.
        self._pool_on_cpu = False
        # The pieces in `_jobs`, indexed as the registry indexes chunks: a later prompt that
        # would match one waits for it.
        self._pending = ChunkIndex()
        # Captures asked for while a batch's results are processed, run once its first tokens
        # are sent (`defer`).
        self._deferred: deque[Callable[[], int]] = deque()

    @classmethod
    def for_settings(
        cls,
        settings: ExtensionSettings,
        registry: ChunkRegistry,
        breaks: frozenset[int],
        tp: TensorParallel | None = None,
        metrics: ExtensionMetrics | None = None,
        admission: FrequencyAdmission | None = None,
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
        tp = tp or TensorParallel()
        return cls(
            registry,
            breaks,
            rule,
            settings.auto_chunks_per_minute,
            settings.chunk_codec,
            # Under TP the pieces are prepared on the scheduler thread: a background job would
            # store them (and change what admission matches) at a time of each rank's own.
            background=tp.size == 1,
            tp=tp,
            metrics=metrics,
            admission=admission,
        )

    def defer(
        self,
        rid: str,
        tokens: Sequence[int],
        kv_pool: Any,
        slots: torch.Tensor,
        fused: bool = False,
    ) -> None:
        """`capture`, once `run_deferred` is called: the scheduler calls it after the batch's
        results, first tokens included, are sent, and before it allocates KV again, so the rows
        at `slots` are still the prompt's then (a finished request's slots are freed, not
        reused, until the next allocation). The request's first token does not wait for the
        cutting, matching and copying out."""
        # The slot table's row may be handed to another request before this runs: a copy.
        self._deferred.append(
            partial(self.capture, rid, list(tokens), kv_pool, slots.clone(), fused)
        )

    def run_deferred(self) -> None:
        """The captures `defer` was asked for, in order (scheduler thread)."""
        while self._deferred:
            self._deferred.popleft()()

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
        computed. Returns how many pieces were taken (stored once prepared)."""
        if rid in self._seen:
            return 0
        self.settle()
        began = time.perf_counter()
        self._seen[rid] = None
        tokens = [int(t) for t in tokens]  # the background thread gets its own copy
        pieces = document_segments(tokens, self.breaks, self.rule)
        if not pieces:
            return 0
        covered = np.zeros(len(tokens), dtype=bool)
        # Dense: a codec stores fewer, so admission weighs a piece as larger than it is (refuses
        # rather than admits wrongly).
        row_bytes = bytes_per_token(kv_pool) if self.admission is not None else 0
        # This prompt's sights, in prompt order, with their bytes: the chunks it holds, its pieces.
        sighted: dict[str, int] = {}
        for match in self.registry.find(tokens):  # other servers' pieces too: kept once
            covered[match.prompt_start : match.prompt_end] = True
            chunk_tokens = self.registry.index.tokens(match.chunk_id)
            self._sight(sighted, match.chunk_id, chunk_tokens, match.length * row_bytes)
        spans = [(start, end, chunk_hash(tokens[start:end])) for start, end in pieces]
        shares = [float(covered[start:end].mean()) for start, end, _ in spans]
        for (start, end, chunk_id), share in zip(spans, shares, strict=True):
            if share < _COVERED:
                self._sight(sighted, chunk_id, tokens[start:end], (end - start) * row_bytes)
        if self.admission is not None:  # recorded before any piece is judged by them
            self.admission.record_prompt(list(sighted.items()))
        todo: list[tuple[int, int, str]] = []
        todo_ids: set[str] = set()
        for (start, end, chunk_id), share in zip(spans, shares, strict=True):
            # Stored already, being prepared, or earlier in this prompt: also a chunk the index
            # cannot match (its anchors are too common, e.g. one token repeated).
            if (
                share >= _COVERED
                or chunk_id in todo_ids
                or chunk_id in self._pending
                or chunk_id in self.registry.store
            ):
                self._count("covered", end - start)
            elif fused and share > 0:
                self._count("not_computed", end - start)
            elif share >= _MOSTLY_COVERED:
                # A variant of a stored piece (another label, a word changed): the stored one
                # serves what they share, and keeping this one would store that part twice.
                self._count("partly_covered", end - start)
            elif self.admission is not None and not self.registry.would_admit(
                chunk_id, (end - start) * row_bytes
            ):
                self._count("refused", end - start)
            elif not self._take_slot():
                self._count("over_cap", end - start)
            else:
                todo.append((start, end, chunk_id))
                todo_ids.add(chunk_id)
        if not self._tp.agree(",".join(sorted(todo_ids))):
            for start, end, _ in todo:  # a rank kept otherwise: none keeps anything of it
                self._count("ranks_disagree", end - start)
            todo = []
        if todo:
            self._submit(tokens, todo, kv_pool, slots)
        self.seconds += time.perf_counter() - began
        return len(todo)

    def _sight(
        self, sighted: dict[str, int], chunk_id: str, tokens: Sequence[int], nbytes: int
    ) -> None:
        """A sight of a piece, by its content (`sight_key`): the same paragraph under another
        label is another chunk id but the same sight."""
        if self.admission is not None:
            key = sight_key(tokens)
            self.admission.count_as(chunk_id, key)
            sighted.setdefault(key, nbytes)

    def _submit(
        self,
        tokens: list[int],
        spans: list[tuple[int, int, str]],
        kv_pool: Any,
        slots: torch.Tensor,
    ) -> None:
        """Copy the pieces' rows out of the pool (one gather per layer, the scheduler waits for
        it); the rest runs on the background thread."""
        index = torch.cat([torch.arange(s, e) for s, e, _ in spans]).to(slots.device)
        rows = slots[index].to(torch.long)
        keys, values = layer_rows(kv_pool, rows)
        self._pool_on_cpu = keys.device.type == "cpu"
        args = (tokens, spans, keys, values, index, self.registry.rope, self.registry.alpha)
        if self._worker is None:
            self._store(prepared_pieces(*args))
            return
        ids = frozenset(chunk_id for _, _, chunk_id in spans)
        self._jobs.append((self._worker.submit(prepared_pieces, *args), ids))
        for start, end, chunk_id in spans:
            self._pending.add(chunk_id, tokens[start:end])

    def before_forward(self) -> None:
        """Called before every forward (scheduler thread). On CPU the forward's OpenMP team
        takes every core and each parallel region waits for its slowest thread: preparation
        running beside it stalls the whole forward, which measured costlier than the
        preparation itself (docs/auto-chunks.md). So there the preparation only overlaps the
        scheduler's other work (sending the answer, receiving the next request) and the
        forward waits for what is left of it. A GPU forward does not compete for the cores."""
        if self._pool_on_cpu and self._jobs:
            self.settle(wait=True)

    def settle(self, token_ids: Sequence[int] | None = None, wait: bool = False) -> None:
        """Store the pieces prepared so far (scheduler thread). `wait`: every pending piece
        first; `token_ids`: the pending pieces that prompt would match first (a request about to
        be matched against the registry)."""
        if not self._jobs:
            return
        last = len(self._jobs) - 1 if wait else -1  # the last job to wait for
        if token_ids is not None and not wait:
            wanted = {match.chunk_id for match in self._pending.find(token_ids)}
            if wanted:  # jobs finish in order
                last = max(i for i, (_, ids) in enumerate(self._jobs) if not wanted.isdisjoint(ids))
        began, done = time.perf_counter(), 0
        while self._jobs and (done <= last or self._jobs[0][0].done()):
            future, ids = self._jobs.popleft()
            for chunk_id in ids:
                self._pending.remove(chunk_id)
            done += 1
            try:
                self._store(future.result())
            except Exception:  # a bug, not a fault of the request: logged, counted, served on
                logger.exception("auto_chunks: %d pieces not prepared", len(ids))
                for _ in ids:
                    self._count("failed", 0)
        self.seconds += time.perf_counter() - began

    def _store(self, pieces: list[CapturedPiece]) -> None:
        for piece in pieces:
            self._count(self._store_piece(piece), len(piece.token_ids))

    def _store_piece(self, piece: CapturedPiece) -> str:
        """Store one prepared piece; its outcome."""
        if piece.chunk_id in self.registry.store:
            return "captured"  # registered meanwhile (POST /chunks of the same document)
        try:
            stored = self.registry.store_rows(
                piece.token_ids,
                piece.keys,
                piece.values,
                self.codec,
                piece.prefix,
                quiet=True,
                freq_scores=piece.freq_scores,
                by_frequency=self.admission is not None,
            )
        except NotAdmittedError:  # admitted when prepared, no longer (others were seen more)
            return "refused"
        return "captured" if stored else "failed"

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
        if self.metrics is not None:
            self.metrics.auto_chunk(outcome, num_tokens)

    def stats(self) -> dict[str, Any]:
        self.settle(wait=True)
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
