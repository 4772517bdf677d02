"""The value types settings and per-request options share, each with its own check (so both
refuse a bad value alike, with the same words)."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import AfterValidator, Field


def selector_choices() -> str:
    """What a refused selector name is told (the fusion core's selectors)."""
    # Imported when used: the fusion core imports torch; reading settings needs none of it.
    from sglang_hicache_ext.fusion.selectors import SELECTORS

    return f"is unknown; choose from {sorted(SELECTORS)}"


def _known_selector(name: str) -> str:
    from sglang_hicache_ext.fusion.selectors import SELECTORS

    if name not in SELECTORS:
        raise ValueError(selector_choices())
    return name


ChunkTierName = Literal["host", "disk", "mooncake"]  # fastest first (tiers/chunks/chunk_tiers.py)


def _tier_order(tiers: list[str]) -> list[str]:
    order = list(get_args(ChunkTierName))
    if not tiers or tiers[0] != "host":
        raise ValueError("must start with 'host' (chunks are captured into host memory)")
    if len(set(tiers)) != len(tiers) or tiers != sorted(tiers, key=order.index):
        raise ValueError(f"must list each tier once, fastest first ({', '.join(order)})")
    return tiers


def _host_port(address: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("must be host:port (mooncake_master's --rpc_address and --port)")
    return address


SelectorName = Annotated[str, AfterValidator(_known_selector)]
RecomputeRatio = Annotated[float, Field(ge=0, le=1)]
# "auto": the ratio tuned for the tier each chunk is loaded from (setting fusion_ratio_table).
AUTO_RATIO = "auto"
RatioOrAuto = RecomputeRatio | Literal["auto"]
RATIO_CHOICES = 'must be in [0, 1] or "auto"'
SinkTokens = Annotated[int, Field(ge=0)]
# A share in [0, 1]: the shadow checks' rate, a token-agreement target.
Share = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
FreshLayers = Annotated[int, Field(ge=0)]
# APE's temperature and scale of the question's attention over the chunks (1: plain attention).
ContextTempering = Annotated[float, Field(gt=0, le=4, allow_inf_nan=False)]
DECODE_CAPACITY_CHOICES = "must be in (0, 1], the share of the prompt's tokens the decode keeps"


def _decode_capacity(value: float) -> float:
    if not 0 < value <= 1:
        raise ValueError(DECODE_CAPACITY_CHOICES)
    return value


# The decode keeps this share of a fused prompt's tokens per layer and head (decode eviction).
DecodeCapacity = Annotated[float, AfterValidator(_decode_capacity)]


TierOrder = Annotated[list[ChunkTierName], AfterValidator(_tier_order)]
HostPort = Annotated[str, AfterValidator(_host_port)]


def _stored_codec(spec: str) -> str:
    # Imported when used: the codecs import torch; reading settings needs none of it.
    from sglang_hicache_ext.tiers.chunks.stored_forms import stored_codec

    stored_codec(spec)
    return spec


# "int8" or "int4" (tiers/chunks/stored_forms.py); a POST /chunks "codec" is checked alike.
ChunkCodecSpec = Annotated[str, AfterValidator(_stored_codec)]
