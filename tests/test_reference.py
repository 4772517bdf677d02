"""docs/reference.md is what the code renders, and what it renders is true to the code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args

import pytest
from pydantic import BaseModel

from sglang_hicache_ext.sglang_ext.chunk_fusion.request_options import OPTION_KEYS
from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings
from sglang_hicache_ext.sglang_ext.server import reference

PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference.md"


def test_reference_page_is_current() -> None:
    assert PAGE.read_text() == reference.render(), (
        f"docs/reference.md is out of date; regenerate it with `{reference.WRITE_COMMAND}`"
    )


def _table_rows(page: str, heading: str) -> list[list[str]]:
    """The cells of the first table after the line `heading` (backticks stripped), without its
    header and rule."""
    lines = page.split(f"\n{heading}\n", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i, line in enumerate(lines[start:], start) if not line.startswith("|")), None)
    # A row is "| a | b |"; a pipe inside a cell is escaped ("\|"), so " | " only separates.
    return [[cell.strip("`") for cell in line[2:-2].split(" | ")] for line in lines[start:end][2:]]


def _assert_settings_table(page: str, heading: str, model: type[BaseModel]) -> None:
    """Every field is in the table once, in the model's order, with its own JSON default; a
    field that is a model has its own table, under `### field`."""
    rows = _table_rows(page, heading)
    fields = model.model_fields
    assert [row[0] for row in rows] == list(fields), heading
    for name, _, default, _ in rows:
        assert json.loads(default) == fields[name].default, name
        assert type(json.loads(default)) is type(fields[name].default), name
    for name, field in fields.items():
        for nested in get_args(field.annotation) or (field.annotation,):
            if isinstance(nested, type) and issubclass(nested, BaseModel):
                _assert_settings_table(page, f"{heading.split()[0]}# `{name}`", nested)


def test_settings_tables_list_every_setting_in_field_order_with_its_default() -> None:
    _assert_settings_table(PAGE.read_text(), "## Settings", ExtensionSettings)


def test_options_routes_and_metrics_are_all_listed() -> None:
    page = PAGE.read_text()
    options = [row[0] for row in _table_rows(page, "## Per-request options")]
    assert options == list(OPTION_KEYS)
    routes = [row[0] for row in _table_rows(page, "## HTTP routes")]
    expected = [f"{route.method} {route.path}" for route in reference.routes()]
    assert routes == expected
    assert {"POST /chunks", "DELETE /chunks/{chunk_id}", "POST /hicache_ext/placement"} <= set(
        routes
    )
    assert all(route.endpoint.__doc__ for route in reference.routes()), (
        "an endpoint has no docstring"
    )
    series = [row[0] for row in _table_rows(page, "## Metrics")]
    assert series == [s.name for s in reference.metric_series()]
    assert "sglang:hicache_ext_fused_requests_total" in series  # a counter, scraped with _total


def test_route_auth_levels_are_those_registered() -> None:
    auth = {f"{r.method} {r.path}": r.auth for r in reference.routes()}
    assert auth["DELETE /chunks/{chunk_id}"] == "ADMIN_OPTIONAL"
    assert auth["POST /hicache_ext/storage/ttl"] == "ADMIN_OPTIONAL"
    assert auth["GET /chunks"] == "NORMAL"


def test_check_fails_on_a_stale_page_and_write_fixes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "reference.md"
    page.write_text("# stale\n")
    assert reference.main(["--check", "--path", str(page)]) == 1
    assert reference.WRITE_COMMAND in capsys.readouterr().out
    assert reference.main(["--write", "--path", str(page)]) == 0
    assert reference.main(["--check", "--path", str(page)]) == 0
    assert page.read_text() == reference.render()
