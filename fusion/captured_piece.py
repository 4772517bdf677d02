"""Pieces of a prefilled prompt made ready for the chunk store, from the rows the prefill
computed: keys rotated back to pre-RoPE from the positions they were computed at, one copy of
each piece's rows (a view would keep the whole prompt's rows alive as long as any one piece of
it stays stored), and the piece's stored frequency scores. Runs on a background thread in the
server (`sglang_ext/chunk_fusion/auto_capture.py`); torch only.
"""

from __future__ import annotations

import dataclasses

import torch

from sglang_hicache_ext.fusion.frequency import stacked_frequency_scores
from sglang_hicache_ext.fusion.rope import LayerRopes, unrotate_layers


@dataclasses.dataclass(frozen=True)
class CapturedPiece:
    """A piece ready for the store: its tokens, what came before it, its pre-RoPE rows."""

    chunk_id: str
    token_ids: list[int]
    prefix: tuple[int, ...]
    keys: list[torch.Tensor]  # per layer
    values: list[torch.Tensor]
    freq_scores: torch.Tensor


def prepared_pieces(
    tokens: list[int],
    spans: list[tuple[int, int, str]],
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    rope: LayerRopes,
    alpha: float,
) -> list[CapturedPiece]:
    """The pieces at `spans` (start, end, chunk id) of `tokens` with their rows: `keys` and
    `values` are the rows of all of them, in order, as the pool held them ([L, n, H, D]); keys
    rotated back from `positions`, one copy per piece, scores."""
    keys = unrotate_layers(keys, positions.to(keys.device), rope).cpu()
    values = values.cpu()
    ready, offset = [], 0
    for start, end, chunk_id in spans:
        rows = slice(offset, offset + end - start)
        piece_keys, piece_values = keys[:, rows].clone(), values[:, rows].clone()
        ready.append(
            CapturedPiece(
                chunk_id,
                tokens[start:end],
                tuple(tokens[:start]),
                list(piece_keys.unbind(0)),
                list(piece_values.unbind(0)),
                stacked_frequency_scores(piece_keys, piece_values, alpha),
            )
        )
        offset += end - start
    return ready
