"""Imports an editor can follow: jedi finds every `sglang_hicache_ext.*` name in its folder.

`make env` serves the namespace from folder links on sys.path (devenv/namespace_links.py), so a
tool that reads the file system, not only the running interpreter, reaches the real files. jedi
reports the path through the link (`<venv>/namespace/sglang_hicache_ext/...`); resolving it must
give the file in the checkout.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import jedi
import pytest

REPO = Path(__file__).resolve().parent.parent
# setup.py's folder mapping, read without building (its setup() call runs only as __main__)
LAYOUT = runpy.run_path(str(REPO / "setup.py"), run_name="package_layout")
PACKAGE_DIR: dict[str, str] = LAYOUT["PACKAGE_DIR"]


def _script(code: str) -> jedi.Script:
    # The interpreter running the tests is the venv an editor would be pointed at.
    project = jedi.Project(REPO, environment_path=sys.executable)
    return jedi.Script(code, path=REPO / "editor_buffer.py", project=project)


def _line_of(path: Path, start: str) -> int:
    lines = path.read_text().splitlines()
    return next(number for number, line in enumerate(lines, 1) if line.startswith(start))


def test_go_to_definition_reaches_the_function_in_its_folder() -> None:
    code = "from sglang_hicache_ext.fusion.selectors import make_selector\n"
    definitions = _script(code).goto(1, code.index("make_selector") + 1, follow_imports=True)
    selectors = REPO / "fusion" / "selectors" / "registry.py"
    assert [(d.name, d.type) for d in definitions] == [("make_selector", "function")]
    assert Path(definitions[0].module_path).resolve() == selectors
    assert definitions[0].line == _line_of(selectors, "def make_selector(")


def test_inferred_call_is_the_function_in_its_folder() -> None:
    code = "from sglang_hicache_ext.fusion.selectors import make_selector\nmake_selector\n"
    inferred = _script(code).infer(2, 1)
    registry = REPO / "fusion" / "selectors" / "registry.py"
    assert [Path(d.module_path).resolve() for d in inferred] == [registry]


@pytest.mark.parametrize(("package", "folder"), sorted(PACKAGE_DIR.items()))
def test_every_mapped_folder_is_followable(package: str, folder: str) -> None:
    code = f"import {package}\n"
    definitions = _script(code).goto(1, len(code) - 2, follow_imports=True)
    assert [Path(d.module_path).resolve() for d in definitions] == [REPO / folder / "__init__.py"]
