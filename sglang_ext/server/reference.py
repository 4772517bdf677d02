"""The reference page (`docs/reference.md`), rendered from the code that defines each thing.

Settings from the `ExtensionSettings` model (field order, types, bounds, defaults,
descriptions), per-request options from `FusionOptions` and the settings that are their server
defaults, HTTP routes from `http_routes.add_routes` (the same call that registers them on the
server, here on a recorder) with each endpoint's docstring, and metrics from the Prometheus
series the metric classes create (on a private registry). Nothing here is written by hand but
the section introductions, so the page cannot drift from the code; `tests/test_reference.py`
fails when the committed page differs from `render()`.

    python -m sglang_hicache_ext.sglang_ext.server.reference           # print the page
    python -m sglang_hicache_ext.sglang_ext.server.reference --write   # update docs/reference.md
    python -m sglang_hicache_ext.sglang_ext.server.reference --check   # exit 1 when stale
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from sglang_hicache_ext.sglang_ext.chunk_fusion import request_options
from sglang_hicache_ext.sglang_ext.config import settings, settings_sources
from sglang_hicache_ext.sglang_ext.config.validation_messages import bound_phrase
from sglang_hicache_ext.sglang_ext.metrics import http_process_metrics, prometheus_metrics
from sglang_hicache_ext.sglang_ext.server import http_routes

MODULE = "sglang_hicache_ext.sglang_ext.server.reference"
PAGE = Path("docs") / "reference.md"
WRITE_COMMAND = f"python -m {MODULE} --write"
_TAG_OPEN = re.compile(r"<(?=[A-Za-z/!?])")


# -- values and types in words ----------------------------------------------------------------


def _bounds(field: FieldInfo) -> str:
    phrase = bound_phrase(field)
    return "> 0" if phrase == "positive" else phrase  # "int > 0" reads better than "int positive"


def _type_text(annotation: Any) -> str:
    """A type as a reader writes its values in JSON or TOML: `int >= 0`, `"auto"` or a float."""
    if annotation is type(None):
        return "null"
    origin = get_origin(annotation)
    if origin is Annotated:  # bounds declared with the type (`Annotated[int, Field(ge=0)]`)
        inner, *metadata = get_args(annotation)
        bounds = [_bounds(item) for item in metadata if isinstance(item, FieldInfo)]
        return " ".join(filter(None, (_type_text(inner), *bounds)))
    if origin is Literal:
        return " or ".join(f"`{json.dumps(value)}`" for value in get_args(annotation))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_text(member) for member in get_args(annotation))
    if origin is list:
        return f"list of ({_type_text(get_args(annotation)[0])})"
    if origin is dict:
        key, value = get_args(annotation)
        return f"object of {_type_text(key)} → {_type_text(value)}"
    if _is_model(annotation):
        return "object (its own table below)"
    return getattr(annotation, "__name__", str(annotation))


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _values(field: FieldInfo) -> tuple[list[Any], bool]:
    """The field's value types other than null, and whether null is allowed."""
    annotation = field.annotation
    is_union = get_origin(annotation) in (Union, types.UnionType)
    members = list(get_args(annotation)) if is_union else [annotation]
    values = [member for member in members if member is not type(None)]
    return values, len(values) < len(members)


def _field_type(field: FieldInfo) -> str:
    """The field's type with the bounds of its `Field(...)`, which bind its non-null values."""
    values, nullable = _values(field)
    text = " or ".join(_type_text(value) for value in values)
    text = " ".join(filter(None, (text, _bounds(field))))
    extra = field.json_schema_extra
    zero = extra.get("zero_means") if isinstance(extra, dict) else None
    return text + (f" (0 = {zero})" if zero else "") + (" or null" if nullable else "")


def _default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.get_default(call_default_factory=True)
    return f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    """Text fit for one cell of a Markdown table: one line, pipes escaped, and a `<` that opens
    a tag escaped outside code spans (`<model>` would be read as HTML and vanish)."""
    spans = " ".join(text.split()).replace("|", "\\|").split("`")
    escaped = (span if i % 2 else _TAG_OPEN.sub("&lt;", span) for i, span in enumerate(spans))
    return "`".join(escaped)


def _table(header: Sequence[str], rows: Iterator[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(_cell(cell) for cell in row) + " |" for row in rows]
    return lines


# -- settings and per-request options ----------------------------------------------------------


def _settings_rows(model: type[BaseModel]) -> Iterator[tuple[str, str, str, str]]:
    for name, field in model.model_fields.items():
        yield f"`{name}`", _field_type(field), _default(field), field.description or ""


def _settings_tables(model: type[BaseModel], heading: str = "###") -> list[str]:
    """The model's table, then a table per field that is a model itself (its docstring first)."""
    lines = _table(("setting", "type", "default", "description"), _settings_rows(model))
    for name, field in model.model_fields.items():
        for nested in filter(_is_model, _values(field)[0]):
            doc = inspect.getdoc(nested) or ""
            lines += ["", f"{heading} `{name}`", "", " ".join(doc.split()), ""]
            lines += _settings_tables(nested, heading + "#")
    return lines


def _option_rows() -> Iterator[tuple[str, str, str, str]]:
    for field in request_options.FusionOptions.model_fields.values():
        key = field.alias or ""
        setting = request_options.SERVER_DEFAULTS.get(key)
        default = f"setting `{setting}`" if setting else _default(field)
        yield f"`{key}`", _field_type(field), default, field.description or ""


# -- routes ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Route:
    method: str
    path: str
    auth: str  # SGLang's auth level of the endpoint
    endpoint: Callable[..., Any]


class _RouteRecorder:
    """Stands in for SGLang's FastAPI app and auth decorators: records what `add_routes` adds."""

    def __init__(self) -> None:
        self.routes: list[Route] = []

    @staticmethod
    def level(auth: str) -> Callable[[Callable[..., Any]], tuple[str, Callable[..., Any]]]:
        return lambda endpoint: (auth, endpoint)

    def add_api_route(self, path: str, marked: Any, methods: Sequence[str]) -> None:
        auth, endpoint = marked
        self.routes += [Route(method, path, auth, endpoint) for method in methods]


def routes() -> list[Route]:
    """Every route the server registers, in the order it registers them."""
    recorder = _RouteRecorder()
    http_routes.add_routes(recorder, recorder.level("NORMAL"), recorder.level("ADMIN_OPTIONAL"))
    return recorder.routes


def _route_rows() -> Iterator[tuple[str, str, str]]:
    for route in routes():
        doc = inspect.getdoc(route.endpoint) or ""
        yield f"`{route.method} {route.path}`", f"`{route.auth}`", doc


# -- metrics -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Series:
    name: str
    kind: str
    labels: tuple[str, ...]
    help: str


def metric_series() -> list[Series]:
    """Every series of the extension, as the metric classes create them (private registry)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics import MetricWrapperBase

    registry = CollectorRegistry()
    owners = (
        prometheus_metrics.ExtensionMetrics({"model_name": "", "tp_rank": ""}, registry),
        http_process_metrics.FusedTtftMetrics({"model_name": ""}, registry),
        http_process_metrics.ShadowCheckMetrics({"model_name": ""}, registry),
    )
    series = []
    for owner in owners:
        for metric in vars(owner).values():
            if not isinstance(metric, MetricWrapperBase):
                continue
            family = next(iter(metric.describe()))
            # A counter's family drops `_total`; its one sample, the name scraped, has it.
            name = family.name + ("_total" if family.type == "counter" else "")
            # prometheus-client has no public accessor for a wrapper's label names.
            series.append(
                Series(name, family.type, tuple(metric._labelnames), family.documentation)
            )
    return series


def _metric_rows() -> Iterator[tuple[str, str, str, str]]:
    for series in metric_series():
        labels = ", ".join(f"`{label}`" for label in series.labels)
        yield f"`{series.name}`", series.kind, labels, series.help


# -- the page ----------------------------------------------------------------------------------


def render() -> str:
    """The whole reference page."""
    lines = [
        "# Reference",
        "",
        f"<!-- Generated from the code by `{WRITE_COMMAND}`; do not edit by hand. -->",
        "",
        "Settings, per-request options, HTTP routes and Prometheus series of the extension, "
        "rendered from the code that defines them (`sglang_ext/server/reference.py`). "
        "`tests/test_reference.py` fails when this page is out of date.",
        "",
        "## Settings",
        "",
        "One JSON or TOML file, named by the environment variable "
        f'`{settings_sources.CONFIG_ENV_VAR}` or by the key `"{settings_sources.EXTRA_CONFIG_KEY}"` of SGLang\'s '
        "`--hicache-storage-backend-extra-config` (a path, or the settings inline as an object; "
        "naming both is refused). Unknown keys and bad values stop the launch with one line "
        "naming the key and what is allowed. Model: `ExtensionSettings` "
        "(`sglang_ext/config/settings.py`), in its field order.",
        "",
        *_settings_tables(settings.ExtensionSettings),
        "",
        "## Per-request options",
        "",
        "Flat keys of `custom_params`: `sampling_params.custom_params` of `/generate`, or "
        "`custom_params` in the body of `/v1/chat/completions` and `/v1/completions` "
        '(`extra_body={"custom_params": {...}}` with the `openai` package). A key left out '
        "takes the value of the setting named; a bad value is a 400. The response's "
        f"`meta_info.{request_options.META_KEY}` reports what each fused request did. Model: "
        "`FusionOptions` (`sglang_ext/chunk_fusion/request_options.py`).",
        "",
        *_table(("key", "type", "default", "description"), _option_rows()),
        "",
        "## HTTP routes",
        "",
        "Auth is SGLang's own (`--api-key`, `--admin-api-key`): `NORMAL` routes need the API "
        "key when one is set, like `/generate`; `ADMIN_OPTIONAL` routes change shared state and "
        "need the admin key when one is set, else the API key when set, like `/flush_cache`. "
        'Every refusal is a 4xx with `{"error": message}`. Declared by `add_routes` '
        "(`sglang_ext/server/http_routes.py`); the descriptions are the endpoints' docstrings.",
        "",
        *_table(("route", "auth", "description"), _route_rows()),
        "",
        "## Metrics",
        "",
        "With SGLang's `--enable-metrics`, SGLang's `GET /metrics` also carries these series "
        "(`sglang_ext/metrics/prometheus_metrics.py`), plus SGLang's `--extra-metric-labels`. "
        "They are counted in the scheduler process, except the fused TTFT histogram, observed "
        "in the HTTP process beside SGLang's own TTFT, and the shadow checks' series, counted "
        "where the checks run (`sglang_ext/metrics/http_process_metrics.py`). Gauges are per scheduler process "
        "(`tp_rank`), merged `mostrecent` as SGLang's are; what the disk tier's modules count "
        "themselves is exported every `purge_interval_s` "
        "(`sglang_ext/disk_tier/metrics_export.py`).",
        "",
        *_table(("series", "type", "labels", "help"), _metric_rows()),
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Render the reference page from the code.")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help="write the page")
    action.add_argument("--check", action="store_true", help="exit 1 when the page is stale")
    parser.add_argument("--path", type=Path, default=PAGE, help=f"the page (default {PAGE})")
    args = parser.parse_args(argv)
    page = render()
    if args.write:
        args.path.write_text(page)
        print(f"wrote {args.path}")
    elif args.check:
        current = args.path.read_text() if args.path.is_file() else ""
        if current != page:
            print(f"{args.path} is out of date; regenerate it with `{WRITE_COMMAND}`")
            return 1
        print(f"{args.path} is current")
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
