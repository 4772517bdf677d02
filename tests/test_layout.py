"""The package's layout rules: one namespace, cores without SGLang, small modules, a true map."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig

REPO = Path(__file__).resolve().parent.parent
NAMESPACE = "sglang_hicache_ext"
CORES = ("fusion", "radix", "tiers", "tuning", "evaluation")
FOLDERS = (*CORES, "sglang_ext")
MAX_MODULE_LINES = 400


def _tracked_python_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    return [REPO / name for name in listed if (REPO / name).exists()]


def _modules(folder: str) -> list[str]:
    names = []
    for path in sorted((REPO / folder).rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__main__":
            continue  # running a CLI is not importing the package
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join((NAMESPACE, *parts)))
    return names


@pytest.mark.parametrize("core", CORES)
def test_cores_never_import_sglang(core: str) -> None:
    # A fresh interpreter, so that nothing imported by other tests hides an import.
    code = (
        "import importlib, sys\n"
        f"for name in {_modules(core)!r}:\n"
        "    importlib.import_module(name)\n"
        "bad = sorted(m for m in sys.modules if m == 'sglang' or m.startswith('sglang.'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, (
        f"{core}/ imports SGLang: {result.stdout} {result.stderr[-2000:]}"
    )


# Which cores each core may import (docs/architecture.md, "The dependency rule").
ALLOWED_CORE_IMPORTS = {
    "fusion": set(),
    "radix": set(),
    "evaluation": {"fusion"},
    "tiers": {"radix"},
    "tuning": {"radix", "tiers"},
}


@pytest.mark.parametrize("core", CORES)
def test_cores_depend_on_each_other_one_way(core: str) -> None:
    imported = re.compile(rf"^\s*(?:from|import)\s+{NAMESPACE}\.([a-z_]+)", re.MULTILINE)
    used = {
        name for path in (REPO / core).rglob("*.py") for name in imported.findall(path.read_text())
    } - {core}
    assert used <= ALLOWED_CORE_IMPORTS[core], f"{core}/ imports {sorted(used)}"


@pytest.mark.parametrize("ground", ["config", "metrics"])
def test_the_adapters_ground_imports_no_other_adapter_folder(ground: str) -> None:
    # docs/architecture.md, "The dependency rule": settings and metrics are what every adapter
    # folder stands on; one import from them back up (to chunk_fusion/, server/, ...) would tie
    # the ground to the top again.
    imported = re.compile(rf"^\s*(?:from|import)\s+{NAMESPACE}\.sglang_ext\.([a-z_]+)", re.M)
    used = {
        name
        for path in (REPO / "sglang_ext" / ground).rglob("*.py")
        for name in imported.findall(path.read_text())
    } - {"config", "metrics"}
    assert used == set(), f"sglang_ext/{ground}/ imports sglang_ext/{sorted(used)}"


def test_every_import_goes_through_the_namespace() -> None:
    # The folders sit at the repository's top, so `import radix` would work from a checkout and
    # fail (or import someone else's `radix`) once installed.
    legacy = re.compile(rf"^\s*(from|import)\s+({'|'.join(FOLDERS)})(\.|\s|$)", re.MULTILINE)
    offenders = [
        f"{path.relative_to(REPO)}: {match.group(0).strip()}"
        for path in _tracked_python_files()
        for match in legacy.finditer(path.read_text())
    ]
    assert offenders == []


def _package_modules() -> dict[str, Path]:
    """Every module of the package by its import name (a package by its `__init__.py`)."""
    modules = {}
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((NAMESPACE, *parts))] = path
    return modules


def _imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module `name` imports anywhere in it (inside functions and
    `if TYPE_CHECKING:` blocks too). Each imported name is resolved to its longest prefix that
    is a module: `from pkg import sub` imports the submodule `pkg.sub`, `from mod import f`
    imports `mod`."""
    package = name.split(".")[: None if path.name == "__init__.py" else -1]
    named: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            named += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            anchor = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join([*anchor, *([node.module] if node.module else [])])
            named += [f"{base}.{alias.name}" for alias in node.names]
    imported = set()
    for dotted in named:
        parts = dotted.split(".")
        prefixes = (".".join(parts[:end]) for end in range(len(parts), 0, -1))
        module = next((prefix for prefix in prefixes if prefix in modules), None)
        if module is not None and module != name:
            imported.add(module)
    return imported


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    stack = [start]
    while stack:
        for other in graph[stack.pop()] - seen:
            seen.add(other)
            stack.append(other)
    return seen


def _shortest_cycle(graph: dict[str, set[str]], start: str) -> list[str]:
    """The shortest import path from `start` back to itself (breadth first)."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for other in sorted(graph[module]):
                if other == start:
                    return [*paths[module], start]
                if other not in paths:
                    paths[other] = [*paths[module], other]
                    following.append(other)
        frontier = following
    raise AssertionError(f"{start} is on no cycle")


def test_import_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    source = tmp_path / "a.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import b\n"  # a submodule, relative
        "from .pkg import helper\n"  # a name of a package's __init__
        "if TYPE_CHECKING:\n"
        "    from ns.c import C\n"
        "def late():\n"
        "    import ns.d.e\n"
    )
    names = ["ns.a", "ns.b", "ns.c", "ns.d", "ns.d.e", "ns.pkg"]
    modules = {name: tmp_path / f"{name}.py" for name in names}
    assert _imported_modules("ns.a", source, modules) == {"ns.b", "ns.c", "ns.d.e", "ns.pkg"}


def test_no_import_cycle_between_modules() -> None:
    # Two modules that import each other (directly or through others, type-checking imports
    # included) are one module in two files: neither can be read, tested or moved alone.
    modules = _package_modules()
    graph = {name: _imported_modules(name, path, modules) for name, path in modules.items()}
    reachable = {name: _reachable(graph, name) for name in graph}
    cycles, placed = [], set()
    for name in sorted(graph):
        group = {other for other in reachable[name] if name in reachable[other]}
        if len(group) > 1 and name not in placed:  # a strongly connected component
            placed |= group
            cycle = " -> ".join(
                m.removeprefix(f"{NAMESPACE}.") for m in _shortest_cycle(graph, name)
            )
            cycles.append(f"{cycle} ({len(group)} modules import each other)")
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)


# Folders of measurement code outside the package: a test imports neither (a benchmark's own
# checks live in benchmarks/tests/; logic a test needs belongs to the package).
MEASUREMENT_FOLDERS = ("benchmarks", "research")
LOADERS = {"spec_from_file_location", "run_path", "run_module", "import_module"}


def _measurement_modules_imported(tree: ast.Module) -> list[str]:
    """Modules of benchmarks/ or research/ a test imports: by statement, or by name or path
    through an importlib / runpy loader."""
    imported: list[str] = []
    strings: list[str] = []
    loads = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported.append(node.module)
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            loads |= name in LOADERS
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            strings.append(node.value)
    named = imported + (strings if loads else [])
    return [n for n in named if re.split(r"[./]", n, maxsplit=1)[0] in MEASUREMENT_FOLDERS]


def test_tests_import_no_benchmark() -> None:
    offenders = [
        f"{path.relative_to(REPO)}: {name}"
        for path in sorted((REPO / "tests").rglob("*.py"))
        for name in _measurement_modules_imported(ast.parse(path.read_text()))
    ]
    assert offenders == []


def test_installed_code_never_reads_the_shared_folder() -> None:
    # `../shared` sits beside a checkout, never beside an installed package: a path into it is
    # passed in by the caller (a test, a benchmark, a command-line argument).
    shared = re.compile(r"""\.\./shared|["']shared["']|shared/data""")
    offenders = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for folder in FOLDERS
        for path in sorted((REPO / folder).rglob("*"))
        if path.suffix in {".py", ".json"}
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if shared.search(line)
    ]
    assert offenders == []


# Import name -> distribution, where they differ; pydantic_core is pydantic's own API.
DISTRIBUTION_OF = {
    "yaml": "pyyaml",
    "prometheus_client": "prometheus-client",
    "pydantic_core": "pydantic",
}
OPTIONAL_IMPORTS = {"flashinfer", "mooncake"}  # the `gpu` and `mooncake` extras


def test_declared_dependencies_are_what_the_package_imports() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {
        re.split(r"[<>=\[ ;]", spec, maxsplit=1)[0].lower() for spec in project["dependencies"]
    }
    imported = set()
    top_level = re.compile(r"^\s*(?:from|import)\s+([A-Za-z_][A-Za-z0-9_]*)", re.MULTILINE)
    for folder in FOLDERS:
        for path in (REPO / folder).rglob("*.py"):
            imported |= set(top_level.findall(path.read_text()))
    third_party = imported - set(sys.stdlib_module_names) - {NAMESPACE, "__future__"}
    needed = {DISTRIBUTION_OF.get(name, name) for name in third_party - OPTIONAL_IMPORTS}
    assert needed == declared, (
        f"imported, undeclared: {sorted(needed - declared)}; declared, unused: {sorted(declared - needed)}"
    )


def test_every_file_is_formatted() -> None:
    """ruff format's layout, so the size limit below counts formatted lines: a file cannot
    pass it by long lines that the formatter would wrap."""
    checked = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--output-format", "concise", "."],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_no_module_over_the_size_limit() -> None:
    sizes = {path: len(path.read_text().splitlines()) for path in _tracked_python_files()}
    over = {str(p.relative_to(REPO)): n for p, n in sizes.items() if n > MAX_MODULE_LINES}
    assert over == {}


def test_architecture_map_lists_every_package_folder() -> None:
    page = (REPO / "docs" / "architecture.md").read_text()
    block = page.split("```text", 1)[1].split("```", 1)[0]
    mapped = set(re.findall(r"^\s*([a-z_]+(?:/[a-z_]+)*)/\s", block, re.MULTILINE))
    packages = {
        str(init.parent.relative_to(REPO))
        for folder in FOLDERS
        for init in (REPO / folder).rglob("__init__.py")
    }
    assert packages - mapped == set(), "folders missing from docs/architecture.md's map"
    others = {"benchmarks", "research", "examples", "tests", "scripts", "devenv", "docs"}
    assert mapped - packages - others == set()


def test_architecture_page_names_only_files_that_exist() -> None:
    page = (REPO / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`([a-z_/]+\.py)", page))
    # Flows name modules relative to their folder (`config/settings.py`) or the repository.
    roots = [REPO, REPO / "sglang_ext"]
    missing = sorted(n for n in named if not any((root / n).exists() for root in roots))
    assert named and missing == []


@pytest.mark.parametrize(
    ("device", "expected", "absent"),
    [
        (
            "cpu",
            ["--device", "cpu", "--sleep-on-idle", "--attention-backend", "torch_position"],
            [],
        ),
        (
            "cuda",
            ["--device", "cuda"],
            ["--sleep-on-idle", "torch_position", "--mem-fraction-static"],
        ),
    ],
)
def test_launcher_follows_the_device(device: str, expected: list[str], absent: list[str]) -> None:
    config = ServerConfig(model_path="m", device=device)
    command = config.command()
    joined = " ".join(command)
    for flag in expected:
        assert flag in command
    for flag in absent:
        assert flag not in joined
    if device == "cpu":
        assert config.environment()["SGLANG_USE_CPU_ENGINE"] == "1"
