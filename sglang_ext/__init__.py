"""sglang-hicache-ext: an SGLang extension for long-context and RAG serving.

Everything here that touches SGLang imports it lazily; `sglang_hicache_ext.fusion` never does.
"""

__version__ = "0.1.0"
