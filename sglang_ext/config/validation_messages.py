"""Pydantic validation errors in the one line an operator (launch) or a client (a 400) reads.

Shared by the settings model (`settings.py`) and the per-request fusion options
(`chunk_fusion/request_options.py`): a bad value names the key, the value given and what is allowed,
with the numeric bounds read off the field itself so the words never drift from the check.
"""

from __future__ import annotations

from typing import Annotated, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from sglang_hicache_ext.sglang_ext.config.setting_types import RATIO_CHOICES


def one_line(err: ValidationError, model: type[BaseModel]) -> str:
    """The first problem of a ValidationError of `model`, as the one line an operator reads."""
    errors = err.errors()
    unknown = [str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        known = model.model_fields
        return (
            f"unknown setting(s) {', '.join(map(repr, sorted(unknown)))}; "
            f"known settings: {', '.join(known)}"
        )
    return _describe(errors[0], model)


def _describe(error: ErrorDetails, model: type[BaseModel]) -> str:
    if not error["loc"]:  # a check across settings (a model validator)
        return str(error["ctx"]["error"]) if "ctx" in error else error["msg"]
    name = str(error["loc"][0])
    field = model.model_fields[name]
    if name == "fusion_recompute_ratio":  # a union: one error per member, its tag in the loc
        return f"{name} = {error['input']!r} {RATIO_CHOICES}"
    # An item of a list or dict setting is named by its index or key: static_ttls['a'].
    given = f"{name}{''.join(f'[{part!r}]' for part in error['loc'][1:])} = {error['input']!r}"
    kind = error["type"]
    if kind == "literal_error":
        if len(error["loc"]) > 1:  # an item of a list setting: pydantic names the choices
            return f"{name}: {error['input']!r} is unknown; choose from {error['ctx']['expected']}"
        allowed = ", ".join(map(repr, get_args(field.annotation)))
        return f"{given} is not allowed; choose one of {allowed}"
    if kind.endswith("_type"):
        # A plain class names itself; an optional, constrained or item type by pydantic's kind.
        expected = kind.removesuffix("_type").replace("string", "str")
        if len(error["loc"]) == 1 and isinstance(field.annotation, type):
            expected = field.annotation.__name__
        return f"{given} should be of type {expected}"
    if kind == "value_error":
        return f"{given} {error['ctx']['error']}"
    if kind == "finite_number":
        return f"{given} must be a finite number"
    bound = bound_phrase(field) or _member_bounds(field)
    if bound:
        extra = field.json_schema_extra
        zero = extra.get("zero_means") if isinstance(extra, dict) else None
        return f"{given} must be {bound}" + (f" (0 = {zero})" if zero else "")
    return f"{given}: {error['msg']}"


def bound_phrase(field: FieldInfo) -> str:
    """A field's numeric bounds in words: "positive", ">= 0", "in [0, 1]" ("" when unbounded)."""
    symbols = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    # Field(gt=..., ...) becomes one annotated_types object per bound in `metadata`.
    bounds = {
        name: getattr(item, name)
        for item in field.metadata
        for name in symbols
        if hasattr(item, name)
    }
    if "ge" in bounds and "le" in bounds:
        return f"in [{bounds['ge']}, {bounds['le']}]"
    if bounds.get("gt") == 0 and len(bounds) == 1:
        return "positive"
    return " and ".join(f"{symbols[name]} {value}" for name, value in bounds.items())


def _member_bounds(field: FieldInfo) -> str:
    """The bounds of an optional constrained type (`Share | None`), which pydantic keeps on the
    union's Annotated member rather than on the field."""
    for member in get_args(field.annotation):
        if get_origin(member) is Annotated:
            phrase = bound_phrase(FieldInfo.from_annotation(member))
            if phrase:
                return phrase
    return ""
