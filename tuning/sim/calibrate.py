"""Fit the `Profile` time coefficients to measured prefills and decode steps.

Both models are linear in their coefficients, so a non-negative least-squares fit
(`scipy.optimize.nnls`) recovers them; non-negativity keeps an extrapolated time from going
below zero for lengths outside the measured range.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from scipy.optimize import nnls

from sglang_hicache_ext.tuning.sim.profile import Profile


class PrefillSample(NamedTuple):
    new_tokens: int
    cached_tokens: int
    seconds: float  # one request prefilled alone


class DecodeSample(NamedTuple):
    batch: int
    context_tokens: int  # total over the batch
    seconds: float  # one decode step


def fit_profile(
    prefill: Sequence[PrefillSample], decode: Sequence[DecodeSample], base: Profile | None = None
) -> Profile:
    """`base` (default `Profile()`) with its six time coefficients fitted to the samples."""
    if len(prefill) < 3 or len(decode) < 3:
        raise ValueError("need at least 3 prefill and 3 decode samples to fit 3 coefficients each")
    p = np.asarray(prefill, dtype=float)
    new, cached = p[:, 0], p[:, 1]
    prefill_design = np.column_stack((np.ones_like(new), new, new * (cached + new / 2)))
    prefill_coef = _nnls(prefill_design, p[:, 2])
    d = np.asarray(decode, dtype=float)
    decode_design = np.column_stack((np.ones(len(d)), d[:, 0], d[:, 1]))
    decode_coef = _nnls(decode_design, d[:, 2])
    return dataclasses.replace(
        base or Profile(),
        prefill_base_s=prefill_coef[0],
        prefill_per_token_s=prefill_coef[1],
        prefill_attn_per_token_ctx_s=prefill_coef[2],
        decode_base_s=decode_coef[0],
        decode_per_seq_s=decode_coef[1],
        decode_per_ctx_token_s=decode_coef[2],
    )


def _nnls(design: np.ndarray, target: np.ndarray) -> list[float]:
    # Columns differ by orders of magnitude (1 vs tokens vs token pairs): scale them so the
    # solver's tolerance treats each coefficient alike.
    scale = np.abs(design).max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(design / scale, target)
    return [float(c) for c in coef / scale]
