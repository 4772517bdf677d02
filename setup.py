"""Package layout: every folder of the repository's top installs under one import namespace.

The design keeps its folders at the repository's top (`fusion/`, `radix/`, `tiers/`, `tuning/`,
`evaluation/`, `sglang_ext/`), but installing them as top-level packages would put generic names
such as `radix` and `tuning` into site-packages, where other distributions already use them. So
each folder is mapped to a subpackage of `sglang_hicache_ext` (setuptools' `package_dir`);
`sglang_hicache_ext` itself is a PEP 420 namespace with no folder of its own. Metadata, scripts
and entry points are in pyproject.toml; this file only computes the mapping so that a new
subpackage is picked up without editing a list. `devenv/namespace_links.py` reads `PACKAGE_DIR`
from here (run under another name, so nothing is built) to link the same folders for editors.
"""

from setuptools import find_packages, setup

NAMESPACE = "sglang_hicache_ext"
FOLDERS = ("fusion", "radix", "tiers", "tuning", "evaluation", "sglang_ext")
PACKAGE_DIR = {f"{NAMESPACE}.{folder}": folder for folder in FOLDERS}

if __name__ == "__main__":  # setuptools runs this file as __main__
    packages = [
        f"{NAMESPACE}.{package}"
        for folder in FOLDERS
        for package in find_packages(include=[folder, f"{folder}.*"])
    ]
    setup(packages=packages, package_dir=PACKAGE_DIR)
