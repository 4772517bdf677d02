"""Figures quoted in the docs, rendered from the result files they cite.

A figure in README.md or docs/*.md that comes from a benchmark's JSON is written between two
comments that name its source, invisible once the Markdown is rendered:

    median TTFT <!-- fig auto_reuse.json fused.median_ttft_ratio .2f -->0.44<!-- /fig -->x

The opening comment names the file (relative to `benchmarks/results/`, or `research/results/...`
for a study's), the value's path in it
and a Python format spec (`.3f`, `.0%`, `,d`; none: `str()`), which a factor may precede to
change the unit (`*1000:.0f`: seconds quoted in ms). A path is dot-separated keys and list
indices; `["a3@0.15"]` is a key that holds dots or spaces; `[key=value]` picks the one element of a list
of objects whose `key` is `value` (`methods[name=a3].f1`, `runs.0.ttft_s`,
`ratios["0.15"].ttft_s`).

    python -m benchmarks.doc_figures          # rewrite every marked figure from its file
    python -m benchmarks.doc_figures --check  # exit 1 listing each figure that differs

`benchmarks/tests/test_doc_figures.py` runs the check, so a figure cannot drift from its JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MARKER = re.compile(
    r'<!-- fig (?P<file>\S+) (?P<path>(?:[^\s"]|"[^"]*")+)(?: (?P<spec>\S+))? -->'
    r"(?P<text>.*?)<!-- /fig -->"
)
_STEP = re.compile(
    r'(?P<key>[^.\[\]"]+)|\["(?P<quoted>[^"]*)"\]|\[(?P<field>[^=\]"]+)=(?P<value>[^\]]*)\]'
)


class FigureError(ValueError):
    """A marker whose file, path or format cannot give a figure."""


@dataclass(frozen=True)
class Figure:
    """One marked figure: where it stands, what it says, and what its source renders to."""

    doc: Path
    line: int
    file: str
    path: str
    spec: str
    text: str

    @property
    def rendered(self) -> str:
        return render(lookup(self.file, self.path), self.spec)

    def describe(self) -> str:
        where = f"{self.doc.relative_to(REPO)}:{self.line}"
        return f"{where}: {self.text!r} but {self.file} {self.path} is {self.rendered!r}"


def docs(root: Path = REPO) -> list[Path]:
    """The pages whose figures are checked: README.md and every page of docs/."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


@cache
def _load(file: str) -> Any:
    # A study's results (`research/results/...`) are named from the repository's root.
    path = REPO / file if file.startswith("research/") else RESULTS / file
    if not path.is_file():
        raise FigureError(f"no result file {file} in benchmarks/results/")
    return json.loads(path.read_text())


def lookup(file: str, path: str) -> Any:
    """The value at `path` in the result file `file`."""
    value = _load(file)
    position = 0
    for step in _STEP.finditer(path):
        if step.start() != position:
            raise FigureError(f"{file}: bad path {path!r} at {path[position:]!r}")
        position = step.end() + (1 if path[step.end() : step.end() + 1] == "." else 0)
        try:
            if step["key"] is not None:
                key = step["key"]
                value = value[int(key)] if isinstance(value, list) else value[key]
            elif step["quoted"] is not None:
                value = value[step["quoted"]]
            else:
                found = [v for v in value if str(v.get(step["field"])) == step["value"]]
                if len(found) != 1:
                    raise FigureError(f"{file}: {path!r} picks {len(found)} elements, not one")
                value = found[0]
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:
            raise FigureError(f"{file}: {path!r} not found ({err!r})") from err
    if position != len(path):
        raise FigureError(f"{file}: bad path {path!r}")
    return value


def render(value: Any, spec: str | None) -> str:
    """`value` as the docs quote it: `spec` is a format spec, optionally `*FACTOR:` first."""
    if not spec:
        return str(value)
    if spec.startswith("*"):
        factor, _, spec = spec[1:].partition(":")
        try:
            value = value * float(factor)
        except (TypeError, ValueError) as err:
            raise FigureError(f"cannot scale {value!r} by {factor!r}: {err}") from err
    try:
        return format(value, spec)
    except (TypeError, ValueError) as err:
        raise FigureError(f"cannot format {value!r} with {spec!r}: {err}") from err


def figures(doc: Path) -> Iterator[Figure]:
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        for match in MARKER.finditer(line):
            yield Figure(
                doc, number, match["file"], match["path"], match["spec"] or "", match["text"]
            )


def stale(pages: list[Path]) -> list[str]:
    """Each marked figure whose text is not what its source renders to (or cannot render)."""
    problems = []
    for doc in pages:
        for figure in figures(doc):
            try:
                if figure.text != figure.rendered:
                    problems.append(figure.describe())
            except FigureError as err:
                problems.append(f"{doc.relative_to(REPO)}:{figure.line}: {err}")
    return problems


def rewrite(doc: Path) -> int:
    """Render every marked figure of `doc` from its source; how many changed."""
    changed = 0

    def one(match: re.Match[str]) -> str:
        nonlocal changed
        text = render(lookup(match["file"], match["path"]), match["spec"])
        changed += text != match["text"]
        spec = f" {match['spec']}" if match["spec"] else ""
        return f"<!-- fig {match['file']} {match['path']}{spec} -->{text}<!-- /fig -->"

    original = doc.read_text()
    updated = MARKER.sub(one, original)
    if updated != original:
        doc.write_text(updated)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report, do not rewrite")
    args = parser.parse_args(argv)
    pages = docs()
    if args.check:
        problems = stale(pages)
        for problem in problems:
            print(problem, file=sys.stderr)
        count = sum(1 for doc in pages for _ in figures(doc))
        print(f"{count} marked figures, {len(problems)} differ from their result files")
        return 1 if problems else 0
    changed = sum(rewrite(doc) for doc in pages)
    print(f"{changed} figures rewritten from benchmarks/results/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
