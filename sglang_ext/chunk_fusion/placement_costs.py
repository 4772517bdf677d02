"""What each form of a chunk costs, for the placement: its bytes and decode seconds per form.

A chunk is measured by encoding its registered rows through every form it may take and decoding
them again (`measure`; a chunk's content never changes, so once); a chunk not measured yet is
estimated from the per-token costs of the measured chunks registered alike (`of`, marked
`estimated`). The disk's read rate is its throttle when it has one, else the median of the
reads the placement timed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

from sglang_hicache_ext.fusion.chunk import PrecomputedChunk
from sglang_hicache_ext.tiers.chunks.header import ChunkSummary
from sglang_hicache_ext.tiers.chunks.stored_forms import BlobReader, compressed_blob, stored_codec
from sglang_hicache_ext.tuning.placement.host_forms import host_choices
from sglang_hicache_ext.tuning.placement.utility import UNCOMPRESSED

READ_RATES_KEPT = 64  # the latest timed disk reads the median is taken over


class FormCosts(NamedTuple):
    """A chunk's bytes and decode seconds per form."""

    num_tokens: int
    nbytes: dict[str, int]
    decode_s: dict[str, float]
    estimated: bool


class PerToken(NamedTuple):
    """Mean bytes and decode seconds per token and form of the chunks measured so far."""

    nbytes: dict[str, float]
    decode_s: dict[str, float]


class FormCostBook:
    """The measured costs by chunk, and the disk's read rate. `summary` gives a chunk's sizes
    and codec as registered (the registry's record); `disk_bytes_per_s` is the disk tier's
    throttle, when it has one."""

    def __init__(
        self, summary: Callable[[str], ChunkSummary | None], disk_bytes_per_s: float | None
    ) -> None:
        self._summary = summary
        self._disk_bytes_per_s = disk_bytes_per_s
        self._costs: dict[str, FormCosts] = {}
        self._read_rates: list[float] = []

    def __contains__(self, chunk_id: str) -> bool:
        return chunk_id in self._costs

    def measure(self, chunk_id: str, rows: PrecomputedChunk, registered: str) -> None:
        """Encode and decode the registered `rows` through every form they may take."""
        nbytes: dict[str, int] = {}
        decode_s: dict[str, float] = {}
        for form in host_choices(registered):
            if form == UNCOMPRESSED:
                nbytes[form], decode_s[form] = rows.nbytes, 0.0
                continue
            blob = compressed_blob(chunk_id, rows, stored_codec(form))
            reader = BlobReader(blob)
            began = time.perf_counter()
            for layer in range(blob.header.num_layers):
                reader.read(layer, None)
            nbytes[form], decode_s[form] = blob.nbytes, time.perf_counter() - began
        self._costs[chunk_id] = FormCosts(rows.num_tokens, nbytes, decode_s, estimated=False)

    def per_token(self) -> dict[str | None, PerToken]:
        """Per registered codec: the measured chunks' mean costs per token and form."""
        groups: dict[str | None, list[FormCosts]] = {}
        for chunk_id, costs in self._costs.items():
            summary = self._summary(chunk_id)
            groups.setdefault(None if summary is None else summary.codec, []).append(costs)
        return {
            codec: PerToken(
                {
                    f: statistics.fmean(c.nbytes[f] / c.num_tokens for c in group)
                    for f in group[0].nbytes
                },
                {
                    f: statistics.fmean(c.decode_s[f] / c.num_tokens for c in group)
                    for f in group[0].decode_s
                },
            )
            for codec, group in groups.items()
        }

    def of(self, chunk_id: str, per_token: dict[str | None, PerToken]) -> FormCosts | None:
        """The chunk's costs: measured, else estimated (`per_token` of this round); None when
        neither can be told (no summary, nothing registered alike measured yet)."""
        measured = self._costs.get(chunk_id)
        return measured if measured is not None else self._estimate(chunk_id, per_token)

    def _estimate(self, chunk_id: str, per_token: dict[str | None, PerToken]) -> FormCosts | None:
        """An unmeasured chunk's costs: its registered bytes exactly (its summary), the other
        forms by the per-token costs of the measured chunks registered alike."""
        summary = self._summary(chunk_id)
        alike = None if summary is None else per_token.get(summary.codec)
        if summary is None or alike is None:
            return None
        tokens = summary.num_tokens
        nbytes = {form: int(tokens * b) for form, b in alike.nbytes.items()}
        nbytes[UNCOMPRESSED if summary.codec is None else summary.codec] = summary.nbytes
        decode_s = {form: tokens * d for form, d in alike.decode_s.items()}
        return FormCosts(tokens, nbytes, decode_s, estimated=True)

    def note_read(self, nbytes: int, seconds: float) -> None:
        """One timed read of a chunk's registered rows from disk."""
        if seconds > 0:
            self._read_rates = [*self._read_rates[1 - READ_RATES_KEPT :], nbytes / seconds]

    def disk_rate(self) -> float | None:
        """The throttle when the disk has one, else the median of the reads timed here (a
        warm page cache makes them fast: a real cold read is slower)."""
        if self._disk_bytes_per_s:
            return float(self._disk_bytes_per_s)
        return statistics.median(self._read_rates) if self._read_rates else None

    def forget(self, chunk_ids: list[str]) -> None:
        for chunk_id in chunk_ids:
            self._costs.pop(chunk_id, None)
