"""Which adapter serves an SGLang model: registered by SGLang class name, found on the MRO.

A family's file registers its adapter under the names of SGLang's classes it serves
(`@register("LlamaForCausalLM")`); a subclass SGLang adds without changes of its own
(`MistralForCausalLM`, `Phi3ForCausalLM`, `InternLM3ForCausalLM` are empty `LlamaForCausalLM`
subclasses) is served by its nearest registered base. An architecture that needs a store format
the core does not have (DeepSeek's MLA latents) is refused by name with the reason.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.decoder import SGLangDecoderAdapter

_ADAPTERS: dict[str, type[SGLangDecoderAdapter]] = {}

# The family files, imported once on first lookup so that each registers its classes.
_FAMILY_MODULES = ("llama", "qwen2", "qwen3", "mixtral", "qwen_moe", "gemma")

# Architectures refused with a reason of their own (matched on the MRO too).
REFUSED: Mapping[str, str] = MappingProxyType(
    {
        "DeepseekV2ForCausalLM": "DeepSeek's MLA keeps one latent vector per token, a store format "
        "chunk fusion does not have",
        "DeepseekV3ForCausalLM": "DeepSeek's MLA keeps one latent vector per token, a store format "
        "chunk fusion does not have",
    }
)

A = TypeVar("A", bound=type[SGLangDecoderAdapter])


class NoAdapterError(ValueError):
    """The model's class has no fusion adapter (or is refused): fusion stays off for it."""


def register(*class_names: str) -> Callable[[A], A]:
    """Class decorator: the adapter serves SGLang's classes of these names (and subclasses)."""

    def add(adapter: A) -> A:
        for name in class_names:
            if name in _ADAPTERS and _ADAPTERS[name] is not adapter:
                raise ValueError(f"{name} already has the adapter {_ADAPTERS[name].__name__}")
            _ADAPTERS[name] = adapter
        return adapter

    return add


def _load_families() -> None:
    for name in _FAMILY_MODULES:
        importlib.import_module(f"{__package__}.{name}")


def supported_architectures() -> list[str]:
    """SGLang class names fusion has an adapter for (their subclasses are served too)."""
    _load_families()
    return sorted(_ADAPTERS)


def adapter_class(model_class: type) -> type[SGLangDecoderAdapter]:
    """The adapter of `model_class`: its own name's, else its nearest registered base's."""
    _load_families()
    for cls in model_class.__mro__:
        if cls.__name__ in REFUSED:
            raise NoAdapterError(f"fusion refuses {model_class.__name__}: {REFUSED[cls.__name__]}")
        if cls.__name__ in _ADAPTERS:
            return _ADAPTERS[cls.__name__]
    raise NoAdapterError(
        f"fusion has no adapter for {model_class.__name__}; supported: "
        f"{', '.join(supported_architectures())} and their subclasses"
    )


def adapter_for(model: Any, hf_config: Any, **options: Any) -> SGLangDecoderAdapter:
    """Build the adapter of SGLang's loaded `model` (NoAdapterError when there is none;
    ValueError when the family has one but this model's configuration cannot be served
    exactly, e.g. a RoPE that depends on the sequence length)."""
    return adapter_class(type(model))(model, hf_config, **options)
