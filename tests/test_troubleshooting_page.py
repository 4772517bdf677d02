"""docs/troubleshooting.md names every fallback reason the code has, and README.md links it.

The reasons are read from the source of `sglang_ext/` with `ast` (nothing is imported: no torch,
no SGLang). A reason can reach a response, the `/server_info` counters or `/metrics` only
through one of these sinks, and the collector reads every one of them:

- an assignment to `fallback` or `<anything>.fallback` (`plan.fallback = "no_chunk_matched"`),
- a `fallback=` keyword of any call, and a `"fallback"` key of a dict literal,
- the reason argument of `fall_back(rt, plans, reason)`, `metrics.fusion_fallback(reason)` and
  `service.fallback(reason)`,
- a counter key spelled `"fallback_<reason>"`,
- a `return` of a function whose name holds "fallback" (`_static_fallback_reason`,
  `ModelCheck.fallback`).

A sink's value is resolved to string literals through `a or b`, `a if c else b` and module
constants (`RANKS_DISAGREE`). A value that only forwards a reason set at another sink (an
attribute `.fallback`, a call of a function whose returns are sinks, the reason parameter of
`fall_back`) adds nothing. Any other value fails the test with its file and line, so a new
reason cannot be added in a form the collector does not read.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = REPO / "sglang_ext"
PAGE = REPO / "docs" / "troubleshooting.md"
README = REPO / "README.md"

# Calls whose argument is a reason: (position among the call's arguments, parameter name).
REASON_CALLS = {
    "fall_back": (2, "reason"),
    "fusion_fallback": (0, "reason"),
    "fallback": (0, "reason"),  # FusionService.fallback (a method: `service.fallback(...)`)
}
COUNTER_PREFIX = "fallback_"


@dataclass
class Reasons:
    found: dict[str, list[str]] = field(default_factory=dict)  # reason -> where
    unresolved: list[str] = field(default_factory=list)  # "file:line: source"


def _name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _is_fallback_target(target: ast.expr) -> bool:
    return (isinstance(target, ast.Name) and target.id == "fallback") or (
        isinstance(target, ast.Attribute) and target.attr == "fallback"
    )


def _module_constants(tree: ast.Module) -> dict[str, str]:
    constants: dict[str, str] = {}
    for node in tree.body:
        target = value = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        if (
            isinstance(target, ast.Name)
            and isinstance(value, ast.Constant)
            and isinstance(value.value, str)
        ):
            constants[target.id] = value.value
    return constants


class _Collector(ast.NodeVisitor):
    def __init__(
        self,
        where: str,
        source: str,
        constants: dict[str, set[str]],
        forwarders: set[str],
        out: Reasons,
    ) -> None:
        self.where, self.source, self.constants = where, source, constants
        self.forwarders, self.out = forwarders, out
        self.functions: list[ast.FunctionDef | ast.AsyncFunctionDef] = []

    # -- the sinks --------------------------------------------------------------------

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.functions.append(node)
        self.generic_visit(node)
        self.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Return(self, node: ast.Return) -> None:
        if self.functions and "fallback" in self.functions[-1].name and node.value is not None:
            self._sink(node.value)
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        if any(_is_fallback_target(target) for target in node.targets):
            self._sink(node.value)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if _is_fallback_target(node.target) and node.value is not None:
            self._sink(node.value)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = _name(node.func)
        # A plain `fallback(...)` is another thing (fault_guard's default of a failed call).
        method_only = name == "fallback" and not isinstance(node.func, ast.Attribute)
        if name in REASON_CALLS and not method_only:
            position, keyword = REASON_CALLS[name]
            given = [kw.value for kw in node.keywords if kw.arg == keyword]
            if len(node.args) > position:
                given.append(node.args[position])
            if not given:
                self._unresolved(node)
            for value in given:
                self._sink(value)
        for kw in node.keywords:
            if kw.arg == "fallback":
                self._sink(kw.value)
        self.generic_visit(node)

    def visit_Dict(self, node: ast.Dict) -> None:
        for key, value in zip(node.keys, node.values, strict=True):
            if isinstance(key, ast.Constant) and key.value == "fallback":
                self._sink(value)
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        key = node.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            if key.value.startswith(COUNTER_PREFIX):
                self._add(key.value.removeprefix(COUNTER_PREFIX), node)
        elif isinstance(key, ast.JoinedStr) and key.values:
            head = key.values[0]
            if (
                isinstance(head, ast.Constant)
                and isinstance(head.value, str)
                and head.value.startswith(COUNTER_PREFIX)
            ):
                rest = key.values[1:]
                if (
                    head.value == COUNTER_PREFIX
                    and len(rest) == 1
                    and isinstance(rest[0], ast.FormattedValue)
                ):
                    self._sink(rest[0].value)
                else:
                    self._unresolved(node)
        self.generic_visit(node)

    # -- resolving a sink's value ---------------------------------------------------------

    def _sink(self, value: ast.expr) -> None:
        if isinstance(value, ast.Constant):
            if isinstance(value.value, str):
                self._add(value.value, value)
            elif value.value is not None:
                self._unresolved(value)
        elif isinstance(value, ast.BoolOp):
            for part in value.values:
                self._sink(part)
        elif isinstance(value, ast.IfExp):
            self._sink(value.body)
            self._sink(value.orelse)
        elif isinstance(value, ast.Name) and value.id in self.constants:
            for reason in sorted(self.constants[value.id]):
                self._add(reason, value)
        elif isinstance(value, ast.Name) and self._forwarded_parameter(value.id):
            pass  # `reason` inside fall_back: every call of it is a sink
        elif isinstance(value, ast.Attribute) and value.attr == "fallback":
            pass  # every write of a `.fallback` (and the `fallback` property) is a sink
        elif isinstance(value, ast.Call) and _name(value.func) in self.forwarders:
            pass  # a function whose name holds "fallback": its returns are sinks
        else:
            self._unresolved(value)

    def _forwarded_parameter(self, name: str) -> bool:
        if not self.functions or self.functions[-1].name not in REASON_CALLS:
            return False
        return name == REASON_CALLS[self.functions[-1].name][1]

    def _add(self, reason: str, node: ast.AST) -> None:
        self.out.found.setdefault(reason, []).append(f"{self.where}:{node.lineno}")

    def _unresolved(self, node: ast.AST) -> None:
        text = ast.get_source_segment(self.source, node) or ast.dump(node)
        self.out.unresolved.append(f"{self.where}:{node.lineno}: {text}")


def collect_reasons(sources: dict[str, str]) -> Reasons:
    """The fallback reasons of `sources` (path -> Python source)."""
    trees = {path: ast.parse(text, filename=path) for path, text in sources.items()}
    constants: dict[str, set[str]] = {}
    forwarders: set[str] = set()
    for tree in trees.values():
        for name, value in _module_constants(tree).items():
            constants.setdefault(name, set()).add(value)
        forwarders |= {
            node.name
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and "fallback" in node.name
        }
    out = Reasons()
    for path, tree in trees.items():
        _Collector(path, sources[path], constants, forwarders, out).visit(tree)
    return out


def _code_sources() -> dict[str, str]:
    return {str(path.relative_to(REPO)): path.read_text() for path in sorted(SOURCES.rglob("*.py"))}


def _table_reasons(page: str) -> list[str]:
    """The first column of the table under `## Every fallback reason`."""
    section = page.split("\n## Every fallback reason\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert rows and rows[0].startswith("| reason |"), "the fallback table's header changed"
    return [row.split(" | ", 1)[0].removeprefix("| ").strip("`") for row in rows[2:]]


def test_collector_reads_every_kind_of_sink() -> None:
    source = """
KIND = "from_a_constant"
def fall_back(rt, plans, reason):
    for plan in plans:
        plan.fallback = reason
def _some_fallback_reason(req):
    return "from_a_return" if req else None
def plan(rt, plans, req, metrics):
    plans[0].fallback = "from_an_assignment"
    fall_back(rt, plans, KIND)
    fall_back(rt, plans, reason=rt.model.fallback or "from_a_default")
    metrics.fusion_fallback("from_metrics")
    rt.counters["fallback_from_a_counter"] += 1
    rt.counters[f"fallback_{plans[0].fallback}"] += 1
    plans[0].fallback = _some_fallback_reason(req)
    make(fallback="from_a_keyword")
    return {"fused": False, "fallback": "from_a_dict"}
def unreadable(rt, plans, x):
    fall_back(rt, plans, x)
    plans[0].fallback = pick()
    rt.counters[f"fallback_{x}_{x}"] += 1
"""
    reasons = collect_reasons({"example.py": source})
    assert set(reasons.found) == {
        "from_a_constant",
        "from_a_return",
        "from_an_assignment",
        "from_a_default",
        "from_metrics",
        "from_a_counter",
        "from_a_keyword",
        "from_a_dict",
    }
    assert [line.split(": ", 1)[1] for line in reasons.unresolved] == [
        "x",
        "pick()",
        'rt.counters[f"fallback_{x}_{x}"]',
    ]


def test_every_fallback_reason_of_the_code_is_in_the_table() -> None:
    reasons = collect_reasons(_code_sources())
    assert reasons.unresolved == [], (
        "fallback reasons the test cannot read (use a string literal or a module constant, "
        "or teach tests/test_troubleshooting_page.py the new form):\n"
        + "\n".join(reasons.unresolved)
    )
    # Reasons the code is known to have: a collector that finds none of them is broken.
    assert {"no_chunk_matched", "prefix_cached", "tp_ranks_disagree", "bad_options"} <= set(
        reasons.found
    )
    table = _table_reasons(PAGE.read_text())
    assert len(table) == len(set(table)), "a reason is in the table twice"
    missing = {reason: reasons.found[reason] for reason in sorted(set(reasons.found) - set(table))}
    assert not missing, f"fallback reasons missing from {PAGE.name}'s table: {missing}"
    stale = sorted(set(table) - set(reasons.found))
    assert not stale, f"{PAGE.name}'s table names reasons the code no longer has: {stale}"


def test_readme_reading_table_links_the_page() -> None:
    section = README.read_text().split("\n## Where to read on\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert any("](docs/troubleshooting.md)" in row for row in rows)
