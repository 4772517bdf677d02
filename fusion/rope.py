"""Rotary position embedding applied after the fact (deferred RoPE / position recovery).

Chunks are stored with keys captured *before* RoPE, so moving a chunk to any global position is
one rotation at the target positions. The math mirrors transformers' rotary modules exactly
(float32 angles, cos/sin scaled then cast to the tensor dtype) so a reused key is bit-for-bit
the key a forward at that position would have produced.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Literal

import torch

RopeLayout = Literal["neox", "gptj"]

# Types whose frequencies depend on the current sequence length: a key rotated for one request
# length is not the key another length would give, so position recovery is refused for them.
_LENGTH_DEPENDENT = frozenset({"dynamic", "longrope"})


@dataclass(frozen=True, eq=False)
class RopeSpec:
    """Everything needed to rotate a [n, H, D] tensor to given positions.

    `layout` "neox" rotates the two halves of the rotary dims (Llama, Qwen2, HF's rotate_half);
    "gptj" rotates interleaved pairs. Dims past `rotary_dim` pass through unrotated.
    """

    inv_freq: torch.Tensor
    attention_scaling: float = 1.0
    layout: RopeLayout = "neox"

    def __post_init__(self) -> None:
        if self.inv_freq.dim() != 1 or self.inv_freq.numel() == 0:
            raise ValueError("inv_freq must be a non-empty 1-D tensor")
        if self.layout not in ("neox", "gptj"):
            raise ValueError(f"unknown RoPE layout {self.layout!r}; expected 'neox' or 'gptj'")

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.numel()


def rope_spec_from_config(config: Any, layout: RopeLayout = "neox") -> RopeSpec:
    """Build a RopeSpec from a transformers config, using transformers' own init functions.

    A config whose layers rotate differently (Gemma 3: one base for sliding layers, another for
    full ones) has no single spec: ValueError; `layer_rope_specs` gives one per layer."""
    specs = set(layer_rope_specs(config, layout))
    if len(specs) != 1:
        raise ValueError(
            "the model's layers rotate with different RoPE specs; use layer_rope_specs"
        )
    return specs.pop()


def layer_rope_specs(config: Any, layout: RopeLayout = "neox") -> tuple[RopeSpec, ...]:
    """One RopeSpec per layer of a transformers config (layers of one kind share the object).

    transformers 5 nests `rope_parameters` by layer type when the kinds rotate differently
    (Gemma 3's sliding and full attention); each layer takes its type's parameters."""
    params = _rope_parameters(config)
    num_layers = int(config.num_hidden_layers)
    layer_types = list(getattr(config, "layer_types", None) or [])
    if layer_types and all(isinstance(params.get(kind), dict) for kind in set(layer_types)):
        by_kind = {
            kind: _spec(config, dict(params[kind]), layout, kind) for kind in set(layer_types)
        }
        return tuple(by_kind[kind] for kind in layer_types[:num_layers])
    return (_spec(config, params, layout, None),) * num_layers


def _spec(
    config: Any, params: dict[str, Any], layout: RopeLayout, layer_type: str | None
) -> RopeSpec:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type in _LENGTH_DEPENDENT:
        raise ValueError(f"RoPE type {rope_type!r} depends on sequence length; cannot recover")
    if rope_type == "default":
        inv_freq, scaling = _default_inv_freq(config, params), 1.0
    elif rope_type in ROPE_INIT_FUNCTIONS:
        init = ROPE_INIT_FUNCTIONS[rope_type]
        if layer_type is None:
            inv_freq, scaling = init(config, torch.device("cpu"))
        else:
            inv_freq, scaling = init(config, torch.device("cpu"), layer_type=layer_type)
    else:
        raise ValueError(f"unsupported RoPE type {rope_type!r}")
    return RopeSpec(inv_freq=inv_freq.float(), attention_scaling=float(scaling), layout=layout)


def rope_cos_sin(
    spec: RopeSpec, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [n, rotary_dim] for `positions`, computed as transformers does."""
    inv_freq = spec.inv_freq.to(device=positions.device, dtype=torch.float32)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    if spec.layout == "neox":
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.repeat_interleave(freqs, 2, dim=-1)
    cos = emb.cos() * spec.attention_scaling
    sin = emb.sin() * spec.attention_scaling
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Rotate `x` [..., n, H, D] (pre-RoPE queries or keys; leading dims such as layers share
    the positions) to `positions` [n]; returns a new tensor."""
    if x.dim() < 3 or x.shape[-3] != positions.shape[0]:
        raise ValueError(f"expected x [..., n, H, D] and positions [n], got {tuple(x.shape)}")
    rot = spec.rotary_dim
    if rot > x.shape[-1]:
        raise ValueError(f"rotary dim {rot} exceeds head dim {x.shape[-1]}")
    cos, sin = _tables.get(spec, positions, x.dtype)
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    rotated = x_rot * cos + _rotate(x_rot, spec.layout) * sin
    if x_pass.shape[-1] == 0:
        return rotated
    return torch.cat((rotated, x_pass), dim=-1)


class _RecentTables:
    """cos/sin tables of the last few positions tensors, found by identity.

    A fused prefill rotates the same positions tensor at every layer (its computed rows' q and
    k, the reused rows of a plan), so the tables are computed once per request instead of per
    layer and tensor. Identity, not values, tells a hit: comparing values would cost a device
    sync per call on a GPU (and inference tensors keep no version counter). So a positions tensor
    must not be changed in place once rotated by (none is: they are built per request or plan).
    An entry dies with its tensor.
    """

    _SIZE = 4

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[tuple[Any, ...]] = []

    def get(
        self, spec: RopeSpec, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (spec.inv_freq, spec.attention_scaling, spec.layout, dtype)
        with self._lock:
            self._entries = [e for e in self._entries if e[0]() is not None]
            for entry in self._entries:
                if entry[0]() is positions and entry[1][0] is key[0] and entry[1][1:] == key[1:]:
                    return entry[2]
        tables = rope_cos_sin(spec, positions, dtype)
        with self._lock:
            self._entries = [(weakref.ref(positions), key, tables), *self._entries][: self._SIZE]
        return tables


_tables = _RecentTables()


def _rotate(x: torch.Tensor, layout: RopeLayout) -> torch.Tensor:
    if layout == "neox":
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def _rope_parameters(config: Any) -> dict[str, Any]:
    # transformers 5 keeps everything in `rope_parameters`; older configs use rope_theta +
    # rope_scaling, which standardize_rope_params folds into rope_parameters.
    standardize = getattr(config, "standardize_rope_params", None)
    if callable(standardize):
        standardize()
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return scaling


def _default_inv_freq(config: Any, params: dict[str, Any]) -> torch.Tensor:
    base = float(params["rope_theta"])
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads
    )
    dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


# A model's rotations: one spec for every layer, or one per layer (`layer_rope_specs`).
LayerRopes = RopeSpec | tuple[RopeSpec, ...]


def unrotate_layers(x: torch.Tensor, positions: torch.Tensor, specs: LayerRopes) -> torch.Tensor:
    """`unrotate` of keys stacked by layer ([L, n, H, D]) whose layer l was rotated with
    `specs[l]` (or with `specs` itself, one spec): one rotation per distinct spec."""
    if isinstance(specs, RopeSpec):
        return unrotate(x, positions, specs)
    if x.shape[0] != len(specs):
        raise ValueError(f"{x.shape[0]} layers of keys but {len(specs)} RoPE specs")
    distinct = list(dict.fromkeys(specs))
    if len(distinct) == 1:
        return unrotate(x, positions, distinct[0])
    out = torch.empty_like(x)
    for spec in distinct:
        layers = [layer for layer, each in enumerate(specs) if each == spec]
        out[layers] = unrotate(x[layers], positions, spec)
    return out


def unrotate(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Inverse of `apply_rope`: recover pre-RoPE keys from keys rotated at `positions`.

    An engine's KV pool holds keys after RoPE; a chunk prefilled at 0..n-1 is stored pre-RoPE by
    rotating back. RoPE is a rotation scaled by `attention_scaling`, so the inverse is the
    rotation by the negative angle divided by the scale."""
    restored = apply_rope(x.float(), -positions, RopeSpec(spec.inv_freq, 1.0, spec.layout))
    if spec.attention_scaling != 1.0:
        rot = spec.rotary_dim
        restored[..., :rot] = restored[..., :rot] / spec.attention_scaling
    return restored.to(x.dtype)
