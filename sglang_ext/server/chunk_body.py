"""What `POST /chunks` accepts: the chunk's tokens, its codec and the prefix it is computed after.

Sizes are checked before types and before any tokenization, so an oversized body is refused
without the work it would cost; every refusal is a `RequestRefused` (a 4xx with one line).
"""

from __future__ import annotations

import asyncio
from typing import Any, NamedTuple

from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings
from sglang_hicache_ext.sglang_ext.server.request_limits import RequestRefused
from sglang_hicache_ext.tiers.chunks.stored_forms import stored_codec

# A text longer than this many characters per allowed token cannot fit: the longest tokens of
# common BPE vocabularies are runs of punctuation or spaces of a few dozen characters, so this
# bound never refuses real text and lets a huge one be refused without tokenizing it.
_MAX_CHARS_PER_TOKEN = 32
# Texts longer than this are tokenized on a worker thread so they do not stall the event loop.
_INLINE_TOKENIZE_CHARS = 4096
KEYS = frozenset({"text", "input_ids", "codec", "prefix"})


class ChunkBody(NamedTuple):
    """A registration: the chunk's token ids, the codec every tier stores it with (None: dense
    rows) and the prefix it is computed after (empty: alone at positions 0..n-1)."""

    token_ids: list[int]
    codec: str | None
    prefix: list[int]


async def parse_chunk_body(
    body: Any, manager: Any, settings: ExtensionSettings, max_tokens: int, bound: str
) -> ChunkBody:
    if not isinstance(body, dict) or ("text" in body) == ("input_ids" in body):
        raise RequestRefused(400, 'send a JSON object with exactly one of "text" or "input_ids"')
    unknown = sorted(set(body) - KEYS)
    if unknown:
        raise RequestRefused(400, f"unknown key(s) {', '.join(map(repr, unknown))[:200]}")
    key = "input_ids" if "input_ids" in body else "text"
    ids = await _token_ids(body[key], key, manager, max_tokens, f"the chunk ({bound})")
    if not ids:
        raise RequestRefused(400, "the chunk has no tokens")
    prefix = await _prefix(body, manager, settings, max_tokens, bound)
    # The registration prefills prefix + chunk as one prompt: together they must fit.
    if len(prefix) + len(ids) > max_tokens:
        raise RequestRefused(
            413,
            f"the prefix and the chunk ({len(prefix)} + {len(ids)} tokens) are longer than "
            f"{max_tokens} tokens ({bound})",
        )
    return ChunkBody(ids, _codec(body, settings), prefix)


async def _prefix(
    body: dict[str, Any], manager: Any, settings: ExtensionSettings, max_tokens: int, bound: str
) -> list[int]:
    """The body's "prefix" (text or token ids; null: alone), else the setting chunk_prefix."""
    prefix = body.get("prefix", settings.chunk_prefix)
    if prefix is None or prefix == "":
        return []
    if not isinstance(prefix, str | list):
        raise RequestRefused(400, '"prefix" must be a string, a list of token ids or null')
    key = "prefix" if isinstance(prefix, str) else "prefix ids"
    return await _token_ids(prefix, key, manager, max_tokens, f"the prefix ({bound})")


async def _token_ids(value: Any, key: str, manager: Any, max_tokens: int, what: str) -> list[int]:
    """Token ids from a list (`key` ends in "ids") or a text, within `max_tokens`."""
    too_long = f"{what} is longer than {max_tokens} tokens"
    if key.endswith("ids"):
        if not isinstance(value, list):
            raise RequestRefused(400, f'"{key.split()[0]}" must be a list of integers')
        if len(value) > max_tokens:
            raise RequestRefused(413, f"{too_long}: {len(value)} token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise RequestRefused(400, f'"{key.split()[0]}" must be a list of integers')
        ids = value
    else:
        if not isinstance(value, str) or not value.strip():
            raise RequestRefused(400, f'"{key}" must be a non-empty string')
        if len(value) > max_tokens * _MAX_CHARS_PER_TOKEN:
            raise RequestRefused(413, f"{too_long}: {len(value)} characters")
        try:  # JSON may carry lone surrogates ("\ud800"); the tokenizer raises a TypeError on them
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestRefused(400, f'"{key}" is not valid Unicode (a lone surrogate)') from None
        tokenizer = manager.tokenizer
        if tokenizer is None:
            raise RequestRefused(
                400, "this server has no tokenizer (--skip-tokenizer-init); send token ids"
            )
        if len(value) > _INLINE_TOKENIZE_CHARS:
            ids = await asyncio.to_thread(tokenizer.encode, value, add_special_tokens=False)
        else:
            ids = tokenizer.encode(value, add_special_tokens=False)
        if len(ids) > max_tokens:
            raise RequestRefused(413, f"{too_long}: {len(ids)} tokens")
    vocab_size = manager.model_config.vocab_size
    if any(not 0 <= t < vocab_size for t in ids):
        raise RequestRefused(400, f"token ids must be in [0, {vocab_size})")
    return [int(t) for t in ids]


def _codec(body: dict[str, Any], settings: ExtensionSettings) -> str | None:
    """The codec every tier stores the chunk with: the body's "codec" (null: dense rows), else
    the setting chunk_codec."""
    if "codec" not in body:
        return settings.chunk_codec
    codec = body["codec"]
    if codec is None:
        return None
    if not isinstance(codec, str):
        raise RequestRefused(400, '"codec" must be a string ("int8", "int4") or null')
    try:
        stored_codec(codec)
    except ValueError as err:
        raise RequestRefused(400, f'"codec": {err}') from None
    return codec
