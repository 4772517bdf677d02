"""What a chunk placement probe request carries, and who may send one.

The placement round (`server/placement_round.py`) asks each question it profiles through a
probe request: an ordinary fused generate request whose `custom_params` name the host form its
chunks are read in. The scheduler then reads each chunk's registered rows passed through that
form's codec, whatever host memory holds at the time (`placement_control.py`), so the answers
can be compared with those of the registered rows.
"""

from __future__ import annotations

import contextvars
from typing import Any

from sglang_hicache_ext.tuning.placement.host_forms import CODEC_ORDER

PROBE_FORM_PARAM = "hicache_ext_probe_form"  # internal: set by the placement's profiler only
# Set by the placement round around its probe requests; a client sending PROBE_FORM_PARAM is
# refused (a probe reads the disk and decodes whole chunks: not a client's knob).
probing_placement: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "hicache_ext_probing_placement", default=False
)


def check_probe_params(custom_params: Any) -> None:
    """ValueError (HTTP 400) for a probe key a client sent, or a form no chunk can take."""
    if not isinstance(custom_params, dict) or PROBE_FORM_PARAM not in custom_params:
        return
    if not probing_placement.get():
        raise ValueError(f"custom_params.{PROBE_FORM_PARAM} is internal to the chunk placement")
    if custom_params[PROBE_FORM_PARAM] not in CODEC_ORDER:
        raise ValueError(f"custom_params.{PROBE_FORM_PARAM} must be one of {CODEC_ORDER}")


def probe_form_of(req: Any) -> str | None:
    """The form a probe request reads its chunks in (checked when it came in), else None."""
    params = getattr(req.sampling_params, "custom_params", None) or {}
    form = params.get(PROBE_FORM_PARAM)
    return form if isinstance(form, str) else None
