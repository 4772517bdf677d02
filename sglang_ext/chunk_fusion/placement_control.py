"""The placement's scheduler side: what the profiler and the placement round need to know of
every chunk, the rows a probe reads, and applying the chosen host forms.

Control methods (`hicache_ext.placement.*`, run on the scheduler thread like every control
request, so they never run during a forward; the tiered store's promotion thread is the only
other writer of host memory, and it stands down once a placement has run):

- `inputs`: every chunk the disk holds, with its registered form, the form host memory holds
  now, its bytes and decode time in each form it may take (`placement_costs.py`: measured by
  encoding its registered rows; chunks are measured until `MEASURE_BUDGET_S` has passed in the
  call, one chunk at a time, so one call stalls the scheduler for about that long; the others
  get the per-token costs of those measured, marked `estimated`), its decayed read count and the questions real
  requests asked with it; the host and disk capacities, the host bytes of chunks not in the
  list (the plan must leave them their room) and the disk's read rate.
- `tokens`: the token ids of the chunks to probe.
- `apply`: make host memory hold each chunk in its chosen form (or not at all): drops, then
  shrinks, then grows, nothing evicted for a grow that does not fit (`no_room`), a chunk a
  running request holds left as it is (`busy`); then the reads counted at `inputs` become
  history (later ones stay in the next round). The disk keeps the registered rows, so a
  placement never loses a chunk (the disk's own budget may evict it later, as before).

A probe request (`placement_probe.py`) reads a chunk's registered rows passed through the probed
codec (`pin_form`), whatever host memory holds at the time.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

from sglang_hicache_ext.fusion.chunk import PrecomputedChunk
from sglang_hicache_ext.sglang_ext.chunk_fusion.placement_costs import FormCostBook
from sglang_hicache_ext.tiers.chunks.chunk_tiers import ChunkTiers, Pinned
from sglang_hicache_ext.tiers.chunks.header import ChunkSummary, CorruptChunkError
from sglang_hicache_ext.tiers.chunks.stored_forms import (
    StoredBlob,
    compressed_blob,
    decode_chunk,
    stored_codec,
    through_codec,
)
from sglang_hicache_ext.tuning.placement.host_forms import CODEC_ORDER, host_choices
from sglang_hicache_ext.tuning.placement.usage import ChunkUsage
from sglang_hicache_ext.tuning.placement.utility import UNCOMPRESSED

logger = logging.getLogger(__name__)

PROBE_ROWS_KEPT = 12  # (chunk, form) pairs: the probes in flight cover two or three chunks
MEASURE_BUDGET_S = 0.5  # of encoding and decoding chunks per `inputs` call
UNAVAILABLE = "chunk placement unavailable: it needs a disk tier (chunk_disk_dir)"


# The registry's tiered store: host memory holds a dense chunk's rows or a compressed chunk's
# stored bytes.
HostStore = ChunkTiers[PrecomputedChunk | StoredBlob]


def form_name(codec: str | None) -> str:
    return UNCOMPRESSED if codec is None else codec


def host_form(store: HostStore, chunk_id: str) -> str | None:
    """The form host memory holds the chunk in ("none": dense), None when it holds none."""
    chunk = store.host.peek(chunk_id)
    if chunk is None:
        return None
    return form_name(chunk.header.codec if isinstance(chunk, StoredBlob) else None)


class PlacementControl:
    """The placement's side of the tiered store: `summary` gives a chunk's sizes and codec as
    registered (the registry's record: no disk header read), `report_stored_bytes` updates the
    metrics of the bytes each tier holds."""

    def __init__(
        self,
        store: HostStore,
        summary: Callable[[str], ChunkSummary | None],
        report_stored_bytes: Callable[[], None],
        disk_bytes_per_s: float | None,
    ) -> None:
        self.store = store
        self._summary = summary
        self._report_stored_bytes = report_stored_bytes
        self.usage = ChunkUsage()
        self.costs = FormCostBook(summary, disk_bytes_per_s)
        self._probe_loans: Counter[str] = Counter()
        self._round_reads: dict[str, int] = {}  # the reads `inputs` reported, ended by `apply`
        # The rows of the last probes, kept for the round (outside host memory's budget): a
        # round probes each form of a chunk with several questions at once, which would
        # otherwise read and re-encode the chunk every time.
        self._probe_rows: OrderedDict[tuple[str, str], PrecomputedChunk] = OrderedDict()
        self.counters: Counter[str] = Counter()

    # -- probes --------------------------------------------------------------------------

    def pin_form(self, chunk_id: str, form: str) -> Pinned | None:
        """The chunk's registered rows through `form`'s codec, for one probe request (held by
        the request alone; `release_probe` balances). None when the chunk cannot take the form
        or its rows cannot be read (logged, counted): the probe then reports a fallback."""
        registered = form_name(self._registered_codec(chunk_id))
        if form not in host_choices(registered):
            self.counters["probe_form_refused"] += 1
            return None
        chunk = self._probe_rows.get((chunk_id, form))
        if chunk is None:
            try:
                chunk = self._registered_rows(chunk_id)
                if chunk is not None and form != registered:
                    chunk = PrecomputedChunk(*through_codec(chunk, stored_codec(form)))
            except (CorruptChunkError, OSError, ValueError) as err:
                logger.error("placement probe of chunk %s as %s: %s", chunk_id[:12], form, err)
                self.counters["probe_read_errors"] += 1
                return None
            if chunk is None:
                return None
            self._probe_rows[(chunk_id, form)] = chunk
            self._trim_probe_rows()
        self._probe_rows.move_to_end((chunk_id, form))
        self._probe_loans[chunk_id] += 1
        return Pinned(chunk, "disk")

    def release_probe(self, chunk_id: str) -> None:
        if self._probe_loans[chunk_id] <= 0:
            raise ValueError(f"chunk {chunk_id[:12]} is not held by a probe")
        self._probe_loans[chunk_id] -= 1
        if not self._probe_loans[chunk_id]:
            del self._probe_loans[chunk_id]

    def _trim_probe_rows(self) -> None:
        """At most PROBE_ROWS_KEPT copies, and at most half of host memory's budget in all."""
        budget = self.store.host.stats().capacity_bytes // 2
        while len(self._probe_rows) > 1 and (
            len(self._probe_rows) > PROBE_ROWS_KEPT
            or sum(c.nbytes for c in self._probe_rows.values()) > budget
        ):
            self._probe_rows.popitem(last=False)

    # -- control methods -----------------------------------------------------------------

    def handle(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.store.disk is None:
            raise RuntimeError(UNAVAILABLE)
        if name == "inputs":
            return self._inputs()
        if name == "tokens":
            return {"tokens": {key: self._token_ids(key) for key in map(str, body.get("ids", []))}}
        if name == "apply":
            return self._apply({str(k): v for k, v in dict(body.get("forms", {})).items()})
        raise ValueError(f"unknown placement control method {name!r}")

    def _inputs(self) -> dict[str, Any]:
        self._probe_rows.clear()  # a new round: nothing of the last one's probes is reused
        assert self.store.disk is not None
        keys = [key for key in self.store.stored_keys() if key in self.store.disk]
        deadline = time.perf_counter() + MEASURE_BUDGET_S
        for key in keys:  # the measuring: at least one chunk a call, then within the budget
            if key not in self.costs:
                self._measure_logged(key)
                if time.perf_counter() >= deadline:
                    break
        per_token = self.costs.per_token()
        self._round_reads = self.usage.reads()
        chunks = []
        for key in keys:
            costs = self.costs.of(key, per_token)
            if costs is None:
                continue
            use = self.usage.use(key)
            chunks.append(
                {
                    "id": key,
                    "num_tokens": costs.num_tokens,
                    "registered": form_name(self._registered_codec(key)),
                    "host_form": host_form(self.store, key),
                    "nbytes": costs.nbytes,
                    "decode_s": costs.decode_s,
                    "estimated": costs.estimated,
                    "frequency": use.frequency,
                    "questions": [list(q) for q in use.questions],
                }
            )
        if keys and self.costs.disk_rate() is None:  # chunks measured from host memory's copies
            self._read_disk(keys[0])  # for its timing only
        listed = {chunk["id"] for chunk in chunks}
        outside = sum(chunk.nbytes for key, chunk in self.store.host.items() if key not in listed)
        return {
            "chunks": chunks,
            "stored": keys,  # every chunk the disk holds, listed or not
            "capacities": {
                "host": self.store.host.stats().capacity_bytes,
                "disk": self.store.disk.stats().capacity_bytes,
            },
            "host_bytes_outside": outside,  # chunks not listed: the plan leaves them their room
            "disk_bytes_per_s": self.costs.disk_rate(),
            "counters": dict(self.counters),
        }

    def _token_ids(self, key: str) -> list[int] | None:
        header = self.store.header(key)
        return None if header is None else list(header.token_ids)

    def _apply(self, forms: dict[str, Any]) -> dict[str, Any]:
        planned = {key: None if form is None else str(form) for key, form in forms.items()}
        for key, form in planned.items():  # every form checked before anything changes
            registered = form_name(self._registered_codec(key))
            if form is not None and form not in host_choices(registered):
                raise ValueError(
                    f"chunk {key[:12]} registered as {registered} cannot be held as {form}"
                )
        # A placement decides what host memory holds: reads must not put chunks back.
        self.store.promote_on_read = False
        per_token = self.costs.per_token()

        def order(item: tuple[str, str | None]) -> tuple[int, int]:
            key, form = item  # drops, then shrinks, then grows (each makes room for the next)
            if form is None:
                return (0, 0)
            costs = self.costs.of(key, per_token)
            size = 0 if costs is None else costs.nbytes.get(form, 0)
            change = size - self._host_bytes(key)
            return (1 if change <= 0 else 2, change)

        outcomes: Counter[str] = Counter()
        for key, form in sorted(planned.items(), key=order):
            outcome = self._place(key, form)
            outcomes[outcome] += 1
            self.counters[f"placement_{outcome}"] += 1
        self.usage.end_round(self.store.stored_keys(), self._round_reads)
        self._round_reads = {}
        self._probe_rows.clear()
        self._report_stored_bytes()
        return {"outcomes": dict(outcomes)}

    def _place(self, key: str, form: str | None) -> str:
        if self.store.disk is None or key not in self.store.disk:
            return "gone"  # deleted or evicted by the disk budget since the inputs
        if form == host_form(self.store, key):
            return "kept"
        if form is None:
            return "dropped" if self.store.replace_in_host(key, None) else "busy"
        if self.store.host.pinned(key):
            return "busy"
        try:
            chunk = self._host_chunk(key, form)
        except (CorruptChunkError, OSError) as err:
            logger.error("placement of chunk %s as %s: %s", key[:12], form, err)
            return "gone"
        if chunk is None:
            return "gone"
        return "changed" if self.store.replace_in_host(key, chunk) else "no_room"

    # -- internals -----------------------------------------------------------------------

    def _registered_codec(self, key: str) -> str | None:
        """How the chunk was registered: the form every lower tier keeps (None: dense)."""
        summary = self._summary(key)
        return None if summary is None else summary.codec

    def _registered_rows(self, key: str) -> PrecomputedChunk | None:
        """The chunk's rows as registered (a compressed registration decoded): host memory's
        copy when it holds that form, else the disk's."""
        registered = self._registered_codec(key)
        held = self.store.host.peek(key)
        if held is not None and host_form(self.store, key) == form_name(registered):
            return _dense(held)
        return self._read_disk(key)

    def _read_disk(self, key: str) -> PrecomputedChunk | None:
        """The chunk's registered rows from disk (None: not there), the read timed."""
        if self.store.disk is None:
            return None
        began = time.perf_counter()
        stored = self.store.disk.get(key)
        if stored is None:
            return None
        elapsed = time.perf_counter() - began
        rows = _dense(stored)
        self.costs.note_read(
            stored.nbytes if isinstance(stored, StoredBlob) else rows.nbytes, elapsed
        )
        return rows

    def _host_chunk(self, key: str, form: str) -> PrecomputedChunk | StoredBlob | None:
        rows = self._registered_rows(key)
        if rows is None:
            return None
        if form == UNCOMPRESSED:
            return rows
        return compressed_blob(key, rows, stored_codec(form))

    def _measure_logged(self, key: str) -> None:
        try:
            self._measure(key)
        except (CorruptChunkError, OSError) as err:
            logger.error("placement: chunk %s unreadable: %s", key[:12], err)

    def _measure(self, key: str) -> None:
        rows = self._registered_rows(key)
        if rows is not None:
            self.costs.measure(key, rows, form_name(self._registered_codec(key)))

    def _host_bytes(self, key: str) -> int:
        held = self.store.host.peek(key)
        return 0 if held is None else int(held.nbytes)

    def forget(self, chunk_ids: list[str]) -> None:
        self.costs.forget(chunk_ids)
        for key in chunk_ids:
            for form in CODEC_ORDER:
                self._probe_rows.pop((key, form), None)
        self.usage.forget(chunk_ids)


def _dense(stored: object) -> PrecomputedChunk:
    """Every row of a chunk held dense or as stored bytes (each compressed layer verified)."""
    if isinstance(stored, PrecomputedChunk):
        return stored
    if isinstance(stored, StoredBlob):
        return PrecomputedChunk(*decode_chunk(stored.data, stored.header.key, stored.header.key))
    return PrecomputedChunk(*stored)  # type: ignore[misc]  # ChunkTensors from a tier
