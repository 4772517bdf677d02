"""What every SGLang family adapter shares: a pre-norm decoder of `model.model.layers`.

The family files override only what their family differs in (per-head q/k norms, the MoE
block, Gemma's sandwich norms and embedding scale, the LM head module). The executor learns each
layer's RoPE, sliding window and score softcap from `layers`, read from SGLang's own
`RadixAttention` modules, so the fused prefill attends as SGLang's backend does. Under
`--tp-size N` each rank's adapter drives its shard of the heads and adds the collectives
SGLang's stage boundaries would (`tensor_parallel.py`).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from sglang_hicache_ext.fusion.adapter import AttentionInputs, ModelAdapter, layers_from
from sglang_hicache_ext.fusion.chunk import ModelShape
from sglang_hicache_ext.fusion.rope import layer_rope_specs
from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.tensor_parallel import TensorParallel

logger = logging.getLogger(__name__)


class RadixAttentionLike(Protocol):
    """The attributes of SGLang's `RadixAttention` the adapters read."""

    sliding_window_size: int  # -1: none; else the distance q - k a key may be at most
    logit_cap: float


class SGLangDecoderAdapter(ModelAdapter):
    """SGLang's pre-norm decoder (Llama's layout) split at the attention op, on this rank's
    shard of the heads (`shape` counts this rank's heads).

    `applies_logit_cap`: whether the server's attention backend applies RadixAttention's
    `logit_cap` (SGLang's torch_native backend, the CPU's without AMX, ignores it): the fused
    prefill caps scores exactly when the normal prefill does."""

    def __init__(
        self,
        model: Any,
        hf_config: Any,
        *,
        applies_logit_cap: bool = True,
        tp: TensorParallel | None = None,
    ) -> None:
        self._model = model
        self.tp = tp or TensorParallel()
        self._layers = model.model.layers
        attn = self._layers[0].self_attn
        self.shape = ModelShape(
            num_layers=len(self._layers),
            num_q_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
        )
        ropes = layer_rope_specs(hf_config)
        if len(ropes) != len(self._layers):
            raise ValueError(f"{len(ropes)} RoPE specs for {len(self._layers)} layers")
        radix = [block.self_attn.attn for block in self._layers]
        caps = {float(getattr(r, "logit_cap", 0.0) or 0.0) for r in radix}
        if len(caps) != 1:
            raise ValueError(f"layers differ in their score softcap: {sorted(caps)}")
        cap = caps.pop()
        if cap and not applies_logit_cap:
            logger.warning(
                "fusion: the attention backend ignores this model's score softcap (%.1f), as "
                "SGLang's own prefill here does; fused prefills match it",
                cap,
            )
            cap = 0.0
        self.layers = layers_from(ropes, [_window(r) for r in radix], cap)
        self.rope_spec = ropes[0]
        self.attn_scale = float(attn.scaling)
        weight = model.model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.hidden_size = int(weight.shape[1])
        self.vocab_size = int(hf_config.vocab_size)
        self._final_cap = float(getattr(hf_config, "final_logit_softcapping", None) or 0.0)

    @property
    def lm_head(self) -> Any:
        """The module SGLang's forward hands its logits processor."""
        return self._model.lm_head

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._model.model.embed_tokens(token_ids)

    def attention_inputs(self, layer: int, hidden: torch.Tensor) -> AttentionInputs:
        block = self._layers[layer]
        attn = block.self_attn
        qkv, _ = attn.qkv_proj(block.input_layernorm(hidden))
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        n, dim = hidden.shape[0], self.shape.head_dim
        q, k, v = q.view(n, -1, dim), k.view(n, -1, dim), v.view(n, -1, dim)
        return AttentionInputs(*self.normed_qk(attn, q, k), v)

    def normed_qk(
        self, attn: Any, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head q/k norms before RoPE; none in Llama's layout."""
        return q, k

    def attention_output(
        self, layer: int, hidden: torch.Tensor, attn: torch.Tensor
    ) -> torch.Tensor:
        block = self._layers[layer]
        o_proj = block.self_attn.o_proj
        out, _ = o_proj(attn.reshape(attn.shape[0], -1))
        hidden = hidden + self.reduced(out, o_proj)
        return hidden + self.mlp(block, block.post_attention_layernorm(hidden))

    def reduced(self, out: torch.Tensor, module: Any) -> torch.Tensor:
        """`out` of `module` summed over the ranks unless the module summed it itself."""
        return out if self.tp.reduces(module) else self.tp.all_reduce(out)

    def mlp(self, block: Any, x: torch.Tensor) -> torch.Tensor:
        """The layer's feed-forward on normed rows, summed over the ranks: a dense MLP ends in
        its `down_proj`, SGLang's sparse blocks (Qwen3-MoE) in their `experts`."""
        mlp = block.mlp
        return self.reduced(mlp(x), mlp.experts if hasattr(mlp, "experts") else mlp.down_proj)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's final norm: what its forward hands the logits processor."""
        return self._model.model.norm(hidden)

    def combine_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """The ranks' scores summed (selectors may score on the host; the sum runs on the
        model's device, as SGLang's collectives do)."""
        return self.tp.all_reduce(scores.to(self.device))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # As SGLang's LogitsProcessor: the ranks' vocabulary shards side by side, the head's
        # rows padded past the vocabulary dropped, then the final softcap.
        head = self.lm_head
        logits = self.final_norm(hidden) @ head.weight.t()
        if getattr(head, "tp_size", 1) > 1:
            logits = self.tp.gather_columns(logits)
        logits = logits.float()[:, : self.vocab_size]
        if self._final_cap:
            logits = torch.tanh(logits / self._final_cap) * self._final_cap
        return logits


class PerHeadQKNorm:
    """For families that norm q and k per head after the projection, before RoPE (Qwen3,
    Qwen3-MoE, Gemma 3): `attn.q_norm` / `attn.k_norm` over [n, H, D] rows. A stored chunk's
    keys are then the normed, unrotated ones (the pool's keys rotated back): a reused key is
    normed once, as SGLang's forward norms it."""

    def normed_qk(
        self, attn: Any, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return attn.q_norm(q), attn.k_norm(k)


def _window(radix: RadixAttentionLike) -> int | None:
    # SGLang's size is the farthest distance a key may be (q - size <= k <= q): one less than
    # the window in transformers' terms, which the contract uses.
    size = int(getattr(radix, "sliding_window_size", -1) or -1)
    return None if size < 0 else size + 1
