"""The code a `fusion_breakdown` mode runs (its `@tag`): the installed executor (no tag), a base
revision's attention and RoPE under today's executor (`@base`), or a patched copy of
fusion/executor.py (`@patched`), each applied only around its own runs."""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from sglang_hicache_ext.fusion import adapter as adapter_module
from sglang_hicache_ext.fusion import executor as installed_executor

REPO = Path(__file__).resolve().parent.parent


def module_from_file(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def module_at_revision(revision: str, path: str, folder: Path) -> ModuleType:
    """`path` as committed at `revision`, imported under a private name."""
    source = subprocess.run(
        ["git", "show", f"{revision}:{path}"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout
    target = folder / path.replace("/", "_")
    target.write_text(source)
    return module_from_file(f"base_{target.stem}", target)


@dataclass
class Variant:
    """The code a mode runs: an executor module and attributes replaced around each run."""

    executor: ModuleType
    patches: list[tuple[Any, str, Any]] = field(default_factory=list)

    @contextmanager
    def applied(self) -> Iterator[None]:
        saved = [(owner, name, getattr(owner, name)) for owner, name, _ in self.patches]
        for owner, name, value in self.patches:
            setattr(owner, name, value)
        try:
            yield
        finally:
            for owner, name, value in saved:
                setattr(owner, name, value)


def build_variants(
    base: str | None, executor_file: Path | None, folder: Path
) -> dict[str, Variant]:
    variants = {"": Variant(installed_executor)}
    if base is not None:
        attention = module_at_revision(base, "fusion/attention.py", folder)
        rope = module_at_revision(base, "fusion/rope.py", folder)
        variants["base"] = Variant(
            installed_executor,
            [
                (
                    installed_executor,
                    "attend",
                    _without_layout(attention.position_causal_attention),
                ),
                (adapter_module, "apply_rope", rope.apply_rope),
            ],
        )
    if executor_file is not None:
        variants["patched"] = Variant(module_from_file("patched_executor", executor_file))
    return variants


def _without_layout(attend: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """An older revision's attention under today's executor, given only the keyword arguments
    it takes: today's executor also tells it the layout (`causal`, `host_positions`, which
    revisions before 805434a took no such arguments for) and each layer's kind (`window`,
    `logit_cap`)."""
    accepted = inspect.signature(attend).parameters

    def call(*args: Any, **kwargs: Any) -> torch.Tensor:
        return attend(*args, **{name: value for name, value in kwargs.items() if name in accepted})

    return call
