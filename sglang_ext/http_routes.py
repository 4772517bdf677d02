"""HTTP routes of the extension, added to SGLang's FastAPI app in the launching process.

- `POST /chunks` `{"text": ...}` or `{"input_ids": [...]}`: register a document chunk (idempotent:
  the id is the content hash of its token ids); returns `{"id", "num_tokens", "nbytes", "created"}`.
- `GET /chunks`: the registered chunks and the chunk-store statistics.
- `GET /chunks/{id}[?probe_layer=L&probe_token=T]`: one chunk; the probe (diagnostics) adds the
  stored pre-RoPE key of token T at layer L, to check a capture against another implementation.
- `DELETE /chunks/{id}`: drop a chunk (404 unknown, 409 while a running request uses it).
- `GET /hicache_ext/storage[?pages=N]`: the disk tier (`sglang_ext.storage_backend`): bytes and
  pages per group, expiries, hit ratios per tier and group, current TTLs and the last plan; with
  `pages`, the first N pages (soonest expiry first) with their group and expiry.
- `POST /hicache_ext/storage/ttl` `{"replan": true}` (plan now from the window) or
  `{"default_ttl_s": S, "ttls": {group: S}}` (operator override until the next plan).

Registration runs as a prefill-only generate request (the scheduler captures the KV, see
`sglang_ext.chunks`); list and delete use SGLang's scheduler control channel.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from sglang_ext.chunks import CONTROL_PREFIX, REGISTER_PARAM
from sglang_ext.fusion.chunk import chunk_hash

# A capture lands when the scheduler checkpoints the request, just before the response goes out.
_CAPTURE_POLL_S = 0.05
_CAPTURE_TIMEOUT_S = 10.0


class ControlError(Exception):
    """The scheduler refused a control request; the message is the scheduler's."""


def _tokenizer_manager() -> Any:
    from sglang.srt.entrypoints import http_server

    return http_server._global_state.tokenizer_manager


async def _control(method: str, body: dict[str, Any]) -> dict[str, Any]:
    from sglang.srt.managers.io_struct import DumperControlReqInput

    results = await _tokenizer_manager().dumper_control(
        DumperControlReqInput(method=CONTROL_PREFIX + method, body=body)
    )
    errors = [r.error for r in results if not r.success]
    if errors:
        raise ControlError("; ".join(errors))
    responses = [item for result in results for item in result.response]
    return responses[0] if responses else {}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": message})


def _token_ids(body: Any, tokenizer: Any, vocab_size: int) -> list[int]:
    if not isinstance(body, dict) or ("text" in body) == ("input_ids" in body):
        raise ValueError('send a JSON object with exactly one of "text" or "input_ids"')
    if "text" in body:
        text = body["text"]
        if not isinstance(text, str) or not text.strip():
            raise ValueError('"text" must be a non-empty string')
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = body["input_ids"]
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise ValueError('"input_ids" must be a list of integers')
    if not ids:
        raise ValueError("the chunk has no tokens")
    if any(not 0 <= t < vocab_size for t in ids):
        raise ValueError(f"token ids must be in [0, {vocab_size})")
    return [int(t) for t in ids]


async def register_chunk(request: Request) -> JSONResponse:
    from sglang.srt.managers.io_struct import GenerateReqInput

    manager = _tokenizer_manager()
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "the body is not valid JSON")
    try:
        ids = _token_ids(body, manager.tokenizer, manager.model_config.vocab_size)
    except ValueError as err:
        return _error(400, str(err))
    chunk_id = chunk_hash(ids)
    try:
        known = (await _control("describe_chunk", {"id": chunk_id})).get("chunk")
        if known is not None:
            return JSONResponse({**known, "created": False})
        prefill = GenerateReqInput(
            input_ids=ids,
            sampling_params={"max_new_tokens": 0, "custom_params": {REGISTER_PARAM: chunk_id}},
        )
        async for _ in manager.generate_request(prefill, request):
            pass
        deadline = asyncio.get_running_loop().time() + _CAPTURE_TIMEOUT_S
        while asyncio.get_running_loop().time() < deadline:
            stored = (await _control("describe_chunk", {"id": chunk_id})).get("chunk")
            if stored is not None:
                return JSONResponse({**stored, "created": True})
            await asyncio.sleep(_CAPTURE_POLL_S)
    except ControlError as err:
        return _error(503, str(err))
    except ValueError as err:  # SGLang rejects the prefill itself (e.g. longer than the context)
        return _error(400, str(err))
    return _error(507, f"chunk {chunk_id[:12]} was prefilled but not stored; see the server log")


async def list_chunks() -> JSONResponse:
    try:
        return JSONResponse(await _control("list_chunks", {}))
    except ControlError as err:
        return _error(503, str(err))


async def describe_chunk(
    chunk_id: str, probe_layer: int | None = None, probe_token: int | None = None
) -> JSONResponse:
    body: dict[str, Any] = {"id": chunk_id}
    if (probe_layer is None) != (probe_token is None):
        return _error(400, "give both probe_layer and probe_token, or neither")
    if probe_layer is not None:
        body.update(probe_layer=probe_layer, probe_token=probe_token)
    try:
        chunk = (await _control("describe_chunk", body)).get("chunk")
    except ControlError as err:
        status = 400 if "probe" in str(err) else 503
        return _error(status, str(err))
    if chunk is None:
        return _error(404, f"unknown chunk {chunk_id}")
    return JSONResponse(chunk)


async def delete_chunk(chunk_id: str) -> JSONResponse:
    try:
        deleted = (await _control("delete_chunk", {"id": chunk_id})).get("deleted")
    except ControlError as err:
        status = 409 if "in use" in str(err) else 503
        return _error(status, str(err))
    if not deleted:
        return _error(404, f"unknown chunk {chunk_id}")
    return JSONResponse({"id": chunk_id, "deleted": True})


async def storage_status(pages: int = 0) -> JSONResponse:
    if pages < 0:
        return _error(400, "pages must be >= 0")
    try:
        return JSONResponse(await _control("storage.status", {"pages": pages}))
    except ControlError as err:
        return _error(503, str(err))


async def storage_ttl(request: Request) -> JSONResponse:
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "the body is not valid JSON")
    if not isinstance(body, dict):
        return _error(400, "send a JSON object")
    try:
        return JSONResponse(await _control("storage.ttl", body))
    except ControlError as err:
        status = 503 if "not in use" in str(err) else 400
        return _error(status, str(err))


def register_routes() -> None:
    from sglang.srt.entrypoints.http_server import app

    if any(getattr(route, "path", None) == "/chunks" for route in app.routes):
        return
    app.add_api_route("/chunks", register_chunk, methods=["POST"])
    app.add_api_route("/chunks", list_chunks, methods=["GET"])
    app.add_api_route("/chunks/{chunk_id}", describe_chunk, methods=["GET"])
    app.add_api_route("/chunks/{chunk_id}", delete_chunk, methods=["DELETE"])
    app.add_api_route("/hicache_ext/storage", storage_status, methods=["GET"])
    app.add_api_route("/hicache_ext/storage/ttl", storage_ttl, methods=["POST"])
