"""No module-level mutable state in `sglang_ext`: what a scheduler or an HTTP process holds
lives on objects the assembly builds (`sglang_ext/assembly.py`, `server/http_state.py`) and
hands in, never in a module global that a second server in the same process, or a test, would
share.

Every module of the package is imported and each of its globals classified; `global`
statements are found by ast. What is left is process-wide by nature and listed below with the
reason; a new entry must say why it cannot live on an object.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import logging
import re
import types
from contextvars import ContextVar
from enum import Enum
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "sglang_hicache_ext.sglang_ext"

# name -> why it is process-wide state
PROCESS_WIDE = {
    "sglang_ext.disk_tier.dir_claim._server_locks": "an OS file lock is held per process: two "
    "disk tiers of one process on one directory must share the process's one lock",
    "sglang_ext.disk_tier.dir_claim._server_locks_mutex": "guards _server_locks",
    "sglang_ext.server.preflight._checked": "SGLang calls ServerArgs.resolve_once more than once "
    "per launch; the launch checks run once per ServerArgs object of this process",
    "sglang_ext.radix_cache._cache_class": "the subclass of SGLang's tree, made on first use (the "
    "module imports without SGLang's tree code): one class per process, as any class",
    "sglang_ext.disk_tier.controller._classes": "the TTL-passing subclass of each SGLang "
    "controller class, made on first use: one class per base class and process",
    "sglang_ext.chunk_fusion.adapters.registry._ADAPTERS": "adapter classes, registered by "
    "their decorator at import: a table of classes, as SGLang's own model registry",
    "sglang_ext.server.launcher._starter": "how this process starts servers (the test suite "
    "forks them from a warm zygote): chosen for the process by `server_starter`",
}

_IMMUTABLE = (
    str,
    bytes,
    int,
    float,
    bool,
    type(None),
    tuple,
    frozenset,
    re.Pattern,
    logging.Logger,
    ContextVar,
    Enum,
    types.ModuleType,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.GenericAlias,
    types.UnionType,
    types.MappingProxyType,
    Path,
)


def _modules() -> list[str]:
    names = []
    for path in sorted((ROOT / "sglang_ext").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


def _is_state(value: object) -> bool:
    if isinstance(value, functools._lru_cache_wrapper):
        return True  # a cache of results: state shared by every caller in the process
    if isinstance(value, _IMMUTABLE) or inspect.isroutine(value):
        return False
    if type(value).__module__ in ("typing", "_collections_abc", "collections.abc"):
        return False  # type aliases, TypeVars
    if isinstance(value, functools.partial):
        return False
    return not _frozen(value)


def _frozen(value: object) -> bool:
    params = getattr(type(value), "__dataclass_params__", None)
    return bool(params is not None and params.frozen)


def _defined_names(tree: ast.Module) -> set[str]:
    """Names the module itself binds at its top level (imports excluded)."""
    names: set[str] = set()
    for node in tree.body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)  # a cached function is state (checked by value)
        for target in targets:
            names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def _module_state() -> dict[str, str]:
    found: dict[str, str] = {}
    for name in _modules():
        module = importlib.import_module(f"sglang_hicache_ext.{name}")
        tree = ast.parse(Path(inspect.getfile(module)).read_text())
        for attr in sorted(_defined_names(tree)):
            value = getattr(module, attr, None)
            if not attr.startswith("__") and _is_state(value):
                found[f"{name}.{attr}"] = type(value).__name__
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                for target in node.names:
                    found.setdefault(f"{name}.{target}", "assigned by a `global` statement")
    return found


def test_no_module_level_mutable_state_in_sglang_ext() -> None:
    pytest.importorskip("sglang")
    state = _module_state()
    unexplained = {name: kind for name, kind in state.items() if name not in PROCESS_WIDE}
    assert not unexplained, (
        "module-level state (build it in sglang_ext/assembly.py or server/http_state.py and "
        f"hand it in, or say in PROCESS_WIDE why it is per process): {unexplained}"
    )
    stale = sorted(set(PROCESS_WIDE) - set(state))
    assert not stale, f"PROCESS_WIDE names what is gone: {stale}"
