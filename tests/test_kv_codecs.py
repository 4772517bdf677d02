"""Chunk KV codecs: every codec x shape x token count, round trips against the error and size
bounds, dropped tokens chosen by each scorer's rule, and specs refused with the choices."""

from __future__ import annotations

import pytest
import torch

from sglang_hicache_ext.tiers.chunks.codecs.base import dense_nbytes
from sglang_hicache_ext.tiers.chunks.codecs.dropping import TokenDroppingCodec
from sglang_hicache_ext.tiers.chunks.codecs.parse import parse_codec
from sglang_hicache_ext.tiers.chunks.codecs.quantized import QuantizedCodec

# (kv_heads, head_dim) of SmolLM2-135M and Qwen2.5-0.5B
SHAPES = [(3, 64), (2, 64)]
TOKENS = [1, 63, 501]
# Bounds of the issue: max error as a fraction of the value range, stored bytes vs fp32.
QUANTIZED_BOUNDS = {"int8": (0.01, 0.27), "int4": (0.08, 0.15)}


def _kv(tokens: int, heads: int, dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K with outlier channels (a few channels large for every token, as real keys have) and V."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(tokens, heads, dim, generator=generator)
    keys[..., :4] *= 12.0
    values = torch.randn(tokens, heads, dim, generator=generator) * 0.5
    return keys, values


@pytest.mark.parametrize("spec", sorted(QUANTIZED_BOUNDS))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_quantized_round_trip_within_bounds(spec: str, shape: tuple[int, int], tokens: int) -> None:
    keys, values = _kv(tokens, *shape)
    codec = parse_codec(spec)
    layer = codec.encode(keys, values)
    decoded = codec.decode(layer)
    assert decoded.kept is None and decoded.keys.dtype == keys.dtype
    max_error, max_bytes = QUANTIZED_BOUNDS[spec]
    for original, restored in ((keys, decoded.keys), (values, decoded.values)):
        assert restored.shape == original.shape
        value_range = float(original.max() - original.min())
        assert float((restored - original).abs().max()) <= max_error * value_range
    if tokens >= 63:  # per-group scales dominate tiny chunks
        assert layer.nbytes <= max_bytes * dense_nbytes(keys, values), layer.nbytes


def test_quantization_errors_are_measured_against_the_range() -> None:
    keys, values = _kv(501, 3, 64)
    errors = {}
    for spec in QUANTIZED_BOUNDS:
        codec = parse_codec(spec)
        decoded = codec.decode(codec.encode(keys, values))
        errors[spec] = float((decoded.keys - keys).abs().max() / (keys.max() - keys.min()))
    assert errors["int8"] < errors["int4"] < 0.08  # coarser codes, larger error
    assert errors["int8"] < 0.005


def test_bfloat16_kv_decodes_to_bfloat16() -> None:
    keys, values = (t.bfloat16() for t in _kv(100, 2, 64))
    codec = QuantizedCodec(8)
    decoded = codec.decode(codec.encode(keys, values))
    assert decoded.keys.dtype == decoded.values.dtype == torch.bfloat16


@pytest.mark.parametrize("scorer", ["knorm", "keydiff", "snapkv"])
@pytest.mark.parametrize("ratio", [0.2, 0.5, 0.8])
@pytest.mark.parametrize("shape", SHAPES)
def test_dropping_keeps_exact_rows_of_the_kept_tokens(
    scorer: str, ratio: float, shape: tuple[int, int]
) -> None:
    keys, values = _kv(200, *shape)
    queries = torch.randn(4, shape[0] * 3, shape[1])  # GQA: 3 query heads per KV head
    codec = parse_codec(f"{scorer}:{ratio}")
    assert codec.spec == f"{scorer}:{ratio:g}"
    layer = codec.encode(keys, values, queries)
    decoded = codec.decode(layer)
    assert decoded.kept is not None
    kept = decoded.kept.tolist()
    assert len(kept) == 200 - int(ratio * 200) and kept == sorted(set(kept))
    assert torch.equal(decoded.keys, keys[decoded.kept])
    assert torch.equal(decoded.values, values[decoded.kept])
    assert layer.nbytes < (1 - ratio + 0.02) * dense_nbytes(keys, values)


def test_each_scorer_keeps_the_token_its_rule_favours() -> None:
    keys, values = _kv(100, 2, 64, seed=1)
    keys[..., 4:] *= 0.1  # the outlier channels carry every key's direction
    quiet, odd, attended = 10, 20, 30
    keys[quiet] *= 0.01  # smallest norm: knorm keeps it
    keys[odd] = -keys.mean(dim=0)  # opposite the mean direction: keydiff keeps it
    keys[attended, :, 10] = 50.0  # the one key along channel 10, where the probes look
    queries = torch.zeros(3, 4, 64)
    queries[..., 10] = 5.0
    kept = {
        name: set(
            TokenDroppingCodec(name, 0.9).encode(keys, values, queries).tensors["kept"].tolist()
        )
        for name in ("knorm", "keydiff", "snapkv")
    }
    assert quiet in kept["knorm"] and odd in kept["keydiff"] and attended in kept["snapkv"]


def test_snapkv_needs_probe_queries() -> None:
    keys, values = _kv(10, 2, 64)
    with pytest.raises(ValueError, match="need probe queries"):
        parse_codec("snapkv:0.5").encode(keys, values)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("int2", "unknown codec 'int2'; choose int8, int4, or <scorer>:<ratio in (0, 1)>"),
        ("pyramid:0.5", "unknown codec 'pyramid:0.5'"),
        ("knorm", "unknown codec 'knorm'"),
        ("knorm:0", "the drop ratio must be in (0, 1), got 0"),
        ("knorm:1", "the drop ratio must be in (0, 1), got 1"),
        ("snapkv:-0.2", "must be in (0, 1), got -0.2"),
        ("keydiff:half", "the drop ratio must be a number in (0, 1)"),
        ("keydiff:nan", "must be in (0, 1), got nan"),
    ],
)
def test_bad_specs_are_refused_with_the_choices(spec: str, message: str) -> None:
    with pytest.raises(ValueError) as refused:
        parse_codec(spec)
    assert message in str(refused.value)
