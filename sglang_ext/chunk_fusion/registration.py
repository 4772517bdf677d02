"""What a chunk registration request carries, and who may send one.

`POST /chunks` registers a chunk with a prefill-only generate request whose `custom_params`
carry internal keys: the chunk's id, the codec its tiers store it with, and how many first
tokens are the prefix it is computed after. The scheduler's tree cache reads them when it
captures the chunk (`registry.py`).
"""

from __future__ import annotations

import contextvars
from typing import Any

from sglang_hicache_ext.fusion.chunk import chunk_hash

REGISTER_PARAM = "hicache_ext_register_chunk"
CODEC_PARAM = "hicache_ext_chunk_codec"  # with REGISTER_PARAM: the codec every tier stores it with
# With REGISTER_PARAM: how many of the request's first tokens are the prefix, not the chunk.
PREFIX_PARAM = "hicache_ext_chunk_prefix_tokens"

# Set by `POST /chunks` around its own prefill request. A request carrying REGISTER_PARAM
# without it came from a client (`/generate`, `/v1/completions`, ...) and is refused: only the
# route checks the body's size, the tokens and the rate, and only the route's auth applies.
registering_chunk: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "hicache_ext_registering_chunk", default=False
)


def registration_id(req: Any) -> str | None:
    """The chunk id a request registers, if it is a registration request."""
    params = getattr(req.sampling_params, "custom_params", None) or {}
    value = params.get(REGISTER_PARAM)
    return value if isinstance(value, str) else None


def registration_codec(req: Any) -> str | None:
    """The codec spec a registration request asks for (checked by the route), if any."""
    params = getattr(req.sampling_params, "custom_params", None) or {}
    value = params.get(CODEC_PARAM)
    return value if isinstance(value, str) else None


def registration_prefix_tokens(req: Any) -> int:
    """How many first tokens of a registration request are the prefix it was computed after."""
    params = getattr(req.sampling_params, "custom_params", None) or {}
    value = params.get(PREFIX_PARAM, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def prefix_id(prefix: tuple[int, ...] | list[int]) -> str:
    """What a chunk records of the prefix it was computed after ("" when alone)."""
    return chunk_hash(prefix) if prefix else ""
