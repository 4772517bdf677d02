"""The method names of `benchmarks/fusion_retention.py`: `full`, `reuse`,
`<selector>[+sink<N>]@<ratio>` (`default`: the server's default selector and sinks), then
optionally `#<codec>` (chunks stored through a codec) and `:keep<C>` (decode-time eviction)."""

from __future__ import annotations

from sglang_hicache_ext.fusion import make_selector
from sglang_hicache_ext.fusion.selectors import Selector
from sglang_hicache_ext.sglang_ext.server.settings import ExtensionSettings

DEFAULT_SELECTOR = ExtensionSettings().fusion_selector
DEFAULT_SINK_TOKENS = ExtensionSettings().fusion_sink_tokens


def split_codec(method: str) -> tuple[str, str | None]:
    """`<method>#<codec>` -> (method, codec); the codec is None for uncompressed chunks."""
    name, sep, codec = split_keep(method)[0].partition("#")
    return name, codec if sep else None


def split_keep(method: str) -> tuple[str, float | None]:
    """`<method>:keep<C>` -> (method, C); C is None when the decode keeps every token."""
    name, sep, keep = method.partition(":keep")
    return name, float(keep) if sep else None


def parse_method(method: str) -> Selector:
    if method in ("full", "reuse"):
        return make_selector(method, 1.0 if method == "full" else 0.0)
    name, _, ratio = method.partition("@")
    name, plus, sinks = name.partition("+sink")
    if name == "default":  # the server's default: its selector and, unless given, its sinks
        name, sinks = DEFAULT_SELECTOR, sinks if plus else str(DEFAULT_SINK_TOKENS)
    return make_selector(name, float(ratio), sink_tokens=int(sinks or 0))
