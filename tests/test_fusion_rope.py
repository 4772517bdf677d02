"""RoPE recovery: our tables and rotation against transformers' own rotary modules."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from sglang_hicache_ext.fusion.rope import RopeSpec, apply_rope, rope_cos_sin, rope_spec_from_config

ROPE_PARAMETERS = {
    "default": {"rope_type": "default", "rope_theta": 100000.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 256,
    },
}


def _config(rope_parameters: dict) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        rope_parameters=dict(rope_parameters),
    )


@pytest.mark.parametrize("kind", sorted(ROPE_PARAMETERS))
def test_tables_match_transformers(kind: str) -> None:
    config = _config(ROPE_PARAMETERS[kind])
    spec = rope_spec_from_config(config)
    hf = LlamaRotaryEmbedding(config)
    torch.testing.assert_close(spec.inv_freq, hf.inv_freq, rtol=0, atol=0)
    positions = torch.tensor([0, 1, 7, 255, 256, 900])
    hf_cos, hf_sin = hf(torch.zeros(1, dtype=torch.float32), positions[None])
    cos, sin = rope_cos_sin(spec, positions, torch.float32)
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=0)


def test_neox_rotation_matches_transformers() -> None:
    config = _config(ROPE_PARAMETERS["llama3"])
    spec = rope_spec_from_config(config)
    torch.manual_seed(0)
    x = torch.randn(6, 2, 32)
    positions = torch.tensor([3, 40, 41, 300, 512, 1000])
    cos, sin = LlamaRotaryEmbedding(config)(x, positions[None])
    # HF layout is [batch, heads, seq, dim]; ours is [seq, heads, dim].
    hf_q, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(
        apply_rope(x, positions, spec), hf_q[0].transpose(0, 1), rtol=0, atol=0
    )


def test_gptj_rotation_is_complex_multiplication_of_pairs() -> None:
    spec = RopeSpec(
        inv_freq=1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16)), layout="gptj"
    )
    torch.manual_seed(1)
    x = torch.randn(5, 3, 16, dtype=torch.float64)
    positions = torch.tensor([0, 2, 9, 100, 777])
    # Angles in float32 as transformers computes them; the rotation itself is checked in float64.
    angles = (positions.float()[:, None] * spec.inv_freq[None, :]).double()
    expected = torch.view_as_real(
        torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous())
        * torch.polar(torch.ones_like(angles), angles)[:, None, :]
    ).flatten(-2)
    torch.testing.assert_close(apply_rope(x, positions, spec), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["neox", "gptj"])
def test_rotations_compose_and_keep_norm(layout: str) -> None:
    spec = RopeSpec(
        inv_freq=1.0 / (10000.0 ** (torch.arange(0, 32, 2).float() / 32)), layout=layout
    )
    torch.manual_seed(2)
    x = torch.randn(8, 2, 32, dtype=torch.float64)
    start = torch.arange(8)
    moved = apply_rope(apply_rope(x, start, spec), torch.full((8,), 700), spec)
    # float32 angles (as in transformers) bound the agreement at ~position x 1e-7.
    torch.testing.assert_close(moved, apply_rope(x, start + 700, spec), rtol=0, atol=2e-4)
    torch.testing.assert_close(moved.norm(dim=-1), x.norm(dim=-1))


def test_partial_rotary_leaves_tail_dims() -> None:
    spec = RopeSpec(inv_freq=torch.tensor([1.0, 0.1]))
    x = torch.randn(3, 1, 8)
    out = apply_rope(x, torch.tensor([1, 2, 3]), spec)
    torch.testing.assert_close(out[..., 4:], x[..., 4:], rtol=0, atol=0)
    assert not torch.allclose(out[..., :4], x[..., :4])


def test_bad_rope_inputs_raise() -> None:
    with pytest.raises(ValueError, match="sequence length"):
        rope_spec_from_config(_config({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}))
    with pytest.raises(ValueError, match="layout"):
        RopeSpec(inv_freq=torch.ones(4), layout="interleaved")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positions"):
        apply_rope(torch.randn(3, 1, 8), torch.arange(4), RopeSpec(inv_freq=torch.ones(4)))
    with pytest.raises(ValueError, match="exceeds head dim"):
        apply_rope(torch.randn(3, 1, 4), torch.arange(3), RopeSpec(inv_freq=torch.ones(4)))


class _Pool:
    """The part of SGLang's KV pool a capture reads: per-layer buffers of rotated keys."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.start_layer, self.layer_num = 0, len(keys)
        self.keys, self.values = keys, values

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.keys[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.values[layer]


@pytest.mark.parametrize("layout", ["neox", "gptj"])
def test_pre_rope_rows_undo_the_rotation_of_every_layer_at_once(layout: str) -> None:
    from sglang_hicache_ext.sglang_ext.chunk_fusion.pool_rows import pre_rope_rows

    torch.manual_seed(0)
    spec = RopeSpec(inv_freq=1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)), layout=layout)
    raw = [torch.randn(40, 2, 16) for _ in range(3)]
    positions = torch.arange(40) + 7
    pool = _Pool([apply_rope(k, positions, spec) for k in raw], [torch.randn(40, 2, 16)] * 3)
    slots = torch.tensor([3, 9, 10, 11, 30])
    keys, values = pre_rope_rows(pool, slots, positions[slots], spec)
    assert keys.shape == values.shape == (3, 5, 2, 16)
    assert keys.is_contiguous() and values.is_contiguous()
    for layer in range(3):
        torch.testing.assert_close(keys[layer], raw[layer][slots], atol=1e-5, rtol=1e-5)
        assert torch.equal(values[layer], pool.values[layer][slots])
