"""Codec specs as settings and requests write them: "int8", "int4", "<scorer>:<drop ratio>"."""

from __future__ import annotations

from sglang_hicache_ext.tiers.chunks.codecs.base import KVCodec
from sglang_hicache_ext.tiers.chunks.codecs.dropping import TokenDroppingCodec
from sglang_hicache_ext.tiers.chunks.codecs.quantized import QuantizedCodec
from sglang_hicache_ext.tiers.chunks.codecs.token_scores import SCORERS

QUANTIZED = {"int8": 8, "int4": 4}


def codec_choices() -> str:
    return (
        f"int8, int4, or <scorer>:<ratio in (0, 1)> with a scorer of {', '.join(sorted(SCORERS))}"
    )


def parse_codec(spec: str) -> KVCodec:
    """The codec of `spec`; ValueError with the choices for an unknown one or a bad ratio."""
    if spec in QUANTIZED:
        return QuantizedCodec(QUANTIZED[spec])
    name, sep, ratio_text = spec.partition(":")
    if not sep or name not in SCORERS:
        raise ValueError(f"unknown codec {spec!r}; choose {codec_choices()}")
    try:
        ratio = float(ratio_text)
    except ValueError:
        raise ValueError(f"codec {spec!r}: the drop ratio must be a number in (0, 1)") from None
    if not 0 < ratio < 1:
        raise ValueError(f"codec {spec!r}: the drop ratio must be in (0, 1), got {ratio:g}")
    return TokenDroppingCodec(name, ratio)
