"""HTTP routes of the extension, added to SGLang's FastAPI app in the launching process.

`add_routes` declares every route (chunks: `POST /chunks`, `GET /chunks`, `GET` and `DELETE
/chunks/{id}`; the TTL disk tier: `GET /hicache_ext/storage`, `POST /hicache_ext/storage/ttl`;
the chunk placement's, in `placement_routes.py`); each endpoint's docstring says what it takes
and answers, and `docs/reference.md` lists them from there (`server/reference.py`).

Registration runs as a prefill-only generate request (the scheduler captures the KV, see
`sglang_hicache_ext.sglang_ext.chunk_fusion.registry`); list and delete use SGLang's scheduler
control channel (`control_routes.py`).

Auth is SGLang's own (`sglang.srt.utils.auth`): routes that change or drop shared state
(`DELETE /chunks/{id}`, `POST /hicache_ext/storage/ttl`) are ADMIN_OPTIONAL like `/flush_cache`;
the others are NORMAL like `/generate`. `POST /chunks` is bounded before any tokenization
(`sglang_hicache_ext.sglang_ext.server.request_limits`: body bytes, tokens, registrations per minute and client host).
Every refusal is a 4xx with `{"error": message}`.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse

from sglang_hicache_ext.fusion.chunk import chunk_hash
from sglang_hicache_ext.sglang_ext.chunk_fusion.registration import (
    CODEC_PARAM,
    PREFIX_PARAM,
    REGISTER_PARAM,
    prefix_id,
    registering_chunk,
)
from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings
from sglang_hicache_ext.sglang_ext.server import placement_routes
from sglang_hicache_ext.sglang_ext.server.chunk_body import parse_chunk_body
from sglang_hicache_ext.sglang_ext.server.control_routes import (
    ControlError,
    control,
    control_error_response,
    error_response,
    refused_response,
    tokenizer_manager,
)
from sglang_hicache_ext.sglang_ext.server.http_state import http_state
from sglang_hicache_ext.sglang_ext.server.request_limits import (
    RequestRefused,
    parse_json,
    read_bounded_body,
)

# A capture lands when the scheduler checkpoints the request, just before the response goes out.
_CAPTURE_POLL_S = 0.05
_CAPTURE_TIMEOUT_S = 10.0
# The TTL route takes a handful of numbers; anything larger than this is not a TTL request.
_CONTROL_BODY_MAX_BYTES = 64 * 1024
_CHUNK_ID = re.compile(r"[0-9a-f]{64}")


def chunk_token_bound(
    chunk_max_tokens: int, context_len: int, reserved_tokens: int, max_req_input_len: int | None
) -> tuple[int, str]:
    """The most tokens a chunk may have, and what sets that bound. SGLang refuses (or, with
    auto-truncation, cuts) a prompt of context_len tokens or more, and the scheduler one of
    max_req_input_len or more; a cut chunk would no longer match its id."""
    bounds = [
        (chunk_max_tokens, "chunk_max_tokens"),
        (context_len - 1 - reserved_tokens, f"the model's context length {context_len}"),
    ]
    if max_req_input_len:
        bounds.append(
            (max_req_input_len - 1, f"the server's max request input length {max_req_input_len}")
        )
    return min(bounds, key=lambda bound: bound[0])


def _max_chunk_tokens(manager: Any, settings: ExtensionSettings) -> tuple[int, str]:
    return chunk_token_bound(
        settings.chunk_max_tokens,
        int(manager.context_len),
        int(getattr(manager, "num_reserved_tokens", 0) or 0),
        getattr(manager, "max_req_input_len", None),
    )


def _client_host(request: Request) -> str:
    return request.client.host if request.client is not None else "unknown client"


async def register_chunk(request: Request) -> JSONResponse:
    """Register a document chunk: `{"text": ...}` or `{"input_ids": [...]}`, optionally
    `"codec"` (`"int8"`, `"int4"` or null: how every chunk tier stores it; default the setting
    chunk_codec) and `"prefix"` (a text or token ids the chunk is computed after, whose KV is not
    stored with it; default the setting chunk_prefix). Idempotent: the id is the SHA-256 of the
    token ids; 409 when the chunk is stored with another codec or computed after another prefix.
    Answers `{"id", "num_tokens", "nbytes", "codec", "prefix_id", "prefix_tokens", "created", ...}`.
    Bounded before tokenizing (chunk_max_body_bytes, chunk_max_tokens: 413;
    chunk_registrations_per_minute: 429 with Retry-After)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    manager = tokenizer_manager()
    limits = http_state(manager)
    try:
        limits.registrations.acquire(_client_host(request))
        raw = await read_bounded_body(
            request, limits.settings.chunk_max_body_bytes, "chunk_max_body_bytes"
        )
        max_tokens, bound = _max_chunk_tokens(manager, limits.settings)
        body = parse_json(raw)
        ids, codec, prefix = await parse_chunk_body(
            body, manager, limits.settings, max_tokens, bound
        )
    except RequestRefused as err:
        return refused_response(err)
    chunk_id = chunk_hash(ids)
    try:
        known = await limits.chunk_lookups.describe(chunk_id)
        if known is not None:
            refusal = _conflict(known, body, codec, prefix_id(prefix))
            if refusal is not None:
                return error_response(409, refusal)
            return JSONResponse({**known, "created": False})
        params: dict[str, Any] = {REGISTER_PARAM: chunk_id}
        if codec is not None:
            params[CODEC_PARAM] = codec
        if prefix:
            params[PREFIX_PARAM] = len(prefix)
        prefill = GenerateReqInput(
            input_ids=prefix + ids, sampling_params={"max_new_tokens": 0, "custom_params": params}
        )
        # Only this route may send REGISTER_PARAM (checked by fused_prefill.validate_request).
        token = registering_chunk.set(True)
        try:
            async for _ in manager.generate_request(prefill, request):
                pass
        finally:
            registering_chunk.reset(token)
        deadline = asyncio.get_running_loop().time() + _CAPTURE_TIMEOUT_S
        while asyncio.get_running_loop().time() < deadline:
            stored = await limits.chunk_lookups.describe(chunk_id)
            if stored is not None:
                return JSONResponse({**stored, "created": True})
            await asyncio.sleep(_CAPTURE_POLL_S)
    except ControlError as err:
        return control_error_response(err)
    except ValueError as err:  # SGLang rejects the prefill itself (e.g. longer than the context)
        return error_response(400, str(err))
    except HTTPException as err:  # SGLang aborted the prefill with a status of its own
        return error_response(err.status_code, str(err.detail))
    # The capture failed: larger than the chunk store, or the store is full of chunks in use.
    return error_response(
        409, f"chunk {chunk_id[:12]} was prefilled but could not be stored; see the server log"
    )


def _conflict(
    known: dict[str, Any], body: dict[str, Any], codec: str | None, prefix: str
) -> str | None:
    """Why a chunk already stored cannot be registered as asked (None: it can, as it is). A
    chunk is one set of rows: another codec or another prefix needs a DELETE first, never a
    silent second meaning of the same id."""
    chunk_id = known["id"]
    if "codec" in body and known.get("registered_codec") != codec:
        return (
            f"chunk {chunk_id[:12]} is stored with codec {known.get('registered_codec')!r}; "
            f"DELETE /chunks/{chunk_id} first to store it with {codec!r}"
        )
    # A chunk restored from disk has no prefix recorded (null): it is taken as it is.
    stored = known.get("prefix_id")
    if stored is not None and stored != prefix:
        return (
            f"chunk {chunk_id[:12]} was computed after "
            f"{'another prefix' if stored else 'no prefix'} ({known.get('prefix_tokens')} tokens); "
            f"DELETE /chunks/{chunk_id} first to compute it after this one"
        )
    return None


async def list_chunks() -> JSONResponse:
    """The registered chunks and the chunk store's statistics per tier."""
    try:
        return JSONResponse(await control("list_chunks", {}))
    except ControlError as err:
        return control_error_response(err)


def _query_int(request: Request, name: str) -> int | None:
    """An integer query parameter >= 0, None when absent; 400 otherwise (not FastAPI's 422)."""
    value = request.query_params.get(name)
    if value is None:
        return None
    if not value.isascii() or not value.isdigit() or len(value) > 18:
        raise RequestRefused(400, f"{name} must be an integer >= 0, got {value[:40]!r}")
    return int(value)


def _checked_chunk_id(chunk_id: str) -> str:
    if not _CHUNK_ID.fullmatch(chunk_id):
        raise RequestRefused(
            400, f"{chunk_id[:80]!r} is not a chunk id (64 lowercase hex digits, from POST /chunks)"
        )
    return chunk_id


async def describe_chunk(request: Request, chunk_id: str) -> JSONResponse:
    """One chunk (404 when unknown). With `?probe_layer=L&probe_token=T` (diagnostics) it adds
    the stored pre-RoPE key of token T at layer L, to check a capture against another
    implementation."""
    try:
        body: dict[str, Any] = {"id": _checked_chunk_id(chunk_id)}
        probe_layer = _query_int(request, "probe_layer")
        probe_token = _query_int(request, "probe_token")
    except RequestRefused as err:
        return refused_response(err)
    if (probe_layer is None) != (probe_token is None):
        return error_response(400, "give both probe_layer and probe_token, or neither")
    if probe_layer is not None:
        body.update(probe_layer=probe_layer, probe_token=probe_token)
    try:
        chunk = (await control("describe_chunk", body)).get("chunk")
    except ControlError as err:
        return control_error_response(err)
    if chunk is None:
        return error_response(404, f"unknown chunk {chunk_id}")
    return JSONResponse(chunk)


async def delete_chunk(chunk_id: str) -> JSONResponse:
    """Drop a chunk from every tier: 404 when unknown, 409 while a forward pins it. Safe while
    requests use it: a fused request keeps its own copy of the rows after its prefill."""
    try:
        _checked_chunk_id(chunk_id)
    except RequestRefused as err:
        return refused_response(err)
    try:
        deleted = (await control("delete_chunk", {"id": chunk_id})).get("deleted")
    except ControlError as err:
        return control_error_response(err)
    if not deleted:
        return error_response(404, f"unknown chunk {chunk_id}")
    return JSONResponse({"id": chunk_id, "deleted": True})


async def storage_status(request: Request) -> JSONResponse:
    """The TTL disk tier: bytes and pages per group, expiries, hit ratios per tier and group,
    current TTLs and the last plan; with `?pages=N`, the first N pages (soonest expiry first)
    with their group and expiry. 404 when the server runs without the disk tier."""
    try:
        pages = _query_int(request, "pages") or 0
    except RequestRefused as err:
        return refused_response(err)
    try:
        return JSONResponse(await control("storage.status", {"pages": pages}))
    except ControlError as err:
        return control_error_response(err)


async def storage_ttl(request: Request) -> JSONResponse:
    """`{"replan": true}` (plan the group TTLs now from the access window) or
    `{"default_ttl_s": S, "ttls": {group: S}}` (an operator's override until the next plan).
    JSON numbers >= 0 and a real boolean only; unknown keys are a 400."""
    try:
        raw = await read_bounded_body(request, _CONTROL_BODY_MAX_BYTES, "the TTL route's limit")
        body = parse_json(raw)
    except RequestRefused as err:
        return refused_response(err)
    if not isinstance(body, dict):
        return error_response(400, "send a JSON object")
    try:
        return JSONResponse(await control("storage.ttl", body))
    except ControlError as err:
        return control_error_response(err)


def add_routes(app: Any, normal: Any, admin: Any) -> None:
    """Every route of the extension, on `app`; `normal` and `admin` mark an endpoint's auth level.

    The one declaration of the routes: the server registers them through it, and the reference
    page (`server/reference.py`) lists them from it with each endpoint's docstring."""
    app.add_api_route("/chunks", normal(register_chunk), methods=["POST"])
    app.add_api_route("/chunks", normal(list_chunks), methods=["GET"])
    app.add_api_route("/chunks/{chunk_id}", normal(describe_chunk), methods=["GET"])
    app.add_api_route("/chunks/{chunk_id}", admin(delete_chunk), methods=["DELETE"])
    app.add_api_route("/hicache_ext/storage", normal(storage_status), methods=["GET"])
    app.add_api_route("/hicache_ext/storage/ttl", admin(storage_ttl), methods=["POST"])
    placement_routes.add_routes(app, normal, admin)
    app.add_api_route("/hicache_ext/shadow_checks", normal(shadow_checks_status), methods=["GET"])


async def shadow_checks_status() -> JSONResponse:
    """The shadow checks of fused answers in this server's HTTP process: the rate, checks
    waiting for spare capacity, counts (queued, checked, dropped by reason, failed, skipped
    because sampled) and the latest results (request id, token agreement, first token agreed,
    ratio and what chose it). The rolling window and the target's ratios are in /server_info
    (internal_states[i].hicache_ext.fusion.shadow)."""
    return JSONResponse(http_state(tokenizer_manager()).shadow_checks.status())


def register_routes() -> None:
    # SGLang's API-key middleware, added after plugins register routes, reads `_auth_level` off
    # each endpoint function: state-changing routes are ADMIN_OPTIONAL like /flush_cache.
    from sglang.srt.entrypoints.http_server import app
    from sglang.srt.utils.auth import AuthLevel, auth_level

    if any(getattr(route, "path", None) == "/chunks" for route in app.routes):
        return
    add_routes(app, auth_level(AuthLevel.NORMAL), auth_level(AuthLevel.ADMIN_OPTIONAL))
