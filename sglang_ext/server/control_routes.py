"""What every extension route that drives the scheduler shares (launching process).

The routes (`http_routes.py`, `placement_routes.py`) run in the process that serves HTTP; what
they ask of the scheduler (list, describe and delete chunks, the TTL disk tier, a placement
round) goes over SGLang's scheduler control channel as a `hicache_ext.*` method, answered by
the scheduler's tree cache (`chunk_fusion/registry.py`). Every refusal is a 4xx with
`{"error": message}`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi.responses import JSONResponse

from sglang_hicache_ext.sglang_ext.chunk_fusion.registry import CONTROL_PREFIX
from sglang_hicache_ext.sglang_ext.server.request_limits import RequestRefused


class ControlError(Exception):
    """The scheduler refused a control request; the message is the scheduler's."""


def tokenizer_manager() -> Any:
    """SGLang's tokenizer manager of this server (its requests and control channel)."""
    from sglang.srt.entrypoints import http_server

    return http_server._global_state.tokenizer_manager


async def control(method: str, body: dict[str, Any]) -> dict[str, Any]:
    """The scheduler's answer to the control method `hicache_ext.<method>`; ControlError when
    it refuses."""
    from sglang.srt.managers.io_struct import DumperControlReqInput

    results = await tokenizer_manager().dumper_control(
        DumperControlReqInput(method=CONTROL_PREFIX + method, body=body)
    )
    errors = [r.error for r in results if not r.success]
    if errors:
        raise ControlError("; ".join(errors))
    responses = [item for result in results for item in result.response]
    return responses[0] if responses else {}


class ChunkLookups:
    """Chunk descriptions for routes that run at once, in as few control calls as possible.

    SGLang's control channel serves one call at a time and the scheduler answers it between
    forward passes, so registrations posted together, each asking first whether its chunk is
    stored, would reach the scheduler one per forward pass and be prefilled one by one (24
    paragraphs on CPU: 24 batches of one). Here the ids asked for while a call is in flight go
    out together in the next call (`hicache_ext.describe_chunks`), so their prefills are queued
    together and batched. `describe` answers what `describe_chunk` would: a listing entry or
    None; ControlError when the scheduler refuses.
    """

    def __init__(self) -> None:
        self._waiting: dict[str, asyncio.Future[dict[str, Any] | None]] = {}
        self._sender: asyncio.Task[None] | None = None

    async def describe(self, chunk_id: str) -> dict[str, Any] | None:
        future = self._waiting.get(chunk_id)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._waiting[chunk_id] = future
            if self._sender is None or self._sender.done():
                self._sender = asyncio.create_task(self._send())
        # Shielded: a caller that goes away (its client disconnected) must not cancel the
        # answer that other callers of the same id are waiting for.
        return await asyncio.shield(future)

    async def _send(self) -> None:
        while self._waiting:
            asked, self._waiting = self._waiting, {}
            try:
                found = (await control("describe_chunks", {"ids": list(asked)}))["chunks"]
            except Exception as err:  # ControlError, or the channel failed: every caller sees it
                for future in asked.values():
                    if not future.done():
                        future.set_exception(err)
                continue
            for chunk_id, future in asked.items():
                if not future.done():
                    future.set_result(found.get(chunk_id))


def error_response(
    status: int, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": message}, headers=headers)


def refused_response(err: RequestRefused) -> JSONResponse:
    return error_response(err.status, err.message, err.headers)


def control_error_response(err: ControlError) -> JSONResponse:
    """The status of a scheduler's refusal, from its message."""
    message = str(err)
    if "unavailable" in message or "not in use" in message:
        return error_response(404, message)  # the feature is not configured on this server
    if "in use" in message:
        return error_response(409, message)
    return error_response(400, message)
