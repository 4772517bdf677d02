"""Every marked figure of README.md and docs/*.md is what its result file renders to
(`benchmarks/doc_figures.py`): a figure cannot drift from the JSON it cites."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import doc_figures
from benchmarks.doc_figures import FigureError, lookup, render, rewrite, stale


def test_every_marked_figure_is_its_result_files() -> None:
    pages = doc_figures.docs()
    assert sum(1 for page in pages for _ in doc_figures.figures(page)) > 0
    assert stale(pages) == []


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "run.json").write_text(
        json.dumps(
            {
                "ttft": {"ratio": 0.43912, "a3@0.15": {"seconds": 1.7357}, "all rows": 2},
                "methods": [{"name": "a3", "f1": 0.9451}],
            }
        )
    )
    monkeypatch.setattr(doc_figures, "RESULTS", folder)
    monkeypatch.setattr(doc_figures, "REPO", tmp_path)
    doc_figures._load.cache_clear()
    yield folder
    doc_figures._load.cache_clear()


def test_a_changed_figure_fails_and_the_generator_restores_it(results: Path) -> None:
    page = results.parent / "page.md"
    good = (
        "TTFT <!-- fig run.json ttft.ratio .3f -->0.439<!-- /fig -->x, "
        "F1 <!-- fig run.json methods[name=a3].f1 .3f -->0.945<!-- /fig -->, "
        '<!-- fig run.json ttft["all rows"] -->2<!-- /fig --> rows\n'
    )
    page.write_text(good)
    assert stale([page]) == []
    page.write_text(good.replace("0.945", "0.95"))  # rounded by hand: the drift the test stops
    (problem,) = stale([page])
    assert "'0.95' but run.json methods[name=a3].f1 is '0.945'" in problem
    assert rewrite(page) == 1 and page.read_text() == good


def test_paths_and_formats() -> None:
    assert render(0.43912, ".2f") == "0.44" and render(0.97, ".0%") == "97%"
    assert render(12, None) == "12" and render(1.7357, "*1000:.0f") == "1736"


def test_a_marker_that_names_nothing_is_an_error(results: Path) -> None:
    assert lookup("run.json", "methods.0.name") == "a3"
    assert lookup("run.json", 'ttft["a3@0.15"].seconds') == 1.7357
    for file, path in [
        ("missing.json", "a"),
        ("run.json", "ttft.none"),
        ("run.json", "methods[name=b].f1"),
    ]:
        with pytest.raises(FigureError):
            lookup(file, path)
