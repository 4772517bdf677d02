"""What every extension route that drives the scheduler shares (launching process).

The routes (`http_routes.py`, `placement_routes.py`) run in the process that serves HTTP; what
they ask of the scheduler (list, describe and delete chunks, the TTL disk tier, a placement
round) goes over SGLang's scheduler control channel as a `hicache_ext.*` method, answered by
the scheduler's tree cache (`chunk_fusion/registry.py`). Every refusal is a 4xx with
`{"error": message}`.
"""

from __future__ import annotations

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
