"""One place makes the extension's parts: `sglang_ext/assembly.py` in the scheduler process,
`sglang_ext/server/http_state.py` in the HTTP process. Every other module of `sglang_ext` is
handed them; a call that constructs one anywhere else fails here (found by ast, so a part
built in a function nobody has called yet is found too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SGLANG_EXT = ROOT / "sglang_ext"

# part -> the modules allowed to construct it
SCHEDULER_PARTS = {
    "FusionService": {"assembly.py"},
    "ChunkRegistry": {"assembly.py"},
    "ChunkDiskTier": {"assembly.py"},
    "ChunkRemoteTier": {"assembly.py"},
    "MooncakeClient": {"assembly.py"},
    "ContextVariants": {"assembly.py"},
    "AutoCapture.for_settings": {"assembly.py"},
    "AutoCapture": set(),  # through AutoCapture.for_settings
    "ModelCheck": {"assembly.py"},
    "FrequencyAdmission.for_entries": {"assembly.py"},
    "FrequencyAdmission": set(),  # through FrequencyAdmission.for_entries
    "SelfTunedRatios.for_model": {"assembly.py"},
    "LiveFidelity": {"assembly.py"},
    "process_metrics": {"assembly.py"},
    # inside process_metrics; and a throwaway registry's, to list the series in docs/reference.md
    "ExtensionMetrics": {"metrics/prometheus_metrics.py", "server/reference.py"},
}
HTTP_PARTS = {
    "HttpProcessState": {"server/http_state.py"},
    "ShadowChecks": {"server/http_state.py"},
    "PlacementRounds": {"server/http_state.py"},
    "FusedTtftMetrics": {"server/http_state.py", "server/reference.py"},
}
PARTS = SCHEDULER_PARTS | HTTP_PARTS


def _called(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        if isinstance(func.value, ast.Name) and f"{func.value.id}.{func.attr}" in PARTS:
            return f"{func.value.id}.{func.attr}"
        return func.attr
    return None


def _constructions() -> dict[str, set[str]]:
    """part -> the modules (relative to sglang_ext/) that call it."""
    found: dict[str, set[str]] = {}
    for path in sorted(SGLANG_EXT.rglob("*.py")):
        where = path.relative_to(SGLANG_EXT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and (name := _called(node)) in PARTS:
                found.setdefault(name, set()).add(where)
    return found


@pytest.mark.parametrize("part", sorted(PARTS))
def test_each_part_is_made_in_one_place(part: str) -> None:
    made_in = _constructions().get(part, set())
    assert made_in == PARTS[part], f"{part} is constructed in {sorted(made_in)}"


def test_the_hooks_find_the_service_where_the_assembly_puts_it() -> None:
    """The tree cache answers `service_of` through the same attribute the assembly sets on the
    model runner: the scheduler's hooks read one, the forward hook the other."""
    pytest.importorskip("sglang")
    from sglang_hicache_ext.sglang_ext.chunk_fusion.service import SERVICE_ATTRIBUTE
    from sglang_hicache_ext.sglang_ext.radix_cache import cache_class

    assert isinstance(getattr(cache_class(), SERVICE_ATTRIBUTE), property)
    source = (SGLANG_EXT / "assembly.py").read_text()
    assert "setattr(ctx.tp_worker.model_runner, SERVICE_ATTRIBUTE, cache.fusion)" in source
