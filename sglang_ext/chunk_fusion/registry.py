"""Registered chunks inside the SGLang scheduler: capture, store, index, list, delete.

A chunk is registered by a prefill-only request (`max_new_tokens=0`) whose `custom_params`
carry its id. SGLang prefills it like any prompt: alone at positions 0..n-1, or after a prefix
(the deployment's system prompt and chat header, `POST /chunks` "prefix"), whose rows the tree
caches like any prompt's and which is not stored with the chunk. When the request is
checkpointed into the tree (its KV rows are still valid then), the `hicache_ext` tree cache
reads the chunk's K/V from SGLang's KV pool, rotated back to pre-RoPE (`pool_rows.capture_chunk`),
and the registry computes the CacheTune frequency scores and stores the result in the host chunk
store under the content hash of the chunk's token ids. The chunk index learns the token sequence
so later prompts can find it.

With a disk tier (`chunk_disk_dir`) the chunk is also written to disk before the registration
is answered; at start the registry indexes every chunk found on disk, so chunks registered
before a restart are used without registering them again.
With the shared tier (`chunk_mooncake_master`) it is also written to the Mooncake Store and
announced in its catalogue; every lookup (`find`) first indexes the chunks other servers
announced there, registered or kept from traffic, so a document one server stored is reused by
all.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from typing import Any

import torch

from sglang_hicache_ext.fusion.chunk import PrecomputedChunk, chunk_hash
from sglang_hicache_ext.fusion.frequency import DEFAULT_ALPHA, layer_frequency_scores
from sglang_hicache_ext.fusion.rope import LayerRopes
from sglang_hicache_ext.radix.chunk_index import ChunkIndex, ChunkMatch
from sglang_hicache_ext.sglang_ext.chunk_fusion.context_variants import ContextVariants
from sglang_hicache_ext.sglang_ext.chunk_fusion.placement_control import (
    PlacementControl,
    host_form,
)
from sglang_hicache_ext.sglang_ext.chunk_fusion.registration import prefix_id
from sglang_hicache_ext.sglang_ext.chunk_fusion.streamed_chunk import StreamedChunk
from sglang_hicache_ext.sglang_ext.metrics.prometheus_metrics import (
    HOST_DECISIONS,
    ExtensionMetrics,
)
from sglang_hicache_ext.tiers.chunks.admission import FrequencyAdmission
from sglang_hicache_ext.tiers.chunks.chunk_tensors import ChunkTensors
from sglang_hicache_ext.tiers.chunks.chunk_tiers import ChunkTiers, Pinned
from sglang_hicache_ext.tiers.chunks.disk_tier import ChunkDiskTier
from sglang_hicache_ext.tiers.chunks.header import ChunkFileHeader, ChunkSummary, summary_of_header
from sglang_hicache_ext.tiers.chunks.host_cache import (
    HostCacheFullError,
    HostChunkCache,
    NotAdmittedError,
)
from sglang_hicache_ext.tiers.chunks.remote_tier import ChunkRemoteTier
from sglang_hicache_ext.tiers.chunks.retention import UtilityRetention
from sglang_hicache_ext.tiers.chunks.stored_forms import BlobReader, StoredBlob, stored_codec

logger = logging.getLogger(__name__)

CONTROL_PREFIX = "hicache_ext."


# What host memory holds: a dense chunk's rows, or a compressed chunk's stored bytes.
HostChunk = PrecomputedChunk | StoredBlob


def host_chunk(stored: ChunkTensors | StoredBlob) -> HostChunk:
    return stored if isinstance(stored, StoredBlob) else PrecomputedChunk(*stored)


def readable(chunk: HostChunk) -> PrecomputedChunk | StreamedChunk:
    """A host chunk as a request reads it (a compressed one decoded layer by layer)."""
    return StreamedChunk(BlobReader(chunk)) if isinstance(chunk, StoredBlob) else chunk


def summarize(chunk: HostChunk) -> ChunkSummary:
    if isinstance(chunk, StoredBlob):
        header = chunk.header
        return ChunkSummary(header.num_tokens, header.num_layers, chunk.nbytes, header.codec)
    return ChunkSummary(chunk.num_tokens, chunk.num_layers, chunk.nbytes)


class ChunkRegistry:
    """Chunk index + tiered store, owned by the tree cache (one per scheduler process)."""

    def __init__(
        self,
        capacity_bytes: int,
        rope: LayerRopes,
        alpha: float = DEFAULT_ALPHA,
        disk: ChunkDiskTier | None = None,
        stream_from_disk: bool = True,
        remote: ChunkRemoteTier | None = None,
        promote_on_read: bool = True,
        disk_read_bytes_per_s: float | None = None,
        context_variants: ContextVariants | None = None,
        metrics: ExtensionMetrics | None = None,
        admission: FrequencyAdmission | None = None,
        retention: UtilityRetention[HostChunk] | None = None,
    ) -> None:
        self.index = ChunkIndex()
        self.metrics = metrics
        # Streamed: a request reads only the disk rows it reuses, layer by layer under the
        # compute; the chunk is promoted to host memory after the request, in the background.
        self.store: ChunkTiers[HostChunk] = ChunkTiers(
            # With `admission`, pieces kept from traffic win their place by how often they
            # were seen (`add(..., by_frequency=True)`); registered chunks always get one.
            HostChunkCache(capacity_bytes, admission, retention),
            disk,
            host_chunk,
            summarize,
            stream=StreamedChunk if stream_from_disk else None,
            remote=remote,
            promote_on_read=promote_on_read,
        )
        self._rope = rope
        self._alpha = alpha
        self.failed_captures = 0
        # Sizes of every stored chunk (a listing must not read disk headers).
        self._summaries: dict[str, ChunkSummary] = {}
        # Per chunk registered by this process: the prefix it was computed after, as
        # (prefix_id, token count). Kept in memory only: a chunk restored from disk or found in
        # the shared tier has none recorded and is reported so ("prefix": null).
        self._prefixes: dict[str, tuple[str, int]] = {}
        # Bumped whenever the set of registered chunks changes (admission caches its matches).
        self.generation = 0
        # Read counts and questions of real requests, probes and the host forms a placement
        # chose (`placement_control.py`).
        self.placement = PlacementControl(
            self.store, self.summary, self.report_stored_bytes, disk_read_bytes_per_s
        )
        # Documents' rows in the prompts shadow checks computed (fusion_shadow_refresh).
        self.context_variants = context_variants
        self.restored = self._index_stored_chunks()
        self.shared_found = 0  # chunks other servers announced in the shared tier, indexed here

    def find(self, token_ids: list[int] | tuple[int, ...]) -> list[ChunkMatch]:
        """The stored chunks `token_ids` holds (`ChunkIndex.find`), other servers' included."""
        self.sync_shared()
        return self.index.find(token_ids)

    def sync_shared(self) -> int:
        """Index the chunks other servers announced in the shared tier since the last look."""
        remote = self.store.remote
        found = 0 if remote is None else sum(self._index_header(*h) for h in remote.announced())
        if found and self.metrics is not None:
            self.metrics.shared_chunks_found(found)
        self.shared_found += found
        return found

    def stored_by(self, chunk_ids: list[str]) -> dict[str, int]:
        """Per other server (as it announced itself), how many of `chunk_ids` it stored."""
        remote = self.store.remote
        writers = [] if remote is None else [remote.writer_of.get(c) for c in chunk_ids]
        return dict(Counter(w for w in writers if w is not None))

    def _index_stored_chunks(self) -> int:
        """Index the chunks a disk tier holds from before this process (restart); how many."""
        restored = 0
        for key in self.store.stored_keys():
            header = self.store.header(key)
            if header is None:
                continue  # dropped as corrupt by the tier (logged, counted)
            restored += self._index_header(key, header)
        if restored:
            logger.info("%d chunks found on the chunk disk tier", restored)
        return restored

    def _index_header(self, key: str, header: ChunkFileHeader) -> bool:
        """Index a chunk a lower tier holds; False (dropped) if it does not hold its tokens."""
        if chunk_hash(header.token_ids) != key:
            logger.error("stored chunk %s does not hold its tokens; dropped", key[:12])
            self.store.remove(key)
            return False
        self._add_to_index(key, header.token_ids)
        self._summaries[key] = summary_of_header(header)
        self.generation += 1
        return True

    def _add_to_index(self, chunk_id: str, token_ids: tuple[int, ...] | list[int]) -> None:
        if len(token_ids) >= self.index.anchor_tokens:
            self.index.add(chunk_id, token_ids)

    def forget(self, chunk_ids: list[str]) -> None:
        """Drop chunks no tier holds any more from the index and the listing."""
        self.placement.forget(chunk_ids)
        if self.context_variants is not None:
            self.context_variants.forget(chunk_ids)
        for chunk_id in chunk_ids:
            self._summaries.pop(chunk_id, None)
            self._prefixes.pop(chunk_id, None)
            if chunk_id in self.index:
                self.index.remove(chunk_id)
        if chunk_ids:
            self.generation += 1

    def pin(self, chunk_id: str) -> Pinned | None:
        """Hold a chunk for a request (host memory, else streamed from disk); None if no tier
        has it."""
        pinned, lost = self.store.pin(chunk_id)
        self.forget(lost)
        if lost or (pinned is not None and pinned.tier != "host"):
            self.report_stored_bytes()
        return None if pinned is None else pinned._replace(chunk=readable(pinned.chunk))

    def pin_form(self, chunk_id: str, form: str) -> Pinned | None:
        """A probe's copy of the chunk's registered rows through `form` (see `pin`)."""
        return self.placement.pin_form(chunk_id, form)

    def unpin(self, chunk_id: str, probe: bool = False) -> None:
        """Let go of a chunk `pin` (or, with `probe`, `pin_form`) held."""
        if probe:
            self.placement.release_probe(chunk_id)
        else:
            self.store.unpin(chunk_id)

    def registered_codec(self, chunk_id: str) -> str | None:
        """How the chunk was registered: the form every lower tier keeps (None: dense)."""
        summary = self._summaries.get(chunk_id)
        return None if summary is None else summary.codec

    def host_form(self, chunk_id: str) -> str | None:
        """The form host memory holds the chunk in ("none": dense), None when it holds none."""
        return host_form(self.store, chunk_id)

    def summary(self, chunk_id: str) -> ChunkSummary | None:
        """A stored chunk's sizes as registered (in memory: no disk header read)."""
        return self._summaries.get(chunk_id)

    @property
    def rope(self) -> LayerRopes:
        """The rotations a stored chunk's keys were rotated back with (one, or one per layer)."""
        return self._rope

    @property
    def alpha(self) -> float:
        return self._alpha

    def store_rows(
        self,
        token_ids: list[int],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        codec: str | None = None,
        prefix: tuple[int, ...] = (),
        quiet: bool = False,
        freq_scores: torch.Tensor | None = None,
        by_frequency: bool = False,
    ) -> bool:
        """Store the chunk of these pre-RoPE rows, computed after `prefix`; `quiet`: logged at
        debug level (chunks kept from traffic come by the hundred per minute); `freq_scores`:
        the rows' `layer_frequency_scores` at the registry's alpha when the caller has them;
        `by_frequency`: as `add`'s."""
        if freq_scores is None:
            freq_scores = layer_frequency_scores(keys, values, self._alpha)
        chunk = PrecomputedChunk(
            token_ids=tuple(token_ids),
            keys=tuple(keys),
            values=tuple(values),
            freq_scores=freq_scores,
            alpha=self._alpha,
        )
        stored = self.add(chunk, codec, quiet, by_frequency=by_frequency)
        if stored:
            self._prefixes[chunk.content_hash] = (prefix_id(prefix), len(prefix))
        return stored

    def would_admit(self, chunk_id: str, nbytes: int) -> bool:
        """Whether a piece of `nbytes` in host memory would win its place now (`add(...,
        by_frequency=True)`), asked before its rows are prepared."""
        return self.store.would_admit(chunk_id, nbytes)

    def prefix_of(self, chunk_id: str) -> tuple[str, int] | None:
        """(prefix_id, tokens) of the prefix the chunk was computed after; None: not recorded
        (restored from disk, found in the shared tier, or added in process)."""
        return self._prefixes.get(chunk_id)

    def add(
        self,
        chunk: PrecomputedChunk,
        codec: str | None = None,
        quiet: bool = False,
        *,
        by_frequency: bool = False,
    ) -> bool:
        """Store and index a precomputed chunk (written through to disk when there is one;
        compressed by `codec` on every tier when given); False (logged, counted) when no tier
        could take it. `by_frequency`: a piece kept from traffic, which must win its place in
        host memory by how often it was seen; NotAdmittedError (nothing stored) when it does
        not, for the caller to count."""
        chunk_id = chunk.content_hash
        try:
            lost = self.store.put(
                chunk_id,
                chunk,
                None if codec is None else stored_codec(codec),
                by_frequency=by_frequency,
            )
        except NotAdmittedError:
            self.report_stored_bytes()  # host memory counted the refusal
            raise
        except (HostCacheFullError, ValueError) as err:  # ValueError: a codec tiers cannot store
            self.failed_captures += 1
            logger.error("chunk %s not stored: %s", chunk_id[:12], err)
            return False
        self.forget(lost)
        self._add_to_index(chunk_id, chunk.token_ids)
        summary = self._summaries[chunk_id] = self.store.summary(chunk_id) or summarize(chunk)
        self.generation += 1
        self.report_stored_bytes()
        logger.log(
            logging.DEBUG if quiet else logging.INFO,
            "chunk %s registered: %d tokens, %d bytes (%s) in %s",
            chunk_id[:12],
            chunk.num_tokens,
            summary.nbytes,
            codec or "dense",
            "+".join(self.store.tiers_of(chunk_id)),
        )
        return True

    def discover(self, chunk_id: str) -> bool:
        """Index a chunk unknown here that another server wrote to the shared tier (its header
        only); whether the registry knows the chunk now. `POST /chunks` of the same tokens
        then answers without a prefill, and requests fetch its rows from the shared tier."""
        if chunk_id in self._summaries:
            return True
        header = self.store.discover(chunk_id)
        if header is not None and self._index_header(chunk_id, header):
            logger.info("chunk %s found in the shared tier", chunk_id[:12])
            return True
        return False

    def delete(self, chunk_id: str) -> bool:
        """False when unknown; raises RuntimeError while a running request pins the chunk."""
        try:
            removed = self.store.remove(chunk_id)
        except KeyError:
            return False
        if not removed:
            raise RuntimeError(f"chunk {chunk_id[:12]} is in use by a running request; retry later")
        self.forget([chunk_id])
        self.report_stored_bytes()
        return True

    def report_stored_bytes(self) -> None:
        if (metrics := self.metrics) is not None:
            stats = self.store.stats()
            metrics.chunk_stored_bytes(stats.host.bytes_used, tier="host")
            metrics.host_decisions({key: getattr(stats.host, key) for key in HOST_DECISIONS})
            metrics.host_bytes_by_form(stats.host.bytes_by_form)
            if stats.disk is not None:
                metrics.chunk_stored_bytes(stats.disk.bytes_used, tier="disk")
            if stats.remote is not None:
                metrics.chunk_stored_bytes(stats.remote.bytes_known, tier="mooncake")

    def stats(self) -> dict[str, Any]:
        """Host memory's counts at the top level (as before tiers), then every tier's."""
        stats = self.store.stats()
        return {
            **stats.host.__dict__,
            "failed_captures": self.failed_captures,
            "tiers": list(self.store.tiers),
            "hits_by_tier": stats.lookups,
            "promotions": stats.promotions,
            "demotions": stats.demotions,
            "lost": stats.lost,
            "restored_from_disk": self.restored,
            "found_in_shared_tier": self.shared_found,
            "disk": None if stats.disk is None else stats.disk.__dict__,
            "mooncake": None if stats.remote is None else dataclasses.asdict(stats.remote),
            "admission": self._admission_state(),
        }

    def _admission_state(self) -> dict[str, Any] | None:
        """How host memory admits pieces kept from traffic now (None: every piece, by LRU)."""
        admission = self.store.host.admission
        if admission is None:
            return None
        return {
            "mode": admission.mode,
            "sketch_bytes": admission.sketch.memory_bytes,
            # What each rule would have served lately (decayed bytes): the mode follows the lead.
            "shadow_hit_bytes": {
                rule: round(shadow.hit_bytes) for rule, shadow in admission.shadows.items()
            },
        }
