"""Import-only stand-in for `torchvision` (CPU development environment only).

PyPI's torchvision 0.28.0 is a CUDA build that fails at import next to the CPU torch. SGLang and
transformers import it (and submodules such as `torchvision.transforms`, `torchvision.io`) from
vision-model config, processor and image-utility modules that a text model never runs, so every
submodule resolves to a stand-in whose names fail only if called.
"""

from _cpu_standin import module_getattr, serve_submodules

__version__ = "0.0.0+cpu-stand-in"
__getattr__ = module_getattr("torchvision")
serve_submodules("torchvision")
