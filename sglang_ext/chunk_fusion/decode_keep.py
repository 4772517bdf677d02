"""Decode-time eviction in SGLang: the prompt rows a fused request's decode attends.

After a fused prefill asked with `fusion_decode_capacity`, each layer and KV head keeps the
prompt positions `fusion.decode_eviction.kept_positions` chose; the `torch_position` attention
backend's decode then reads only those rows (plus the decoded tokens) instead of the whole
prompt. SGLang's pool gives a token one slot for every layer and head, but a slot holds each
head's row separately, so each head's kept rows are moved into the request's first C slots
(a head's i-th kept row into the slot of position i) and the decode reads C contiguous
positions. The slots after them are not freed (the request's slots stay as SGLang allocated
them, so its accounting, retraction and release are untouched); the response reports how many
prompt tokens no layer and no head keeps (`decode_unused_tokens`).

A kept set belongs to a request-pool row and to the row's generation (SGLang bumps it at every
allocation): a finished, aborted or retracted request's row goes to another request with a new
generation, and its stale kept set is never applied to it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_hicache_ext.fusion.attention import gather_attend
from sglang_hicache_ext.fusion.decode_eviction import (
    capacity_tokens,
    compact_kept,
    keep_whole_mask,
    kept_positions,
)
from sglang_hicache_ext.fusion.executor import FusionResult
from sglang_hicache_ext.fusion.request import Segment, after_exact_prefix

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class KeptRows:
    """One request's kept prompt positions [L, Hkv, C]. At the first decode step of each layer
    (every prompt row is written by then, whatever the chunked-prefill rounds) each head's kept
    rows are moved into the slots of positions 0..C-1 (`compact_kept`); from then on the decode
    reads those C contiguous positions and the decoded tokens, as a normal decode reads a
    shorter prompt."""

    generation: int
    prompt_len: int
    prefix_len: int  # exact cached prefix: slots the prefix tree owns, never written
    positions: torch.Tensor
    compacted: set[int] = field(default_factory=set)

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        row_slots: torch.Tensor,
        seq_len: int,
        scale: float,
    ) -> torch.Tensor:
        """Decode queries [q, Hq, D] of this request at `layer` over its kept prompt rows and
        every decoded token (`row_slots`: the request's req_to_token row)."""
        kept = self.positions[layer].to(row_slots.device)
        if layer not in self.compacted:
            compact_kept(k_cache, row_slots, kept, self.prefix_len)
            compact_kept(v_cache, row_slots, kept, self.prefix_len)
            self.compacted.add(layer)
        slots = torch.cat((row_slots[: kept.shape[1]], row_slots[self.prompt_len : seq_len]))
        # The decoded token sees every key: positions 0.. below its own, no mask.
        last = torch.tensor([slots.shape[0] - 1], device=query.device)
        return gather_attend(query, k_cache, v_cache, slots, last, scale)


class KeptRowsTable:
    """Kept sets by request-pool row, valid for the row's generation: one per `torch_position`
    attention backend (one per model runner), whose decode reads them."""

    def __init__(self) -> None:
        self._rows: dict[int, KeptRows] = {}
        self.decode_steps = 0  # request decode steps that attended kept rows only

    def __len__(self) -> int:
        return len(self._rows)

    def put(self, row: int, kept: KeptRows, generations: torch.Tensor) -> None:
        """Record `row`'s kept set, dropping those of rows reallocated since (each holds its
        positions and slots, ~1 MB for a 3K-token prompt of a 30-layer model)."""
        stale = [r for r, k in self._rows.items() if int(generations[r]) != k.generation]
        for r in stale:
            del self._rows[r]
        self._rows[row] = kept

    def get(self, row: int, generation: int) -> KeptRows | None:
        kept = self._rows.get(row)
        if kept is not None and kept.generation != generation:
            del self._rows[row]  # the row now serves another request
            return None
        return kept


def keep_for_decode(
    runner: Any,
    req: Any,
    row: int,
    segments: list[Segment],
    result: FusionResult,
    capacity: float,
) -> dict[str, Any]:
    """Choose and record request `row`'s kept prompt rows; returns what its response reports."""
    unsupported = _unsupported(runner, req)
    if unsupported is not None:
        # The decode attends every row: say so, never pretend.
        logger.warning("fusion_decode_capacity not applied (%s); decoding all rows", unsupported)
        return {"decode_eviction": unsupported}
    assert result.window_scores is not None, "the fused prefill was not asked for window scores"
    whole = keep_whole_mask(after_exact_prefix(segments, result.prefix_tokens))
    positions = kept_positions(
        result.window_scores, whole, capacity_tokens(capacity, result.num_tokens)
    )
    generations = runner.req_to_token_pool.req_generation
    kept = KeptRows(int(generations[row]), result.num_tokens, result.prefix_tokens, positions)
    runner.attn_backend.kept_rows.put(row, kept, generations)
    used = torch.zeros(result.num_tokens, dtype=torch.bool)
    used[positions.flatten().cpu()] = True
    return {
        "decode_capacity": capacity,
        "decode_kept_tokens": int(positions.shape[-1]),  # per layer and KV head
        "decode_unused_tokens": int((~used).sum()),  # kept by no layer and no head
    }


def _unsupported(runner: Any, req: Any) -> str | None:
    if not getattr(runner.attn_backend, "applies_kept_rows", False):
        return "unsupported_attention_backend"  # only torch_position reads kept rows
    if getattr(req, "session", None) is not None:
        # A session's next turn keeps this pool row (same generation) and reads its prompt rows
        # as its prefix; after the move they no longer hold the prompt.
        return "unsupported_session"
    return None
