"""Attention of queries at scattered, ascending positions (a fused prefill's computed tokens).

Query block by block, each block over only the keys up to its last query's position: a masked
SDPA kernel cannot skip masked-out key blocks, so one call over every key computes every
query x key pair, while the blocks compute about the visible ones (a query at position p sees
p + 1 keys).

On the CPU (with torch's flash kernel that returns log-sum-exps, and every query's own key
present) no block is one masked call over all its keys: a block is the queries of one window
of `CPU_WINDOW` positions, consecutive blocks form a stretch, and the keys before a stretch's
first query, visible to all of it, run on the flash kernel without a mask (its fastest path) in
one call for the whole stretch; each block then reads the keys from there to its last query
under a mask, and the two parts are merged by their log-sum-exps. Blocks cut by position,
not by query count, keep the masked keys near the queries however sparse the selection (a
block of 128 sparse queries spanned several hundred positions). A GQA model's query heads of
one key head are folded into the rows, so the keys and values are never copied per query
head. The plan and its masks are built once per (query positions, key positions) pair and kept
for the next call: the fused prefill attends the same positions at every layer after the
selection. (docs/auto-chunks.md, "When fusion does not pay", measures it against the masked
blocks.)

On a GPU the blocks are fewer and larger (a call must fill the chip), their bounds come from a
host copy of the positions and the mask is found by the positions tensors' identity: reading
positions back from the GPU would drain its queue at every layer (H200, Llama-3-8B shapes, 16K
tokens, r = 0.15: one masked call over every key took 2.0 ms a layer, half of it on pairs that
the mask then throws away).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.nn.functional import scaled_dot_product_attention

# Queries per SDPA call: small enough that a block's keys end near its queries, large enough
# that each call keeps both cores busy over the heads and the calls stay few.
QUERY_BLOCK = 128
# On a GPU: this many blocks (computing (1 + 1/n) / 2 of the query x key pairs), of at least
# GPU_MIN_BLOCK queries (the last one excepted), below which a call no longer fills an H200.
GPU_BLOCKS = 8
GPU_MIN_BLOCK = 256


# torch's CPU flash kernel also returns the log-sum-exp, which lets two partial attentions be
# merged exactly. It is an aten op without a public wrapper; without it the blocks take the mask
# over all their keys.
cpu_flash_with_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def ascending(positions: torch.Tensor) -> bool:
    return positions.shape[0] < 2 or bool(torch.all(positions[1:] >= positions[:-1]))


def query_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scale: float | None,
    gqa: bool,
    host_positions: torch.Tensor | None = None,
    gpu_blocks: bool | None = None,
) -> torch.Tensor:
    """`q` [1, Hq, Lq, D] at ascending `query_positions` over `k`/`v` [1, Hkv, Lk, D] at key
    positions 0..Lk-1 (`key_positions`); a query sees the keys at or before its position.
    `host_positions`: the same positions in host memory (the blocks' bounds are read there).
    `gpu_blocks`: block as for a GPU (default: when `q` is on one)."""
    gpu = q.is_cuda if gpu_blocks is None else gpu_blocks
    mask = _kept.get(
        query_positions,
        key_positions,
        ("mask", q.dtype, q.device),
        lambda: _causal_mask(query_positions, key_positions, q.dtype),
    )
    outs = []
    for start, end, visible in block_bounds(
        query_positions if host_positions is None else host_positions, gpu=gpu, num_keys=k.shape[2]
    ):
        block_mask = mask[start:end, :visible]
        if gpu:
            # The GPU's masked kernels want the mask's rows packed (a few MB a block).
            block_mask = block_mask.contiguous()
        outs.append(
            scaled_dot_product_attention(
                q[:, :, start:end],
                k[:, :, :visible],
                v[:, :, :visible],
                attn_mask=block_mask,
                scale=scale,
                enable_gqa=gqa,
            )
        )
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def fold_query_heads(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[1, Hq, L, D] -> [1, Hkv, L * group, D]: row i * group + g is query i of the g-th query
    head of its key head (query head h reads key head h // group). Attention of the folded rows
    over [1, Hkv, Lk, D] keys needs no copy of the keys per query head; a mask, if any, has
    each query's row `group` times."""
    _, heads, count, dim = q.shape
    group = heads // kv_heads
    return q.view(1, kv_heads, group, count, dim).transpose(2, 3).reshape(1, kv_heads, -1, dim)


def unfold_query_heads(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """`fold_query_heads`'s inverse for an output [1, Hkv, L * group, Dv] (or a log-sum-exp
    [1, Hkv, L * group]): [1, Hq, L, Dv] (or [1, Hq, L])."""
    kv_heads = rows.shape[1]
    group = heads // kv_heads
    tail = rows.shape[3:]
    unfolded = rows.reshape(1, kv_heads, -1, group, *tail).transpose(2, 3)
    return unfolded.reshape(1, heads, -1, *tail)


def split_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """`query_block_attention`'s result on the CPU (needs `cpu_flash_with_lse`, values of the
    queries' head size and the last query's position below Lk), with a mask only over the keys
    of each stretch of blocks (`_split_plan`): a stretch's queries read the keys before its
    first query in one unmasked call, each block the keys from there to its last query under a
    mask; the two parts are merged by their log-sum-exps. Same shapes: `q` [1, Hq, Lq, D] at
    ascending `query_positions`, `k`/`v` [1, Hkv, Lk, D] at 0..Lk-1."""
    assert cpu_flash_with_lse is not None
    _, heads, count, _ = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    rows = fold_query_heads(q, kv_heads)  # a block is a run of rows
    plan = _kept.get(
        query_positions,
        key_positions,
        ("split", q.dtype, group),
        lambda: _split_plan(query_positions, q.dtype, group),
    )

    def attend(queries: slice, keys: slice, mask: torch.Tensor | None = None) -> AttentionPart:
        rows_of = slice(queries.start * group, queries.stop * group)
        out, lse = cpu_flash_with_lse(
            rows[:, :, rows_of], k[:, :, keys], v[:, :, keys], attn_mask=mask, scale=scale
        )
        return AttentionPart(out, lse)

    value_dim = v.shape[-1]
    # Written block by block in the layout the caller reads ([L, Hq, Dv] rows): no concatenation
    # and no unfolding copy afterwards.
    result = q.new_empty((count, kv_heads, group, value_dim))
    for stretch in plan:
        stretch_start, stretch_first = stretch[0].start, stretch[0].first
        before = None
        if stretch_first > 0:
            before = attend(slice(stretch_start, stretch[-1].end), slice(stretch_first))
        for block in stretch:
            start, end = block.start, block.end
            part = attend(slice(start, end), slice(stretch_first, block.last + 1), block.mask)
            if before is not None:
                mine = slice((start - stretch_start) * group, (end - stretch_start) * group)
                part = part.merged(AttentionPart(before.out[:, :, mine], before.lse[:, :, mine]))
            # [1, Hkv, queries * group, Dv] -> [queries, Hkv, group, Dv], a view; rounded to
            # the query's dtype here, once.
            out = part.out.view(kv_heads, end - start, group, value_dim).transpose(0, 1)
            result[start:end] = out
    return result.view(count, heads, value_dim).transpose(0, 1).unsqueeze(0)


class AttentionPart(NamedTuple):
    """Attention of some rows over some of the keys, with the log-sum-exp of their logits (what
    torch's CPU flash kernel returns); two parts over disjoint keys merge exactly."""

    out: torch.Tensor
    lse: torch.Tensor

    def merged(self, other: AttentionPart) -> AttentionPart:
        """The rows' attention over both parts' keys (disjoint), each part weighted by its share
        of the softmax mass; in float32, as the kernel accumulates (the caller rounds once)."""
        weight = torch.sigmoid(other.lse.float() - self.lse.float()).unsqueeze(-1)
        out = torch.lerp(self.out.float(), other.out.float(), weight)
        return AttentionPart(out, torch.logaddexp(self.lse.float(), other.lse.float()))


# A CPU block is the queries of one window of this many positions: the keys its mask covers
# past its stretch's first query lie within a few windows of its queries, however sparse.
CPU_WINDOW = 256
# A stretch (blocks whose queries read the keys before the first of them in one call) closes
# once it holds this many queries (a call of that many rows is the kernel's efficient shape),
# or before a block would take its masks past this many positions (bounding their memory).
STRETCH_QUERIES = 256
STRETCH_SPAN = 4 * CPU_WINDOW
# 256-position windows in stretches of 256 queries: about 7 % less attention time than blocks
# of 128 queries in stretches of four blocks, on the positions of four half-new prompts'
# fused prefills (docs/auto-chunks.md, "Blocks by position").


class _Block(NamedTuple):
    """Queries start..end-1 of a CPU stretch whose first query sits at `first`; `mask` is the
    additive [rows, last - first + 1] causal mask of the block's folded rows (each query's row
    `group` times) over the keys from `first` to the block's last query `last`."""

    start: int
    end: int
    first: int
    last: int
    mask: torch.Tensor


def _split_plan(positions: torch.Tensor, dtype: torch.dtype, group: int) -> list[list[_Block]]:
    """The CPU blocks of ascending `positions` (one per window of `CPU_WINDOW` positions that
    holds queries), in stretches."""
    host = positions.tolist()
    stretches: list[list[_Block]] = []
    stretch: list[_Block] = []
    start = 0
    while start < len(host):
        window = host[start] // CPU_WINDOW
        end = start + 1
        while end < len(host) and host[end] // CPU_WINDOW == window:
            end += 1
        last = host[end - 1]
        if stretch and (
            stretch[-1].end - stretch[0].start >= STRETCH_QUERIES
            or last - stretch[0].first >= STRETCH_SPAN
        ):
            stretches.append(stretch)
            stretch = []
        first = stretch[0].first if stretch else host[start]
        keys = torch.arange(first, last + 1, device=positions.device)
        mask = _causal_mask(positions[start:end], keys, dtype).repeat_interleave(group, dim=0)
        stretch.append(_Block(start, end, first, last, mask))
        start = end
    if stretch:
        stretches.append(stretch)
    return stretches


def block_bounds(
    positions: torch.Tensor, *, gpu: bool, num_keys: int | None = None
) -> list[tuple[int, int, int]]:
    """(first query, end query, keys seen) of each block of ascending `positions`; on a GPU
    the keys seen are rounded up to a multiple of 16 (at most `num_keys`), the alignment its
    kernels want: the keys past a block's last query are masked out anyway."""
    n = positions.shape[0]
    size = max(GPU_MIN_BLOCK, -(-n // GPU_BLOCKS)) if gpu else QUERY_BLOCK
    bounds = []
    for start in range(0, n, size):
        end = min(start + size, n)
        visible = int(positions[end - 1]) + 1
        if gpu and num_keys is not None:
            visible = min(num_keys, -(-visible // 16) * 16)
        bounds.append((start, end, visible))
    return bounds


# The positions a kept object was built for: a copy (CPU, compared by value) or a reference
# (GPU, compared by identity).
PositionsKey = torch.Tensor | weakref.ref[torch.Tensor]


@dataclass(eq=False)
class _Entry:
    queries: PositionsKey
    keys: PositionsKey
    kind: Hashable
    value: Any
    finalizer: weakref.finalize | None = None


class _RecentPlans:
    """What the blocks of the last few pairs of positions need, built once per pair: the GPU's
    additive causal-by-position mask, the CPU's split plan. One per request of a batched
    prefill, whose requests take turns at every layer.

    On the CPU an entry keeps copies of its positions and a hit compares them (a few thousand
    integers, no pass over a mask), so a plan is never used for other positions. On a GPU it
    keeps references and a hit is the same tensors: comparing values would read the GPU back at
    every layer. A caller on a GPU must therefore never change a positions tensor in place (the
    executor builds them per request; RoPE's tables rely on the same). An entry is dropped when
    its query positions are freed (the end of a request) or when newer ones push it out, so a
    long prompt's plan does not outlive it."""

    SIZE = 4

    def __init__(self) -> None:
        # Reentrant: a finalizer (`_drop`) can run inside `get`, when an allocation there
        # triggers the cycle collector.
        self._lock = threading.RLock()
        self._entries: list[_Entry] = []

    def get(
        self,
        query_positions: torch.Tensor,
        key_positions: torch.Tensor,
        kind: Hashable,
        build: Callable[[], Any],
    ) -> Any:
        """The value of `kind` kept for these positions, else `build()`'s, kept."""
        with self._lock:
            for entry in self._entries:
                if (
                    entry.kind == kind
                    and _same(entry.queries, query_positions)
                    and _same(entry.keys, key_positions)
                ):
                    return entry.value
            value = build()
            if query_positions.is_cuda:
                entry = _Entry(
                    weakref.ref(query_positions), weakref.ref(key_positions), kind, value
                )
            else:
                entry = _Entry(query_positions.clone(), key_positions.clone(), kind, value)
            entry.finalizer = weakref.finalize(query_positions, self._drop, entry)
            self._entries.insert(0, entry)
            for old in self._entries[self.SIZE :]:
                assert old.finalizer is not None
                old.finalizer.detach()  # its value goes now, not with its positions
            del self._entries[self.SIZE :]
            return value

    def _drop(self, entry: _Entry) -> None:
        with self._lock:
            if entry in self._entries:
                self._entries.remove(entry)

    def __len__(self) -> int:
        return len(self._entries)


def _causal_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Additive [q, k] mask: 0 where the key's position is at most the query's, else -inf."""
    hidden = key_positions.unsqueeze(0) > query_positions.unsqueeze(1)
    mask = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
    return mask.masked_fill_(hidden, float("-inf"))


def _same(kept: PositionsKey, positions: torch.Tensor) -> bool:
    if isinstance(kept, weakref.ref):
        return kept() is positions
    return (
        kept.device == positions.device
        and kept.shape == positions.shape
        and bool(torch.equal(kept, positions))
    )


_kept = _RecentPlans()
