"""Integer quantisation of chunk KV, KIVI-style: keys per channel, values per token.

Keys have outlier channels (a few channels large for every token), so each key channel is
quantised over groups of `group` tokens; values have no channel structure but vary per token,
so each token's values are quantised over groups of `group` channels (KIVI, Liu et al. 2024).
Asymmetric (min and step per group, fp16), round to nearest. 4-bit codes are packed two per byte.
Stored bytes against fp32 K/V, measured on SmolLM2 chunk KV (benchmarks/codec_errors.py): int8
0.267x, int4 0.142x.
"""

from __future__ import annotations

import torch

from sglang_hicache_ext.tiers.chunks.codecs.base import CompressedLayer, DecodedLayer, KVCodec

DEFAULT_GROUP = 64


class QuantizedCodec(KVCodec):
    def __init__(self, bits: int, group: int = DEFAULT_GROUP) -> None:
        if bits not in (4, 8):
            raise ValueError(f"quantisation to {bits} bits: choose 4 or 8")
        if group < 1:
            raise ValueError(f"quantisation group must be positive, got {group}")
        self.bits = bits
        self.group = group

    @property
    def spec(self) -> str:
        return f"int{self.bits}"

    def encode(
        self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None = None
    ) -> CompressedLayer:
        n = keys.shape[0]
        # Keys: groups run along tokens (dim 0) for each channel; values: along channels.
        key_codes, key_min, key_step = _quantize(keys.float().movedim(0, -1), self.bits, self.group)
        value_codes, value_min, value_step = _quantize(values.float(), self.bits, self.group)
        return CompressedLayer(
            self.spec,
            n,
            keys.dtype,
            {
                "key_codes": key_codes,
                "key_min": key_min,
                "key_step": key_step,
                "value_codes": value_codes,
                "value_min": value_min,
                "value_step": value_step,
                "key_shape": torch.tensor(keys.shape, dtype=torch.int32),
                "value_shape": torch.tensor(values.shape, dtype=torch.int32),
            },
        )

    def decode(self, layer: CompressedLayer) -> DecodedLayer:
        t = layer.tensors
        n, heads, key_dim = (int(x) for x in t["key_shape"])
        value_shape = tuple(int(x) for x in t["value_shape"])
        keys = _dequantize(
            t["key_codes"], t["key_min"], t["key_step"], self.bits, self.group, (heads, key_dim, n)
        ).movedim(-1, 0)
        values = _dequantize(
            t["value_codes"], t["value_min"], t["value_step"], self.bits, self.group, value_shape
        )
        return DecodedLayer(keys.to(layer.dtype), values.to(layer.dtype), None)


def _quantize(
    x: torch.Tensor, bits: int, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (uint8, packed for 4 bits), per-group min and step (fp16) of `x`, grouped along its
    last dimension. A last partial group is quantised padded with its last value, but only the
    codes of real entries are kept (short chunks would otherwise store up to a group of padding
    per channel)."""
    length = x.shape[-1]
    groups = _grouped(x, group)
    low = groups.amin(dim=-1, keepdim=True).half()
    high = groups.amax(dim=-1, keepdim=True)
    levels = 2**bits - 1
    # The step from the fp16 minimum, so that decoding with the stored minimum is exact to it.
    step = ((high - low.float()) / levels).clamp_min(1e-8).half()
    codes = ((groups - low.float()) / step.float()).round().clamp(0, levels).to(torch.uint8)
    codes = codes.reshape(*x.shape[:-1], -1)[..., :length]
    if bits == 4:
        flat = codes.flatten()
        if flat.numel() % 2:
            flat = torch.cat([flat, flat.new_zeros(1)])
        codes = flat[0::2] | (flat[1::2] << 4)
    return codes, low, step


def _dequantize(
    codes: torch.Tensor,
    low: torch.Tensor,
    step: torch.Tensor,
    bits: int,
    group: int,
    shape: tuple[int, ...],
) -> torch.Tensor:
    length = shape[-1]
    if bits == 4:
        unpacked = torch.stack([codes & 0x0F, codes >> 4], dim=-1).flatten()
        codes = unpacked[: low.numel() // low.shape[-2] * length].reshape(*shape[:-1], length)
    padded = torch.nn.functional.pad(codes, (0, low.shape[-2] * group - length))
    groups = padded.reshape(*low.shape[:-1], group).float() * step.float() + low.float()
    return groups.reshape(*shape[:-1], -1)[..., :length]


def _grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., length] as [..., groups, group], the last group padded with the last value."""
    length = x.shape[-1]
    pad = (-length) % group
    if pad:
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1)
    return x.reshape(*x.shape[:-1], -1, group)
