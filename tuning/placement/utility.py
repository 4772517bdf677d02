"""The utility of keeping a context's KV one way: EvicPress §4.2,
Util(method, ratio, device) = (alpha * quality - TTFT) * frequency.

An option is a (tier, codec) with its stored size, the quality of answers from it (similarity to
the answers from the uncompressed KV, 1.0 uncompressed) and the TTFT a request pays to load it
off that tier. Not storing the context at all is an option too (`tier = None`): the request
recomputes it, at full quality and the prefill's TTFT.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

UNCOMPRESSED = "none"


@dataclass(frozen=True)
class Option:
    tier: str | None  # None: not stored, recomputed when asked for
    codec: str  # "none", "int8", "knorm:0.5", ...
    nbytes: int  # bytes it takes on its tier (0 when not stored)
    quality: float
    ttft_s: float

    @property
    def stored(self) -> bool:
        return self.tier is not None


@dataclass(frozen=True)
class ContextProfile:
    """A context (a registered chunk) and every way it can be kept."""

    key: str
    frequency: float  # accesses per unit of time (or in the window profiled)
    options: tuple[Option, ...]
    # False: the slowest tier keeps every context whatever the placement chooses (a server
    # whose disk keeps every chunk), so recomputing is not an option to offer.
    recomputable: bool = True

    def __post_init__(self) -> None:
        if self.frequency < 0:
            raise ValueError(f"{self.key}: frequency must be >= 0, got {self.frequency}")
        if self.recomputable and not any(not option.stored for option in self.options):
            raise ValueError(f"{self.key}: the options must include recomputing (tier None)")


def utility(option: Option, alpha: float, frequency: float) -> float:
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    return (alpha * option.quality - option.ttft_s) * frequency


def allowed(options: Sequence[Option], quality_floor: float) -> list[Option]:
    """The options at or above the quality floor (recomputing is always allowed)."""
    return [o for o in options if not o.stored or o.quality >= quality_floor]
