"""Tuned ratios projected on paper for hardware we cannot measure here (GPU servers).

Per-token costs follow from the model's shape and the hardware's rates: recomputing a token
through a layer costs its FLOPs at the accelerator's effective rate; loading it costs its K and V
bytes at the tier's bandwidth. The roofline prior (Eq. 11) and the model TTFT (Eq. 10) do the
rest. Rates are stated assumptions (see `docs/ratio-tuning.md`), not measurements.
"""

from __future__ import annotations

from typing import NamedTuple

from sglang_hicache_ext.tuning.ratio.roofline import TierCosts, predicted_ttft, roofline_prior


class ModelShape(NamedTuple):
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    def flops_per_token_layer(self, context: int) -> float:
        """Projections, gated MLP and attention over `context` earlier tokens (2 FLOPs per MAC)."""
        q_and_o = 2 * self.hidden * self.heads * self.head_dim
        k_and_v = 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        attention = 2 * context * self.heads * self.head_dim  # scores and weighted values
        return 2.0 * (q_and_o + k_and_v + mlp + attention)


class Tier(NamedTuple):
    name: str
    bytes_per_s: float  # effective read bandwidth into accelerator memory


LLAMA3_8B = ModelShape("Llama-3-8B", 32, 4096, 32, 8, 128, 14336)
H100_EFFECTIVE_FLOPS = 0.5 * 989e12  # bf16 dense peak at ~50 % utilisation in prefill
GPU_TIERS = (
    Tier("host DRAM over PCIe 5.0 x16", 50e9),
    Tier("local NVMe SSD (PCIe 4.0)", 7e9),
    Tier("network tier, 25 Gb/s", 25e9 / 8),
    Tier("HDD", 0.2e9),
)


class Projection(NamedTuple):
    tier: str
    costs: TierCosts
    prior: float  # r0 clipped to [r_min, 1]
    ttft_at_prior_s: float
    ttft_at_r_min_s: float
    full_prefill_s: float


def project(
    model: ModelShape,
    flops_per_s: float,
    tiers: tuple[Tier, ...],
    tokens: int,
    r_min: float,
    overhead_s: float = 0.0,
) -> list[Projection]:
    """One projection per tier for a prompt of `tokens` chunk tokens (mean context tokens/2)."""
    recompute_s = model.flops_per_token_layer(tokens // 2) / flops_per_s
    rows = []
    for tier in tiers:
        costs = TierCosts(
            recompute_s, model.kv_bytes_per_token_layer / tier.bytes_per_s, overhead_s
        )
        prior = roofline_prior(costs, r_min, 1.0)
        rows.append(
            Projection(
                tier.name,
                costs,
                prior,
                predicted_ttft(costs, prior, tokens, model.layers),
                predicted_ttft(costs, r_min, tokens, model.layers),
                predicted_ttft(costs, 1.0, tokens, model.layers),
            )
        )
    return rows
