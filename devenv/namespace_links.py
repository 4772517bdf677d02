"""Serve `sglang_hicache_ext.*` from a tree of folder links, so editors and tools follow imports.

setup.py maps each top folder to a subpackage (`package_dir`). For that mapping the editable
install can only write an import hook: the interpreter follows it, but jedi, pyright and
import-graph tools read the file system and find no `sglang_hicache_ext` at all. This writes
`<venv>/namespace/sglang_hicache_ext/<folder>`, one relative symlink per mapped folder, and a
`.pth` file that puts `<venv>/namespace` on sys.path: Python's path finder, which runs before the
hook, then serves every import from these links, and a tool that reads sys.path finds the same
files. Whole folders are linked, where setuptools' strict editable mode links each file, so a
module or subpackage added later is importable and followable at once; a new top folder edits
setup.py, which makes `make env` run this again. Only for the development venv: the wheel is
built from setup.py's mapping and never contains these links.
"""

from __future__ import annotations

import os
import runpy
import shutil
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PTH_NAME = "sglang_hicache_ext_links.pth"


def write_links(tree: Path, package_dir: dict[str, str]) -> None:
    """Link each mapped package's path under `tree` to its folder (relative links)."""
    nested = [p for p in package_dir if any(p.startswith(f"{q}.") for q in package_dir)]
    if nested:  # its link would land inside a linked folder, i.e. in the checkout itself
        raise SystemExit(f"package_dir maps a package inside another mapped one: {nested}")
    if tree.exists():
        shutil.rmtree(tree)  # removes the links, never what they point to
    for package, folder in package_dir.items():
        link = tree.joinpath(*package.split("."))
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(REPO / folder, link.parent), target_is_directory=True)


def main() -> None:
    package_dir = runpy.run_path(str(REPO / "setup.py"), run_name="package_layout")["PACKAGE_DIR"]
    tree = Path(sys.prefix) / "namespace"
    write_links(tree, package_dir)
    site_packages = Path(sysconfig.get_paths()["purelib"])
    # A relative line: site.py reads it relative to the .pth file's folder.
    (site_packages / PTH_NAME).write_text(f"{os.path.relpath(tree, site_packages)}\n")
    print(f"import links: {tree} ({len(package_dir)} folders) on sys.path via {PTH_NAME}")


if __name__ == "__main__":
    main()
