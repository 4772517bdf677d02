"""Decode-time eviction after a fused prefill: which prompt tokens each layer and head keeps.

After the prefill, the decode attends a fixed capacity C of prompt tokens instead of all N
(A³'s extension, with SnapKV's selection): the system prompt and the question, every token
outside the chunks, stay whole; of the chunk tokens each layer and each KV head keeps the
C - |kept whole| with the highest observation-window score, the attention the last `window`
prompt queries pay them, summed over the window and over the query heads of the KV head's group
(grouped-query attention shares one K/V row between them), then average-pooled along the tokens
so a kept token brings its neighbours' evidence (SnapKV's clustering). Decode attention needs
no mask (a decoded token sees the whole prompt) and K is already rotated, so a kept set in any
order, a different one per head, is a valid cache as long as new tokens take their true
positions (`KVCache.next_position`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.nn.functional import avg_pool1d

from sglang_hicache_ext.fusion.request import Segment, build_layout
from sglang_hicache_ext.fusion.request_state import KVCache

DEFAULT_WINDOW = 32  # observation window: the last prompt queries (SnapKV's default)
POOL_KERNEL = 5  # tokens pooled around each score (SnapKV's default kernel)


def capacity_tokens(fraction: float, num_tokens: int) -> int:
    """Prompt tokens the decode keeps at a capacity of `fraction` of an N-token prompt."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"the decode capacity must be in (0, 1], got {fraction}")
    return max(1, math.ceil(fraction * num_tokens))


def window_scores(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Per KV head, what each of the N keys [N, Hkv, D] received from the window's queries
    [w, Hq, D] (post-RoPE, at `query_positions`): float32 [Hkv, N], pooled along the tokens."""
    num_tokens, kv_heads = keys.shape[0], keys.shape[1]
    group = queries.shape[1] // kv_heads
    q = queries.float().reshape(queries.shape[0], kv_heads, group, -1)
    logits = torch.einsum("wkgd,nkd->kgwn", q, keys.float()) * scale
    # A window query sees the keys up to its own position (the window's own tail is masked).
    visible = torch.arange(num_tokens, device=keys.device) <= query_positions.unsqueeze(1)
    logits = logits.masked_fill(~visible, float("-inf"))
    received = logits.softmax(-1).sum(dim=(1, 2))  # [Hkv, N]
    pooled = avg_pool1d(
        received.unsqueeze(1),
        POOL_KERNEL,
        stride=1,
        padding=POOL_KERNEL // 2,
        count_include_pad=False,
    )
    return pooled.squeeze(1)


def kept_positions(scores: torch.Tensor, keep_whole: torch.Tensor, capacity: int) -> torch.Tensor:
    """The prompt positions each layer and KV head keeps: int64 [L, Hkv, C'], ascending.

    scores: [L, Hkv, N] window scores; keep_whole: bool [N], positions every head keeps (the
    system prompt and the question); C' = max(capacity, |keep_whole|), at most N.
    """
    layers, heads, num_tokens = scores.shape
    whole = torch.nonzero(keep_whole.to(scores.device)).flatten()
    budget = min(max(capacity, int(whole.numel())), num_tokens) - int(whole.numel())
    ranked = scores.masked_fill(keep_whole.to(scores.device), float("-inf"))
    top = ranked.topk(budget, dim=-1).indices
    kept = torch.cat((whole.expand(layers, heads, -1), top), dim=-1)
    return kept.sort(dim=-1).values


def evict(kv: KVCache, kept: torch.Tensor) -> KVCache:
    """The prompt KV with only each layer's and head's `kept` rows [L, Hkv, C]; row i of head h
    holds that head's i-th kept token. New tokens go on at position N."""
    keys = tuple(
        _per_head_rows(k, kept[layer]).transpose(0, 1).contiguous()
        for layer, k in enumerate(kv.keys)
    )
    values = tuple(
        _per_head_rows(v, kept[layer]).transpose(0, 1).contiguous()
        for layer, v in enumerate(kv.values)
    )
    return KVCache(keys, values, next_position=kv.position)


def _per_head_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows [S, Hkv, D], index [Hkv, C] (row numbers per head) -> head h's rows [Hkv, C, D]."""
    index = index.to(rows.device).long()
    heads = torch.arange(index.shape[0], device=rows.device).unsqueeze(1)
    return rows[index, heads]


def keep_whole_mask(segments: Sequence[Segment]) -> torch.Tensor:
    """bool [N]: the tokens outside every chunk (system prompt, question, separators)."""
    return ~build_layout(list(segments)).is_chunk


def compact_kept(cache: torch.Tensor, slots: torch.Tensor, kept: torch.Tensor, first: int) -> None:
    """Move each head's kept rows, in order, into the slots of positions 0..C-1, in place.

    cache: one layer's pool [S, Hkv, D]; slots: the request's slot of each position; kept:
    [Hkv, C] ascending positions per head. Row i of head h goes to the slot of position i: a
    kept position is never below its rank, so every row is read before its slot is written
    (and all are gathered first anyway). Positions below `first` (an exact cached prefix, which
    the prefix tree owns and other requests read) are kept whole by every head, so they already
    sit in place and are not written.
    """
    heads = torch.arange(kept.shape[0], device=kept.device).unsqueeze(1)
    if first and not torch.equal(
        kept[:, :first], heads.new_tensor(range(first)).expand(kept.shape[0], -1)
    ):
        raise ValueError("every head must keep the shared positions below `first` whole")
    rows = _per_head_rows(cache, slots[kept])  # [Hkv, C, D], gathered before any write
    target = slots[first : kept.shape[1]].long().expand(kept.shape[0], -1)
    cache[target, heads] = rows[:, first:]
