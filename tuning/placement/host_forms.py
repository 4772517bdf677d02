"""What host memory holds of each chunk, chosen by the placement (Algorithm 1 over EvicPress's
utility) on a server whose disk keeps every chunk's registered rows.

Per chunk the options are: host memory in any form at least as compressed as the registered
one (dense, int8, int4), whose delay is decoding that form; or the disk in the registered form
(reading its bytes at the disk's rate, then decoding). The fused prefill's compute is the same
for every option of a chunk, so it cancels out of every choice the placement makes (Algorithm 1
compares options of one chunk) and the TTFT of an option is counted from it. Costs add up
rather than overlap: on a 2-core CPU the layer loader's thread competes with the compute
(`docs/compression-placement.md` measured int8 host hits at 0.73 s against 0.65 s dense).
Recomputing is not an option: the disk keeps every chunk it holds whatever host memory holds
(its own budget, `chunk_disk_bytes`, evicts by recency), so a chunk host memory does not hold
is read from disk. A chunk never read gets a tiny frequency, so that ties go to the option that
serves a read best.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sglang_hicache_ext.tuning.placement.greedy import Placement, place
from sglang_hicache_ext.tuning.placement.utility import UNCOMPRESSED, ContextProfile, Option

HOST = "host"
DISK = "disk"
UNREAD_FREQUENCY = 1e-3
# From the least to the most compressed: a form can be made from any form before it.
CODEC_ORDER = (UNCOMPRESSED, "int8", "int4")


@dataclass(frozen=True)
class ChunkForms:
    """One chunk as the scheduler measured it."""

    chunk_id: str
    num_tokens: int
    registered: str  # the form every lower tier keeps ("none": dense rows)
    nbytes: Mapping[str, int]  # bytes in host memory per form
    decode_s: Mapping[str, float]  # seconds to decode every layer of a form ("none": 0)
    quality: Mapping[str, float]  # probed quality per form (the registered form is 1.0)


@dataclass(frozen=True)
class Timing:
    """What moving a chunk costs on this server."""

    disk_bytes_per_s: float

    def __post_init__(self) -> None:
        if not self.disk_bytes_per_s > 0:
            raise ValueError(f"disk_bytes_per_s must be > 0, got {self.disk_bytes_per_s}")


def host_choices(registered: str) -> tuple[str, ...]:
    """The forms host memory may hold of a chunk registered as `registered`."""
    if registered not in CODEC_ORDER:
        raise ValueError(f"unknown registered form {registered!r}; known {CODEC_ORDER}")
    return CODEC_ORDER[CODEC_ORDER.index(registered) :]


def chunk_profile(chunk: ChunkForms, frequency: float, timing: Timing) -> ContextProfile:
    """Every option of one chunk; forms without a probed quality are left out."""
    disk_bytes = chunk.nbytes[chunk.registered]
    disk_s = disk_bytes / timing.disk_bytes_per_s + chunk.decode_s[chunk.registered]
    options = [Option(DISK, chunk.registered, disk_bytes, 1.0, disk_s)]
    for form in host_choices(chunk.registered):
        quality = 1.0 if form == chunk.registered else chunk.quality.get(form)
        if quality is not None and form in chunk.nbytes:
            options.append(Option(HOST, form, chunk.nbytes[form], quality, chunk.decode_s[form]))
    return ContextProfile(
        chunk.chunk_id, max(frequency, UNREAD_FREQUENCY), tuple(options), recomputable=False
    )


def plan_host_forms(
    chunks: Sequence[ChunkForms],
    frequencies: Mapping[str, float],
    timing: Timing,
    capacities: Mapping[str, int],
    alpha: float,
    quality_floor: float,
) -> tuple[dict[str, str | None], Placement]:
    """The form host memory holds of each chunk (None: none, requests read it from disk)."""
    profiles = [chunk_profile(c, frequencies.get(c.chunk_id, 0.0), timing) for c in chunks]
    # The disk holds these chunks now: they fit it, whatever its files' headers add.
    on_disk = sum(c.nbytes[c.registered] for c in chunks)
    tiers = {HOST: capacities[HOST], DISK: max(capacities[DISK], on_disk)}
    placement = place(profiles, tiers, alpha, quality_floor)
    forms = {
        key: option.codec if option.tier == HOST else None
        for key, option in placement.chosen.items()
    }
    return forms, placement
