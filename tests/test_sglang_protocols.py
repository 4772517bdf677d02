"""Every attribute the protocols of `sglang_ext/sglang_types.py` name exists on SGLang's class.

The type checker (`make typecheck`, part of `make test`) holds the extension to the protocols;
this holds the protocols to SGLang 0.5.23: a member is found as a class attribute, a dataclass
field, or an assignment `self.<name> = ...` in the class's (or a base class's) source. A
renamed or removed attribute in a new SGLang fails here, by name, before any server starts.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import textwrap

import pytest

from sglang_hicache_ext.sglang_ext import sglang_types

pytest.importorskip("sglang")

# protocol -> the SGLang class it describes
DESCRIBES = {
    "SamplingParamsLike": "sglang.srt.sampling.sampling_params.SamplingParams",
    "ReqKv": "sglang.srt.managers.schedule_batch.ReqKvInfo",
    "ScheduledRequest": "sglang.srt.managers.schedule_batch.Req",
    "ForwardModeLike": "sglang.srt.model_executor.forward_batch_info.ForwardMode",
    "ExtendBatch": "sglang.srt.model_executor.forward_batch_info.ForwardBatch",
    "ReqToTokenPool": "sglang.srt.mem_cache.memory_pool.ReqToTokenPool",
    "ModelRunnerLike": "sglang.srt.model_executor.model_runner.ModelRunner",
    "PrefillAdderLike": "sglang.srt.managers.schedule_policy.PrefillAdder",
    "SchedulerLike": "sglang.srt.managers.scheduler.Scheduler",
}


def _members(protocol: type) -> set[str]:
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {
        name
        for name, value in vars(protocol).items()
        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))
    }
    return names


def _sglang_class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _assigned_on_self(cls: type) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith("builtins"):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        for node in ast.walk(ast.parse(source)):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            for target in targets:
                for sub in ast.walk(target):
                    if (
                        isinstance(sub, ast.Attribute)
                        and isinstance(sub.value, ast.Name)
                        and sub.value.id == "self"
                    ):
                        names.add(sub.attr)
    return names


def _has(cls: type, name: str) -> bool:
    if hasattr(cls, name):
        return True
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    return name in _assigned_on_self(cls)


def test_every_protocol_says_which_class_it_describes() -> None:
    protocols = {
        name
        for name, value in vars(sglang_types).items()
        if inspect.isclass(value)
        and getattr(value, "_is_protocol", False)
        and value.__module__ == sglang_types.__name__
    }
    assert protocols == set(DESCRIBES)


@pytest.mark.parametrize("protocol", sorted(DESCRIBES))
def test_sglang_has_every_member_the_protocol_names(protocol: str) -> None:
    cls = _sglang_class(DESCRIBES[protocol])
    missing = sorted(
        name for name in _members(getattr(sglang_types, protocol)) if not _has(cls, name)
    )
    assert not missing, f"{DESCRIBES[protocol]} has no {missing} (sglang_types.{protocol})"
