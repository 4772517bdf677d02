"""Bounds on what a client can make the extension's routes do: body size, JSON, request rate.

The body is read as a stream with a running byte count, after checking `Content-Length`, so a
100 MB body (declared or sent with chunked transfer encoding) is refused having read at most the
cap; nothing is parsed or tokenized before these checks. The rate is a token bucket per client
host: a burst of up to the per-minute budget, refilled continuously.
"""

from __future__ import annotations

import json
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any


class RequestRefused(Exception):
    """A client request the route answers with `status` and `{"error": message}`."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


async def read_bounded_body(request: Any, max_bytes: int, setting: str) -> bytes:
    """The request body, or 413 as soon as it is known to exceed `max_bytes`."""
    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise RequestRefused(400, "the Content-Length header is not a byte count")
        if int(declared) > max_bytes:
            raise RequestRefused(
                413, f"the body is {int(declared)} bytes; {setting} allows {max_bytes}"
            )
    body = bytearray()
    try:
        async for piece in request.stream():
            body += piece
            if len(body) > max_bytes:
                raise RequestRefused(413, f"the body is over {max_bytes} bytes ({setting})")
    except ClientDisconnect:
        raise RequestRefused(400, "the client disconnected while sending the body") from None
    return bytes(body)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(body: bytes) -> Any:
    """Strict JSON: NaN and Infinity (which Python's json accepts) and undecodable bytes are 400,
    and so is nesting deep enough to exhaust the parser's recursion."""
    if not body.strip():
        raise RequestRefused(400, "the body is empty; send a JSON object")
    try:
        return json.loads(body, parse_constant=_refuse_constant)
    except RecursionError:
        raise RequestRefused(400, "the body is not valid JSON: nested too deeply") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, int digit limits
        raise RequestRefused(400, f"the body is not valid JSON: {str(err)[:200]}") from None


class RateLimiter:
    """Token bucket per client: `per_minute` requests in a burst, refilled at per_minute/60 per
    second. Used from the event loop thread only. `per_minute = 0` means unlimited."""

    # Clients whose bucket has refilled are forgotten beyond this many, so a stream of new hosts
    # cannot grow the table without bound.
    MAX_TRACKED_CLIENTS = 10_000

    def __init__(
        self, per_minute: int, setting: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.per_minute = per_minute
        self._setting = setting
        self._clock = clock
        self._rate = per_minute / 60.0
        # client -> (tokens left, time of the last update), least recently used first
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def acquire(self, client: str) -> None:
        """Take one token for `client`, or raise a 429 with the seconds until the next one."""
        if self.per_minute == 0:
            return
        now = self._clock()
        tokens, updated = self._buckets.pop(client, (float(self.per_minute), now))
        tokens = min(float(self.per_minute), tokens + (now - updated) * self._rate)
        if tokens < 1.0:
            self._buckets[client] = (tokens, now)
            retry_after = max(1, math.ceil((1.0 - tokens) / self._rate))
            raise RequestRefused(
                429,
                f"more than {self.per_minute} chunk registrations per minute from {client} "
                f"({self._setting}); retry in {retry_after} s",
                headers={"Retry-After": str(retry_after)},
            )
        self._buckets[client] = (tokens - 1.0, now)
        if len(self._buckets) > self.MAX_TRACKED_CLIENTS:
            self._forget_idle(now)

    def _forget_idle(self, now: float) -> None:
        full_after_s = 60.0
        for client, (_tokens, updated) in list(self._buckets.items()):
            if now - updated < full_after_s or len(self._buckets) <= self.MAX_TRACKED_CLIENTS:
                break
            del self._buckets[client]
