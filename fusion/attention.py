"""Attention of a set of queries over pooled K/V with a position-based causal mask.

A query at global position p sees every key whose position is <= p. This is the one rule the
extend path, the decode path and the fused (non-prefix) prefill all need: it does not assume
the queries are the last tokens of the sequence, nor that they are contiguous, so cached prefix
tokens are never recomputed as redundant queries.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang_hicache_ext.fusion.scattered_attention import (
    AttentionPart,
    ascending,
    block_bounds,
    cpu_flash_with_lse,
    fold_query_heads,
    query_block_attention,
    split_block_attention,
    unfold_query_heads,
)


def position_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scale: float | None = None,
    backend: str = "torch",
    *,
    causal: bool | None = None,
    host_positions: torch.Tensor | None = None,
    window: int | None = None,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """Attend `query` [q, Hq, D] over `key`/`value` [k, Hkv, D] by position.

    Grouped-query attention is handled when Hq is a multiple of Hkv. Returns [q, Hq, Dv].
    backend: "torch" (SDPA); "flashinfer" (error if unusable); "auto" (on CUDA fp16/bf16 with
    FlashInfer installed, FlashInfer for causal queries and SDPA for scattered ones: on an H200
    FlashInfer's custom-mask kernel took about twice SDPA's masked one; else torch).
    What the caller knows of the layout (the executor tells: on a GPU finding it out reads
    positions back, and each read-back waits for the queue to drain):
    causal: True, the keys are positions 0..k-1 and the queries their last q in order (a
    prefill or an extend); False, keys 0..k-1 and queries at other ascending positions (a
    fused prefill's selection); None, found from the positions. host_positions: with causal
    False, the queries' positions in host memory, from which a GPU blocks the queries.
    window: a query at p sees only keys at p - window < k <= p (a sliding-window layer);
    logit_cap: scores capped as cap * tanh(score / cap) before the softmax. Either takes the
    explicit-mask path (torch), which a window no pair reaches skips.
    """
    if logit_cap or _window_cuts(window, query_positions, key_positions):
        return _masked_attention(
            query, key, value, query_positions, key_positions, scale, window, logit_cap
        )
    if _flashinfer_chosen(backend, query) and (backend == "flashinfer" or causal is not False):
        return _flashinfer_attention(
            query, key, value, query_positions, key_positions, scale, causal, host_positions
        )
    if query.shape[0] == 0:
        return query.new_empty((0, query.shape[1], value.shape[-1]))
    if query.is_cuda and query.shape[1] != key.shape[1] and query.shape[0] < key.shape[0]:
        # SDPA's masked CUDA kernel (memory-efficient) lacks GQA; left grouped, SDPA falls
        # back to the math kernel, which materialises [H, q, k] scores at long contexts.
        group = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)
    q, k, v = _heads_first(query, key, value)
    gqa = q.shape[1] != k.shape[1]
    prefix_len = key.shape[0] - query.shape[0]
    # Only a GPU takes the caller's word: there each check reads positions back; on the CPU
    # the checks are cheap and choose among its kernels.
    told = causal is not None and query.is_cuda
    if told:
        keys_from_zero = new_tokens_last = bool(causal)
    else:
        keys_from_zero = _is_arange(key_positions)
        new_tokens_last = keys_from_zero and _is_arange(query_positions, start=prefix_len)
    if new_tokens_last and prefix_len == 0:
        # Plain causal self-attention: let SDPA pick its fused causal kernel.
        out = scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    elif not told and bool(query_positions.min() >= key_positions.max()):
        # Every query sees every key (decode, or a last-token extend): no mask to build.
        return _attend_all(query, key, value, scale)
    elif new_tokens_last and _cpu_flash_fits(q, v):
        out = _prefix_extend_attention(q, k, v, prefix_len, scale)
    elif keys_from_zero and q.device.type == "cpu" and ascending(query_positions):
        if _cpu_flash_fits(q, v) and int(query_positions[-1]) < k.shape[2]:
            out = split_block_attention(q, k, v, query_positions, key_positions, scale)
        else:
            out = query_block_attention(q, k, v, query_positions, key_positions, scale, gqa)
    elif told and host_positions is not None:
        out = query_block_attention(
            q, k, v, query_positions, key_positions, scale, gqa, host_positions
        )
    else:
        mask = key_positions.unsqueeze(0) <= query_positions.unsqueeze(1)
        out = scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1)


def _window_cuts(
    window: int | None, query_positions: torch.Tensor, key_positions: torch.Tensor
) -> bool:
    """True when some query is farther than `window` from some key it would otherwise see."""
    if window is None or query_positions.numel() == 0 or key_positions.numel() == 0:
        return False
    return bool(query_positions.max() - key_positions.min() >= window)


def visible_keys(
    query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """[q, k] mask of the keys each query attends: causal, and inside `window` when set."""
    distance = query_positions.unsqueeze(1) - key_positions.unsqueeze(0)
    visible = distance >= 0
    if window is not None:
        visible &= distance < window
    return visible


# Query rows per block of the explicit-mask path: bounds its [H, q, k] scores.
_MASKED_BLOCK = 1024


def _masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scale: float | None,
    window: int | None,
    logit_cap: float,
) -> torch.Tensor:
    """Attention with an explicit [q, k] mask (causal, windowed) and optional score softcap,
    as transformers' eager Gemma computes it: scores capped, masked, softmax in float32."""
    if query.shape[0] == 0:
        return query.new_empty((0, query.shape[1], value.shape[-1]))
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    q_all, k, v = _heads_first(query, key, value)  # [1, H, n, D]
    group = q_all.shape[1] // k.shape[1]
    if logit_cap:  # the capped scores are computed by hand: keys per query head, once
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    outs = []
    for start in range(0, query.shape[0], _MASKED_BLOCK):
        rows = slice(start, start + _MASKED_BLOCK)
        mask = visible_keys(query_positions[rows], key_positions, window)
        q = q_all[:, :, rows]
        if not logit_cap:
            out = scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=group != 1
            )
        else:
            scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scale / logit_cap)
            scores = (scores * logit_cap).masked_fill(~mask, float("-inf"))
            weights = scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype)
            out = torch.matmul(weights, v)
        outs.append(out.squeeze(0).transpose(0, 1))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def tempered_context_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    is_context: torch.Tensor,
    scale: float,
    temperature: float,
    context_scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """APE's attention of question queries [q, Hq, D] over keys at positions 0..N-1, of which
    `is_context` [N] marks the separately encoded contexts (chunks).

    The context keys' logits are divided by `temperature` (T) and their group's log-sum-exp is
    multiplied by T x `context_scale` (S) before it competes with the other keys: with C the
    contexts' log-sum-exp of logits / T, context key j gets weight exp(l_j / T + (S T - 1) C) / Z
    and any other key exp(l_j) / Z. T < 1 sharpens the question's attention inside the contexts;
    S < 1 lowers the contexts' share against the prefix and the question itself. Materialises
    [Hq, q, N] logits: meant for the few question tokens. Returns [q, Hq, Dv].
    """
    group = query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(group, dim=1)
    v = value.float().repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    key_positions = torch.arange(key.shape[0], device=key.device)
    visible = visible_keys(query_positions.to(key.device), key_positions, window)  # [q, N]
    context = (visible & is_context.to(key.device)[None, :])[None]
    tempered = (logits / temperature).masked_fill(~context, float("-inf"))
    lse = torch.logsumexp(tempered, dim=-1, keepdim=True)
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # no context seen yet
    adjusted = torch.where(context, tempered + (context_scale * temperature - 1) * lse, logits)
    weights = adjusted.masked_fill(~visible[None], float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, v).to(query.dtype)


def gather_attend(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Attend queries over the K/V held at `slot_ids` of a token pool.

    `slot_ids[i]` is the pool slot of the token at position i of the sequence, so key positions
    are 0..len(slot_ids)-1.
    """
    # index_select: about 4x faster than indexing with a tensor on CPU (same rows).
    slots = slot_ids.long()
    keys = key_cache.index_select(0, slots)
    values = value_cache.index_select(0, slots)
    if query.shape[0] == 1 and not query.is_cuda and int(query_positions[0]) >= slots.shape[0] - 1:
        # A decode step: the one query sees every key. Skipping the general path's position
        # checks halves a decode layer's attention on CPU at ~1K keys.
        return _attend_all(query, keys, values, scale)
    key_positions = torch.arange(slots.shape[0], device=query_positions.device)
    return position_causal_attention(query, keys, values, query_positions, key_positions, scale)


def _heads_first(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[n, H, D] tensors as SDPA's [1, H, n, D], keys and values in the query's dtype."""
    q = query.transpose(0, 1).unsqueeze(0)
    k = key.transpose(0, 1).unsqueeze(0)
    v = value.transpose(0, 1).unsqueeze(0)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    return q, k, v


def _attend_all(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """Every query over every key (no mask); [q, Hq, D] in, [q, Hq, Dv] out."""
    q, k, v = _heads_first(query, key, value)
    out = scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.squeeze(0).transpose(0, 1)


def _is_arange(positions: torch.Tensor, start: int = 0) -> bool:
    n = positions.shape[0]
    if positions.is_cuda:
        # One read-back instead of three: each stalls the GPU's queue.
        expected = torch.arange(start, start + n, device=positions.device)
        return n > 0 and bool(torch.equal(positions, expected.to(positions.dtype)))
    return (
        n > 0
        and bool(positions[0] == start)
        and bool(positions[n - 1] == start + n - 1)
        and (n < 2 or bool(torch.all(positions[1:] - positions[:-1] == 1)))
    )


def _cpu_flash_fits(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether torch's CPU flash kernel with log-sum-exp can take these: it exists, the tensors
    are on the CPU, and values have the queries' head size (the kernel refuses others)."""
    return cpu_flash_with_lse is not None and q.device.type == "cpu" and v.shape[-1] == q.shape[-1]


# A cached prefix up to this share of the new tokens is attended as placeholder queries of one
# causal call rather than apart: on CPU the padded call was the faster below a third in every
# run and about even at 0.4, and lost from about 1 up (docs/cpu-attention.md, "A short cached
# prefix").
PADDED_PREFIX_SHARE = 1 / 3


def _prefix_extend_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float | None
) -> torch.Tensor:
    """New tokens at positions prefix_len.. over keys 0..: the prefix part needs no mask and the
    new part is square-causal, so both run on the fast kernels (a masked kernel cannot skip
    blocks), and the halves are merged by their log-sum-exps. Shapes are [1, H, L, D]. With
    GQA the prefix part folds the query heads into rows (its keys, usually the most, are not
    copied per query head); the causal part, whose rows must stay positions, repeats its keys.

    A prefix of at most `PADDED_PREFIX_SHARE` of the new tokens (a cached system prompt) costs
    the split more than it saves: the new tokens go to one square-causal call over every key,
    behind placeholder queries at the prefix's positions whose rows are dropped."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if prefix_len <= PADDED_PREFIX_SHARE * q.shape[2]:
        placeholders = q.new_zeros(1, heads, prefix_len, q.shape[3])
        padded = torch.cat([placeholders, q], dim=2)
        out = scaled_dot_product_attention(
            padded, k, v, is_causal=True, scale=scale, enable_gqa=kv_heads != heads
        )
        return out[:, :, prefix_len:]
    new_k, new_v = k[:, :, prefix_len:], v[:, :, prefix_len:]
    if kv_heads != heads:
        out_prefix, lse_prefix = cpu_flash_with_lse(
            fold_query_heads(q, kv_heads), k[:, :, :prefix_len], v[:, :, :prefix_len], scale=scale
        )
        out_prefix = unfold_query_heads(out_prefix, heads)
        lse_prefix = unfold_query_heads(lse_prefix, heads)
        group = heads // kv_heads
        new_k, new_v = new_k.repeat_interleave(group, dim=1), new_v.repeat_interleave(group, dim=1)
    else:
        out_prefix, lse_prefix = cpu_flash_with_lse(
            q, k[:, :, :prefix_len], v[:, :, :prefix_len], scale=scale
        )
    new = AttentionPart(*cpu_flash_with_lse(q, new_k, new_v, is_causal=True, scale=scale))
    return new.merged(AttentionPart(out_prefix, lse_prefix)).out.to(q.dtype)


@functools.cache
def flashinfer_available() -> bool:
    """True when the optional FlashInfer package imports (never required); asked once, since
    attention calls it per layer and a failed import searches sys.path every time."""
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return True


# The executor's name for it.
attend = position_causal_attention


def _flashinfer_chosen(backend: str, query: torch.Tensor) -> bool:
    if backend not in ("torch", "flashinfer", "auto"):
        raise ValueError(f"unknown attention backend {backend!r}")
    if backend == "torch":
        return False
    usable = (
        query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and query.shape[0] > 0
        and flashinfer_available()
    )
    if backend == "flashinfer" and not usable:
        raise ValueError("flashinfer backend needs CUDA fp16/bf16 tensors and flashinfer installed")
    return usable


def _flashinfer_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scale: float | None,
    causal: bool | None,
    host_positions: torch.Tensor | None,
) -> torch.Tensor:
    import flashinfer

    # FlashInfer reads [n, H, D] rows by stride; the executor's splits and gathers can hand it
    # views whose heads are not packed.
    query = query.contiguous()
    key, value = key.to(query.dtype).contiguous(), value.to(query.dtype).contiguous()
    if causal is None:
        prefix_len = key.shape[0] - query.shape[0]
        causal = _is_arange(key_positions) and _is_arange(query_positions, start=prefix_len)
    if causal:
        # FlashInfer's causal mask aligns the queries with the last keys: an extend too.
        return flashinfer.single_prefill_with_kv_cache(
            query, key, value, causal=True, sm_scale=scale
        )
    if causal is False and host_positions is not None:
        # Keys 0..k-1 and ascending queries: block by block over the keys each block sees.
        outs = []
        for start, end, visible in block_bounds(host_positions, gpu=True, num_keys=key.shape[0]):
            mask = key_positions[:visible].unsqueeze(0) <= query_positions[start:end, None]
            outs.append(
                flashinfer.single_prefill_with_kv_cache(
                    query[start:end],
                    key[:visible],
                    value[:visible],
                    custom_mask=mask,
                    causal=False,
                    sm_scale=scale,
                )
            )
        return torch.cat(outs)
    mask = key_positions.unsqueeze(0) <= query_positions.unsqueeze(1)
    return flashinfer.single_prefill_with_kv_cache(
        query, key, value, custom_mask=mask, causal=False, sm_scale=scale
    )
