"""The chunk placement's HTTP routes and its timer (launching process).

`POST /hicache_ext/placement` runs a round now and `GET /hicache_ext/placement` reports them
(each endpoint's docstring says more; `docs/reference.md` lists them).

With `chunk_placement_interval_s` a daemon thread posts to the first route every interval, as
an operator would (with the admin key when the server has one), so that a periodic round and
an asked one are the same code path and cannot run at once.
"""

from __future__ import annotations

import json
import logging
import math
import ssl
import threading
import time
import urllib.error
import urllib.request
from typing import Any, NamedTuple

from fastapi import Request
from fastapi.responses import JSONResponse

from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings
from sglang_hicache_ext.sglang_ext.server import control_routes
from sglang_hicache_ext.sglang_ext.server.http_state import http_state
from sglang_hicache_ext.sglang_ext.server.placement_round import (
    PROFILE_CHUNKS_PER_ROUND,
    RoundRunning,
)
from sglang_hicache_ext.sglang_ext.server.request_limits import (
    RequestRefused,
    parse_json,
    read_bounded_body,
)

logger = logging.getLogger(__name__)

_BODY_MAX_BYTES = 4096
_MAX_PROFILED = 100_000


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key, default)
    try:  # a JSON integer too large for a float overflows
        finite = (
            not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
        )
    except OverflowError:
        finite = False
    if not finite:
        raise RequestRefused(400, f'"{key}" must be a finite number, got {str(value)[:40]!r}')
    if not low <= value <= high:
        bound = f">= {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"
        raise RequestRefused(400, f'"{key}" must be {bound}, got {value}')
    return float(value)


class RoundParameters(NamedTuple):
    alpha: float
    quality_floor: float
    profile_chunks: int  # how many chunks this round may profile


def placement_parameters(body: Any, settings: ExtensionSettings) -> RoundParameters:
    """One round's parameters: the body's, else the settings' (and the default probe load)."""
    if not isinstance(body, dict):
        raise RequestRefused(400, "send a JSON object")
    unknown = sorted(set(body) - set(RoundParameters._fields))
    if unknown:
        raise RequestRefused(400, f"unknown key(s) {', '.join(map(repr, unknown))[:200]}")
    alpha = _number(body, "alpha", settings.chunk_placement_alpha, 0.0, math.inf)
    floor = _number(body, "quality_floor", settings.chunk_placement_quality_floor, 0.0, 1.0)
    limit = body.get("profile_chunks", PROFILE_CHUNKS_PER_ROUND)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit <= _MAX_PROFILED:
        raise RequestRefused(
            400,
            f'"profile_chunks" must be an integer in [0, {_MAX_PROFILED}], got {str(limit)[:40]!r}',
        )
    return RoundParameters(alpha, floor, limit)


async def run_placement(request: Request) -> JSONResponse:
    """Run a chunk placement round now (`placement_round.py`) and answer its plan per chunk
    (reads, qualities, form before and after). Body `{}` or `{"alpha": A, "quality_floor": Q,
    "profile_chunks": N}`: alpha (>= 0, seconds of TTFT one unit of answer quality is worth) and
    the floor (in [0, 1]) override the settings for this round; N bounds how many chunks it
    profiles (default 8: never profiled first, then the most read). 400 on bad values or unknown
    keys, 404 without a chunk disk tier (chunk_disk_dir), 409 while a round runs."""
    manager = control_routes.tokenizer_manager()
    state = http_state(manager)
    settings = state.settings
    try:
        raw = await read_bounded_body(request, _BODY_MAX_BYTES, "the placement route's limit")
        parameters = placement_parameters(parse_json(raw) if raw.strip() else {}, settings)
    except RequestRefused as err:
        return control_routes.refused_response(err)
    try:
        return JSONResponse(
            await state.placement_rounds.run(manager, control_routes.control, *parameters)
        )
    except RoundRunning as err:
        return control_routes.error_response(409, str(err))
    except control_routes.ControlError as err:
        return control_routes.control_error_response(err)


async def placement_status() -> JSONResponse:
    """Rounds so far, profiled chunks, probe fallbacks and the last round's result."""
    return JSONResponse(http_state(control_routes.tokenizer_manager()).placement_rounds.status())


def add_routes(app: Any, normal: Any, admin: Any) -> None:
    app.add_api_route("/hicache_ext/placement", admin(run_placement), methods=["POST"])
    app.add_api_route("/hicache_ext/placement", normal(placement_status), methods=["GET"])


def start_timer(server_args: Any, interval_s: float) -> threading.Thread:
    """Post a placement round to this server every `interval_s` seconds (daemon thread)."""
    url = server_args.url() + "/hicache_ext/placement"  # SGLang's own: scheme, loopback, IPv6
    key = server_args.admin_api_key or server_args.api_key
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]  # no proxy
    if url.startswith("https"):  # this server's own certificate, on its own address
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        handlers.append(urllib.request.HTTPSHandler(context=context))
    opener = urllib.request.build_opener(*handlers)

    def tick() -> None:
        while True:
            time.sleep(interval_s)
            request = urllib.request.Request(url, b"{}", headers, method="POST")
            try:
                with opener.open(request, timeout=max(600.0, interval_s)) as reply:
                    result = json.loads(reply.read())
                logger.debug("periodic chunk placement: %s", result.get("outcomes"))
            except (urllib.error.URLError, OSError, ValueError) as err:  # server not up yet, busy
                logger.warning("periodic chunk placement round failed: %s", err)

    thread = threading.Thread(target=tick, name="chunk-placement-timer", daemon=True)
    thread.start()
    logger.info("chunk placement every %.0f s (%s)", interval_s, url)
    return thread
