"""CacheTune frequency-domain token scores (offline recompute candidates, §4.1).

A low-pass reconstruction of K and V along the sequence keeps the slowly varying structure of a
chunk; tokens carrying much of that low-frequency energy are the ones worth recomputing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

DEFAULT_ALPHA = 0.5
# Up to this many tokens `layer_frequency_scores` low-passes by a matrix product (n^2 entries).
_PROJECTION_MAX_TOKENS = 1024


def low_pass(x: torch.Tensor, alpha: float = DEFAULT_ALPHA, dim: int = 0) -> torch.Tensor:
    """Keep the lowest `alpha` fraction of rFFT frequencies of `x` along `dim`; same shape back."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    n = x.shape[dim]
    spectrum = torch.fft.rfft(x.float(), dim=dim)
    cutoff = int(alpha * (n // 2 + 1))
    spectrum.narrow(dim, cutoff, spectrum.shape[dim] - cutoff).zero_()
    return torch.fft.irfft(spectrum, n=n, dim=dim)


def frequency_scores(
    keys: torch.Tensor, values: torch.Tensor, alpha: float = DEFAULT_ALPHA
) -> torch.Tensor:
    """Per-token score [N] of one layer: mean of the L2 norms of low-passed K and V ([N, H, D])."""
    if keys.shape[0] != values.shape[0] or keys.shape[0] == 0:
        raise ValueError("keys and values must have the same, non-zero number of tokens")
    k_norm = low_pass(keys, alpha).flatten(1).norm(dim=-1)
    v_norm = low_pass(values, alpha).flatten(1).norm(dim=-1)
    return 0.5 * (k_norm + v_norm)


def layer_frequency_scores(
    keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], alpha: float = DEFAULT_ALPHA
) -> torch.Tensor:
    """`frequency_scores` of every layer ([L, N]) in one low-pass over the stacked layers: a
    chunk kept from traffic is scored on the scheduler thread, where one call per layer adds up."""
    if len(keys) != len(values) or not keys:
        raise ValueError("keys and values must have the same, non-zero number of layers")
    return stacked_frequency_scores(torch.stack(list(keys)), torch.stack(list(values)), alpha)


def stacked_frequency_scores(
    k: torch.Tensor, v: torch.Tensor, alpha: float = DEFAULT_ALPHA
) -> torch.Tensor:
    """`layer_frequency_scores` of rows already stacked layer-major, [L, N, H, D] (the form a
    capture reads SGLang's pool in)."""
    k, v = k.float(), v.float()
    if k.shape[1] == 0 or k.shape[:2] != v.shape[:2]:
        raise ValueError("keys and values must have the same, non-zero number of tokens")
    layers, n = k.shape[:2]
    if n <= _PROJECTION_MAX_TOKENS:
        # The low-pass is linear along the tokens: one n x n matrix (the low-passed identity)
        # times every column costs far less than an FFT per column for short chunks.
        projection = low_pass(torch.eye(n), alpha)
        k_low = projection @ k.reshape(layers, n, -1)
        v_low = projection @ v.reshape(layers, n, -1)
    else:
        k_low, v_low = low_pass(k, alpha, dim=1), low_pass(v, alpha, dim=1)
    scores = 0.5 * (k_low.flatten(2).norm(dim=-1) + v_low.flatten(2).norm(dim=-1))  # [L, N]
    # Row-major strides, which stored files read (a one-token chunk's size-1 dimension would
    # otherwise count as contiguous with any stride).
    return scores.new_empty(scores.shape).copy_(scores)
