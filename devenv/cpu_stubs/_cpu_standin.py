"""Shared helper for the import-only stand-ins of the CPU development environment."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import NoReturn


class Unavailable:
    """A name that imports fine, resolves attributes to further stand-ins, and fails if called."""

    def __init__(self, qualified_name: str) -> None:
        self._qualified_name = qualified_name
        self.__name__ = qualified_name.rsplit(".", 1)[-1]

    def __getattr__(self, name: str) -> Unavailable:
        if name.startswith("__"):
            raise AttributeError(name)
        return Unavailable(f"{self._qualified_name}.{name}")

    def __call__(self, *args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(
            f"{self._qualified_name} was called, but the CPU development environment only has an "
            "import stand-in for it (devenv/cpu_stubs)."
        )

    def __repr__(self) -> str:
        return f"<CPU stand-in {self._qualified_name}>"


def module_getattr(module_name: str):
    def __getattr__(name: str) -> Unavailable:
        if name.startswith("__"):
            raise AttributeError(name)
        return Unavailable(f"{module_name}.{name}")

    return __getattr__


class _SubmoduleStandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves every `<package>.<sub>` import to a stand-in module."""

    def __init__(self, package: str) -> None:
        self._prefix = package + "."

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if not fullname.startswith(self._prefix):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__getattr__ = module_getattr(module.__name__)  # type: ignore[method-assign]


def serve_submodules(package: str) -> None:
    """Make `import <package>.anything` succeed with stand-in modules."""
    if not any(isinstance(f, _SubmoduleStandInFinder) and f._prefix == package + "." for f in sys.meta_path):
        sys.meta_path.append(_SubmoduleStandInFinder(package))
