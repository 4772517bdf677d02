"""The placement's scheduler side: what the profiler and the placement round need to know of
every chunk, the rows a probe reads, and applying the chosen host forms.

Control methods (`hicache_ext.placement.*`, run on the scheduler thread like every control
request, so nothing here races a forward):

- `inputs`: every chunk a lower tier holds, with its registered form, the form host memory
  holds now, its bytes and decode time in each form it may take (measured once per chunk by
  encoding its registered rows: a chunk's content never changes), its decayed read count and
  the questions real requests asked with it; the host and disk capacities and the disk's read
  rate. With `end_round` the round's reads become history (`ChunkUsage.end_round`).
- `tokens`: the token ids of the chunks to probe.
- `apply`: make host memory hold each chunk in its chosen form (or not at all); the disk
  keeps the registered rows, so nothing a placement drops from host memory is lost.

A probe request (`custom_params.hicache_ext_probe_form`) reads a chunk's registered rows from
the disk, passed through the probed codec: the answers of every form are compared with the
answers of the registered rows, whatever host memory holds at the time.
"""

from __future__ import annotations

import contextvars
import io
import logging
import statistics
import time
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING, Any

from sglang_hicache_ext.fusion.chunk import PrecomputedChunk
from sglang_hicache_ext.tiers.chunk_file import ChunkTensors
from sglang_hicache_ext.tiers.chunk_forms import (
    BlobReader,
    StoredBlob,
    encode_stored,
    parse_stored_header,
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


class FormCosts:
    """A chunk's bytes and decode seconds per form (measured once: its content is fixed)."""

    def __init__(self, nbytes: dict[str, int], decode_s: dict[str, float]) -> None:
        self.nbytes = nbytes
        self.decode_s = decode_s


class PlacementControl:
    def __init__(self, registry: ChunkRegistry, disk_bytes_per_s: float | None) -> None:
        self.registry = registry
        self.usage = ChunkUsage()
        self._disk_bytes_per_s = disk_bytes_per_s  # the throttle, when the disk has one
        self._read_rates: list[float] = []
        self._costs: dict[str, FormCosts] = {}
        self._probe_loans: Counter[str] = Counter()
        # The rows of the last probes: a round probes each form of a chunk with several
        # questions at once, which would otherwise read and re-encode the chunk every time.
        self._probe_rows: OrderedDict[tuple[str, str], PrecomputedChunk] = OrderedDict()
        self.counters: Counter[str] = Counter()

    # -- probes --------------------------------------------------------------------------

    def pin_form(self, chunk_id: str, form: str) -> Pinned | None:
        """The chunk's registered rows through `form`'s codec, for one probe request (held by
        the request alone; `unpin` balances)."""
        chunk = self._probe_rows.get((chunk_id, form))
        if chunk is None:
            rows = self._registered_rows(chunk_id)
            if rows is None:
                return None
            if form != form_name(self.registry.registered_codec(chunk_id)):
                rows = through_codec(rows, stored_codec(form))
            chunk = PrecomputedChunk(*rows)
            self._probe_rows[(chunk_id, form)] = chunk
            while len(self._probe_rows) > PROBE_ROWS_KEPT:
                self._probe_rows.popitem(last=False)
        self._probe_rows.move_to_end((chunk_id, form))
        self._probe_loans[chunk_id] += 1
        return Pinned(chunk, "disk")

    def release_probe(self, chunk_id: str) -> bool:
        """True when `chunk_id` was held by a probe (and is now released)."""
        if self._probe_loans[chunk_id] <= 0:
            return False
        self._probe_loans[chunk_id] -= 1
        return True

    # -- control methods -----------------------------------------------------------------

    def handle(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.registry.store.disk is None:
            raise RuntimeError(UNAVAILABLE)
        if name == "inputs":
            return self._inputs(bool(body.get("end_round", False)))
        if name == "tokens":
            return {"tokens": {key: self._token_ids(key) for key in map(str, body.get("ids", []))}}
        if name == "apply":
            return self._apply({str(k): v for k, v in dict(body.get("forms", {})).items()})
        raise ValueError(f"unknown placement control method {name!r}")

    def _inputs(self, end_round: bool) -> dict[str, Any]:
        self._probe_rows.clear()  # a new round: nothing of the last one's probes is reused
        store = self.registry.store
        assert store.disk is not None
        keys = [key for key in store.stored_keys() if key in store.disk]
        uses = self.usage.end_round(keys) if end_round else {k: self.usage.use(k) for k in keys}
        chunks = []
        for key in keys:
            costs = self._form_costs(key)
            summary = store.summary(key)
            if costs is None or summary is None:
                continue
            chunks.append(
                {
                    "id": key,
                    "num_tokens": summary.num_tokens,
                    "registered": form_name(self.registry.registered_codec(key)),
                    "host_form": self.registry.host_form(key),
                    "nbytes": costs.nbytes,
                    "decode_s": costs.decode_s,
                    "frequency": uses[key].frequency,
                    "questions": [list(q) for q in uses[key].questions],
                }
            )
        disk_stats = store.disk.stats()
        return {
            "chunks": chunks,
            "capacities": {"host": store.host.stats().capacity_bytes, "disk": disk_stats.capacity_bytes},
            "disk_bytes_per_s": self._disk_rate(),
            "counters": dict(self.counters),
        }

    def _token_ids(self, key: str) -> list[int] | None:
        header = self.registry.store.header(key)
        return None if header is None else list(header.token_ids)

    def _apply(self, forms: dict[str, Any]) -> dict[str, Any]:
        store = self.registry.store
        # A placement decides what host memory holds: reads must not put chunks back.
        store.promote_on_read = False
        outcomes: Counter[str] = Counter()
        # Removals first: they make the room the placed forms take.
        for key, form in sorted(forms.items(), key=lambda item: item[1] is not None):
            outcome = self._place(key, None if form is None else str(form))
            outcomes[outcome] += 1
            self.counters[f"placement_{outcome}"] += 1
        return {"outcomes": dict(outcomes)}

    def _place(self, key: str, form: str | None) -> str:
        store = self.registry.store
        if store.disk is None or key not in store.disk:
            return "gone"  # deleted or evicted by the disk budget since the inputs
        if form == self.registry.host_form(key):
            return "kept"
        if form is None:
            return "dropped" if store.replace_in_host(key, None)[0] else "busy"
        registered = form_name(self.registry.registered_codec(key))
        if form not in host_choices(registered):
            raise ValueError(f"chunk {key[:12]} registered as {registered} cannot be held as {form}")
        chunk = self._host_chunk(key, form, registered)
        if chunk is None:
            return "gone"
        placed, lost = store.replace_in_host(key, chunk)
        self.registry.forget(lost)
        return "changed" if placed else "busy"

    # -- internals -----------------------------------------------------------------------

    def _registered_rows(self, key: str) -> ChunkTensors | None:
        """The chunk's rows as registered (a compressed registration decoded), from the disk."""
        disk = self.registry.store.disk
        if disk is None:
            return None
        began = time.perf_counter()
        stored = disk.get(key)
        if stored is None:
            return None
        if isinstance(stored, StoredBlob):
            elapsed = time.perf_counter() - began
            self._note_read(stored.nbytes, elapsed)
            reader = BlobReader(stored)
            layers = [reader.read(layer, None) for layer in range(stored.header.num_layers)]
            header = stored.header
            return ChunkTensors(
                header.token_ids,
                tuple(rows.keys for rows in layers),
                tuple(rows.values for rows in layers),
                header.freq_scores.clone(),
                header.alpha,
            )
        self._note_read(PrecomputedChunk(*stored).nbytes, time.perf_counter() - began)
        return stored

    def _host_chunk(self, key: str, form: str, registered: str) -> Any:
        rows = self._registered_rows(key)
        if rows is None:
            return None
        if form == UNCOMPRESSED:
            return self.registry.as_host_chunk(rows)
        header, data = encode_stored(key, rows, stored_codec(form))
        parsed = parse_stored_header(io.BytesIO(header), key, rows_follow=False)
        return self.registry.as_host_chunk(StoredBlob(parsed, header + data))

    def _form_costs(self, key: str) -> FormCosts | None:
        costs = self._costs.get(key)
        if costs is not None:
            return costs
        rows = self._registered_rows(key)
        if rows is None:
            return None
        registered = form_name(self.registry.registered_codec(key))
        nbytes: dict[str, int] = {}
        decode_s: dict[str, float] = {}
        for form in host_choices(registered):
            if form == UNCOMPRESSED:
                nbytes[form], decode_s[form] = PrecomputedChunk(*rows).nbytes, 0.0
                continue
            header, data = encode_stored(key, rows, stored_codec(form))
            blob = StoredBlob(parse_stored_header(io.BytesIO(header), key, rows_follow=False), header + data)
            reader = BlobReader(blob)
            began = time.perf_counter()
            for layer in range(blob.header.num_layers):
                reader.read(layer, None)
            nbytes[form], decode_s[form] = blob.nbytes, time.perf_counter() - began
        costs = self._costs[key] = FormCosts(nbytes, decode_s)
        return costs

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
