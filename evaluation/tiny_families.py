"""Tiny random-weight configs of every model family fusion serves, each with the features that
tell its family apart (per-head q/k norms, head_dim != hidden / heads, GQA, tied embeddings,
sliding windows shorter than a test prompt with their own RoPE base, MoE top-k, llama3 RoPE
scaling, softcaps). Built offline with transformers; the exactness tests run the fusion core on
them in process, and `scripts/prepare_models.py` saves the ones SGLang's CPU engine serves.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

# A window this short is crossed by every multi-chunk test prompt.
TEST_WINDOW = 24

# What every tiny random config shares: these families' and the tiny Llama and Qwen2 of
# `scripts/prepare_models.py` (`tiny_config`).
TINY_CONFIG: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=0,
    torch_dtype="float32",
)
_COMMON: dict[str, Any] = dict(TINY_CONFIG, pad_token_id=0)

# family -> (the SGLang architecture it is served as, what sets it apart)
FAMILIES: dict[str, tuple[str, str]] = {
    "llama3": ("LlamaForCausalLM", "llama3 RoPE scaling, tied embeddings"),
    "mistral": ("MistralForCausalLM", "a LlamaForCausalLM subclass"),
    "phi3": ("Phi3ForCausalLM", "fused qkv_proj / gate_up_proj checkpoint"),
    "qwen3": ("Qwen3ForCausalLM", "per-head q/k RMSNorm before RoPE, head_dim != hidden / heads"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "sparse MoE (4 experts, top-2) and Qwen3 attention"),
    "mixtral": ("MixtralForCausalLM", "sparse MoE (4 experts, top-2) in block_sparse_moe"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "sparse MoE with a gated shared expert"),
    "gemma2": ("Gemma2ForCausalLM", "sandwich norms, embedding scale, softcaps, sliding window"),
    "gemma3": ("Gemma3ForCausalLM", "q/k norms, 5:1 sliding layers with their own RoPE base"),
}

# Families SGLang's CPU engine (0.5.23, no AMX) cannot serve, with the error it stops on: their
# adapters are proven against transformers' forward in process only.
NOT_SERVED_ON_CPU: dict[str, str] = {
    "qwen2_moe": "SGLang's Qwen2-MoE block gates its shared expert in a Triton kernel "
    "(fused_gate_sigmoid_mul_add) with no CPU driver: 'RuntimeError: 0 active drivers ([]). "
    "There should only be one.' at the server's warm-up",
}

# The words of the filler documents the tiny models are served (any text fits random weights).
FILLER_WORDS: tuple[str, ...] = (
    "alpha",
    "beta",
    "gamma",
    "delta",
    "river",
    "stone",
    "cloud",
    "paper",
    "window",
    "garden",
    "silver",
    "orange",
    "quiet",
)


def filler_documents(seed: int = 0, words: Sequence[str] = FILLER_WORDS) -> list[str]:
    """Three documents of 30, 26 and 22 words drawn from `words` (seeded: the same each run),
    each ending in a full stop: what the tiny-family checks register and fuse."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(n)) + "." for n in (30, 26, 22)]


def family_config(family: str, vocab_size: int = 1024) -> Any:
    """The tiny config of `family` (one of FAMILIES)."""
    import transformers as tf

    common = dict(_COMMON, vocab_size=vocab_size)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    if family == "llama3":
        scaling = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return tf.LlamaConfig(**common, rope_parameters=scaling, tie_word_embeddings=True)
    if family == "mistral":
        # SGLang ignores Mistral's sliding_window (full attention): the reference does too.
        return tf.MistralConfig(**common, sliding_window=None, tie_word_embeddings=False)
    if family == "phi3":
        return tf.Phi3Config(**common, tie_word_embeddings=False, sliding_window=None)
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, **moe, head_dim=32, tie_word_embeddings=False)
    if family == "mixtral":
        return tf.MixtralConfig(
            **common,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=None,
            tie_word_embeddings=False,
        )
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **common, **moe, shared_expert_intermediate_size=64, tie_word_embeddings=False
        )
    if family == "gemma2":
        return tf.Gemma2Config(
            **common,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=TEST_WINDOW,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            # SGLang 0.5.23's Gemma2 reads `hidden_act` (Google's config.json has it beside
            # `hidden_activation`); transformers 5 no longer writes it.
            hidden_act="gelu_pytorch_tanh",
        )
    if family == "gemma3":
        return tf.Gemma3TextConfig(
            **dict(common, num_hidden_layers=6),
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=TEST_WINDOW,
            architectures=["Gemma3ForCausalLM"],
        )
    raise ValueError(f"unknown family {family!r}; choose from {sorted(FAMILIES)}")


def tiny_family_model(family: str, vocab_size: int = 1024, seed: int = 0) -> Any:
    """A random-weight fp32 transformers model of `family`, in eval mode (eager attention, the
    one that applies Gemma 2's score softcap)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = family_config(family, vocab_size)
    config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
