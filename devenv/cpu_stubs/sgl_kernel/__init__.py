"""Import-only stand-in for `sgl_kernel` (CPU development environment only).

sgl_kernel has no CPU wheel on PyPI, yet `SGLANG_USE_CPU_ENGINE=1` makes some SGLang modules
import names from it at module level. On a CPU without AMX none of these kernels is called:
RMSNorm, rotary and activations fall back to torch. Any name imports as a callable that raises
if it is ever called, so a missing fallback fails loudly instead of computing garbage.

Submodules (`sgl_kernel.allreduce`, ...) deliberately do not exist: SGLang guards those imports
with `try/except ImportError` and must take its fallback path.
"""

from _cpu_standin import module_getattr

__version__ = "0.0.0+cpu-stand-in"
__getattr__ = module_getattr("sgl_kernel")
