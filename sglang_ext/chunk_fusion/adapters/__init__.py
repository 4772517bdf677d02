"""SGLang's model classes behind the fusion core's `ModelAdapter`: one file per family, picked
by `adapter_for` through the registry (`registry.py`) on the model class's MRO."""

from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.registry import (
    NoAdapterError,
    adapter_for,
    supported_architectures,
)

__all__ = ["NoAdapterError", "adapter_for", "supported_architectures"]
