"""The placement's scheduler side: what the profiler and the placement round need to know of
every chunk, the rows a probe reads, and applying the chosen host forms.

Control methods (`hicache_ext.placement.*`, run on the scheduler thread like every control
request, so they never run during a forward; the tiered store's promotion thread is the only
other writer of host memory, and it stands down once a placement has run):

- `inputs`: every chunk the disk holds, with its registered form, the form host memory holds
  now, its bytes and decode time in each form it may take (measured by encoding its registered
  rows; chunks are measured until `MEASURE_BUDGET_S` has passed in the call, one chunk at a
  time, so one call stalls the scheduler for about that long; the others get the per-token
  costs of those measured, marked `estimated`), its decayed read count and the questions real
  requests asked with it; the host and disk capacities, the host bytes of chunks not in the
  list (the plan must leave them their room) and the disk's read rate.
- `tokens`: the token ids of the chunks to probe.
- `apply`: make host memory hold each chunk in its chosen form (or not at all): drops, then
  shrinks, then grows, nothing evicted for a grow that does not fit (`no_room`), a chunk a
  running request holds left as it is (`busy`); then the reads counted at `inputs` become history (later ones stay in the
  next round). The
  disk keeps the registered rows, so a placement never loses a chunk (the disk's own budget
  may evict it later, as before).

A probe request (`custom_params.hicache_ext_probe_form`) reads a chunk's registered rows passed
through the probed codec, whatever host memory holds at the time: its answers are compared with
the answers of the registered rows.
"""

from __future__ import annotations

import contextvars
import logging
import statistics
import time
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING, Any, NamedTuple

from sglang_hicache_ext.fusion.chunk import PrecomputedChunk
from sglang_hicache_ext.tiers.chunk_file import CorruptChunkError
from sglang_hicache_ext.tiers.chunk_forms import (
    BlobReader,
    StoredBlob,
    compressed_blob,
    decode_chunk,
    stored_codec,
    through_codec,
)
from sglang_hicache_ext.tiers.chunk_tiers import Pinned
from sglang_hicache_ext.tuning.placement.host_forms import CODEC_ORDER, host_choices
from sglang_hicache_ext.tuning.placement.usage import ChunkUsage
from sglang_hicache_ext.tuning.placement.utility import UNCOMPRESSED

if TYPE_CHECKING:
    from sglang_hicache_ext.sglang_ext.chunk_fusion.registry import ChunkRegistry

logger = logging.getLogger(__name__)

PROBE_FORM_PARAM = "hicache_ext_probe_form"  # internal: set by the placement's profiler only
# Set by the placement round around its probe requests; a client sending PROBE_FORM_PARAM is
# refused (a probe reads the disk and decodes whole chunks: not a client's knob).
probing_placement: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "hicache_ext_probing_placement", default=False
)
PROBE_ROWS_KEPT = 12  # (chunk, form) pairs: the probes in flight cover two or three chunks
MEASURE_BUDGET_S = 0.5  # of encoding and decoding chunks per `inputs` call
UNAVAILABLE = "chunk placement unavailable: it needs a disk tier (chunk_disk_dir)"


def check_probe_params(custom_params: Any) -> None:
    """ValueError (HTTP 400) for a probe key a client sent, or a form no chunk can take."""
    if not isinstance(custom_params, dict) or PROBE_FORM_PARAM not in custom_params:
        return
    if not probing_placement.get():
        raise ValueError(f"custom_params.{PROBE_FORM_PARAM} is internal to the chunk placement")
    if custom_params[PROBE_FORM_PARAM] not in CODEC_ORDER:
        raise ValueError(f"custom_params.{PROBE_FORM_PARAM} must be one of {CODEC_ORDER}")


def probe_form_of(req: Any) -> str | None:
    """The form a probe request reads its chunks in (checked when it came in), else None."""
    params = getattr(req.sampling_params, "custom_params", None) or {}
    form = params.get(PROBE_FORM_PARAM)
    return form if isinstance(form, str) else None


def form_name(codec: str | None) -> str:
    return UNCOMPRESSED if codec is None else codec


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


class PlacementControl:
    def __init__(self, registry: ChunkRegistry, disk_bytes_per_s: float | None) -> None:
        self.registry = registry
        self.usage = ChunkUsage()
        self._disk_bytes_per_s = disk_bytes_per_s  # the throttle, when the disk has one
        self._read_rates: list[float] = []
        self._costs: dict[str, FormCosts] = {}  # measured (a chunk's content never changes)
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
        registered = form_name(self.registry.registered_codec(chunk_id))
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
        budget = self.registry.store.host.stats().capacity_bytes // 2
        while len(self._probe_rows) > 1 and (
            len(self._probe_rows) > PROBE_ROWS_KEPT
            or sum(c.nbytes for c in self._probe_rows.values()) > budget
        ):
            self._probe_rows.popitem(last=False)

    # -- control methods -----------------------------------------------------------------

    def handle(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.registry.store.disk is None:
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
        store = self.registry.store
        assert store.disk is not None
        keys = [key for key in store.stored_keys() if key in store.disk]
        deadline = time.perf_counter() + MEASURE_BUDGET_S
        for key in keys:  # the measuring: at least one chunk a call, then within the budget
            if key not in self._costs:
                self._measure_logged(key)
                if time.perf_counter() >= deadline:
                    break
        per_token = self._per_token()
        self._round_reads = self.usage.reads()
        chunks = []
        for key in keys:
            costs = self._costs.get(key) or self._estimate(key, per_token)
            if costs is None:
                continue
            use = self.usage.use(key)
            chunks.append(
                {
                    "id": key,
                    "num_tokens": costs.num_tokens,
                    "registered": form_name(self.registry.registered_codec(key)),
                    "host_form": self.registry.host_form(key),
                    "nbytes": costs.nbytes,
                    "decode_s": costs.decode_s,
                    "estimated": costs.estimated,
                    "frequency": use.frequency,
                    "questions": [list(q) for q in use.questions],
                }
            )
        if keys and self._disk_rate() is None:  # chunks measured from host memory's copies
            self._time_disk_read(keys[0])
        listed = {chunk["id"] for chunk in chunks}
        outside = sum(chunk.nbytes for key, chunk in store.host.items() if key not in listed)
        return {
            "chunks": chunks,
            "stored": keys,  # every chunk the disk holds, listed or not
            "capacities": {
                "host": store.host.stats().capacity_bytes,
                "disk": store.disk.stats().capacity_bytes,
            },
            "host_bytes_outside": outside,  # chunks not listed: the plan leaves them their room
            "disk_bytes_per_s": self._disk_rate(),
            "counters": dict(self.counters),
        }

    def _token_ids(self, key: str) -> list[int] | None:
        header = self.registry.store.header(key)
        return None if header is None else list(header.token_ids)

    def _apply(self, forms: dict[str, Any]) -> dict[str, Any]:
        store = self.registry.store
        planned = {key: None if form is None else str(form) for key, form in forms.items()}
        for key, form in planned.items():  # every form checked before anything changes
            registered = form_name(self.registry.registered_codec(key))
            if form is not None and form not in host_choices(registered):
                raise ValueError(f"chunk {key[:12]} registered as {registered} cannot be held as {form}")
        # A placement decides what host memory holds: reads must not put chunks back.
        store.promote_on_read = False
        per_token = self._per_token()

        def order(item: tuple[str, str | None]) -> tuple[int, int]:
            key, form = item  # drops, then shrinks, then grows (each makes room for the next)
            if form is None:
                return (0, 0)
            costs = self._costs.get(key) or self._estimate(key, per_token)
            size = 0 if costs is None else costs.nbytes.get(form, 0)
            change = size - self._host_bytes(key)
            return (1 if change <= 0 else 2, change)

        outcomes: Counter[str] = Counter()
        for key, form in sorted(planned.items(), key=order):
            outcome = self._place(key, form)
            outcomes[outcome] += 1
            self.counters[f"placement_{outcome}"] += 1
        self.usage.end_round(self.registry.store.stored_keys(), self._round_reads)
        self._round_reads = {}
        self._probe_rows.clear()
        self.registry.report_stored_bytes()
        return {"outcomes": dict(outcomes)}

    def _place(self, key: str, form: str | None) -> str:
        store = self.registry.store
        if store.disk is None or key not in store.disk:
            return "gone"  # deleted or evicted by the disk budget since the inputs
        if form == self.registry.host_form(key):
            return "kept"
        if form is None:
            return "dropped" if store.replace_in_host(key, None) else "busy"
        if store.host.pinned(key):
            return "busy"
        try:
            chunk = self._host_chunk(key, form)
        except (CorruptChunkError, OSError) as err:
            logger.error("placement of chunk %s as %s: %s", key[:12], form, err)
            return "gone"
        if chunk is None:
            return "gone"
        return "changed" if store.replace_in_host(key, chunk) else "no_room"

    # -- internals -----------------------------------------------------------------------

    def _registered_rows(self, key: str) -> PrecomputedChunk | None:
        """The chunk's rows as registered (a compressed registration decoded): host memory's
        copy when it holds that form, else the disk's."""
        store = self.registry.store
        registered = self.registry.registered_codec(key)
        held = store.host.peek(key)
        if held is not None and self.registry.host_form(key) == form_name(registered):
            return _dense(held)
        if store.disk is None:
            return None
        began = time.perf_counter()
        stored = store.disk.get(key)
        if stored is None:
            return None
        elapsed = time.perf_counter() - began
        rows = _dense(stored)
        self._note_read(stored.nbytes if isinstance(stored, StoredBlob) else rows.nbytes, elapsed)
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
        if rows is None:
            return
        registered = form_name(self.registry.registered_codec(key))
        nbytes: dict[str, int] = {}
        decode_s: dict[str, float] = {}
        for form in host_choices(registered):
            if form == UNCOMPRESSED:
                nbytes[form], decode_s[form] = rows.nbytes, 0.0
                continue
            blob = compressed_blob(key, rows, stored_codec(form))
            reader = BlobReader(blob)
            began = time.perf_counter()
            for layer in range(blob.header.num_layers):
                reader.read(layer, None)
            nbytes[form], decode_s[form] = blob.nbytes, time.perf_counter() - began
        self._costs[key] = FormCosts(rows.num_tokens, nbytes, decode_s, estimated=False)

    def _per_token(self) -> dict[str | None, PerToken]:
        """Per registered codec: the measured chunks' mean costs per token and form."""
        groups: dict[str | None, list[FormCosts]] = {}
        for key, costs in self._costs.items():
            groups.setdefault(self.registry.registered_codec(key), []).append(costs)
        return {
            codec: PerToken(
                {f: statistics.fmean(c.nbytes[f] / c.num_tokens for c in group) for f in group[0].nbytes},
                {f: statistics.fmean(c.decode_s[f] / c.num_tokens for c in group) for f in group[0].decode_s},
            )
            for codec, group in groups.items()
        }

    def _estimate(self, key: str, per_token: dict[str | None, PerToken]) -> FormCosts | None:
        """An unmeasured chunk's costs: its registered bytes exactly (its summary), the other
        forms by the per-token costs of the measured chunks registered alike."""
        summary = self.registry.summary(key)
        alike = None if summary is None else per_token.get(summary.codec)
        if summary is None or alike is None:
            return None
        tokens = summary.num_tokens
        nbytes = {form: int(tokens * b) for form, b in alike.nbytes.items()}
        nbytes[form_name(summary.codec)] = summary.nbytes
        decode_s = {form: tokens * d for form, d in alike.decode_s.items()}
        return FormCosts(tokens, nbytes, decode_s, estimated=True)

    def _host_bytes(self, key: str) -> int:
        held = self.registry.store.host.peek(key)
        return 0 if held is None else int(held.nbytes)

    def _time_disk_read(self, key: str) -> None:
        disk = self.registry.store.disk
        assert disk is not None
        began = time.perf_counter()
        stored = disk.get(key)
        if stored is not None:
            nbytes = stored.nbytes if isinstance(stored, StoredBlob) else _dense(stored).nbytes
            self._note_read(nbytes, time.perf_counter() - began)

    def _note_read(self, nbytes: int, seconds: float) -> None:
        if seconds > 0:
            self._read_rates = [*self._read_rates[-63:], nbytes / seconds]

    def _disk_rate(self) -> float | None:
        """The throttle when the disk has one, else the median of the reads timed here (a
        warm page cache makes them fast: a real cold read is slower)."""
        if self._disk_bytes_per_s:
            return float(self._disk_bytes_per_s)
        return statistics.median(self._read_rates) if self._read_rates else None

    def forget(self, chunk_ids: list[str]) -> None:
        for key in chunk_ids:
            self._costs.pop(key, None)
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
