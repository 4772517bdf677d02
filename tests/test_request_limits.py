"""Bounded and strictly typed client input: body reader, JSON, rate limiter, fusion options,
the TTL request and the internal registration key."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import Request

from sglang_hicache_ext.sglang_ext.chunk_fusion.registration import (
    REGISTER_PARAM,
    registering_chunk,
)
from sglang_hicache_ext.sglang_ext.chunk_fusion.request_options import parse_options
from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings
from sglang_hicache_ext.sglang_ext.scheduler_control import _apply_ttl_request
from sglang_hicache_ext.sglang_ext.server.generate_hooks import validate_request
from sglang_hicache_ext.sglang_ext.server.request_limits import (
    RateLimiter,
    RequestRefused,
    parse_json,
    read_bounded_body,
)

DEFAULTS = ExtensionSettings()


def _request(pieces: list[bytes], headers: dict[str, str]) -> tuple[Request, list[int]]:
    """A Starlette request whose body arrives in `pieces`; the list counts pieces received."""
    received = [0]
    queue: Iterator[bytes] = iter(pieces)

    async def receive() -> dict[str, Any]:
        piece = next(queue, None)
        if piece is None:
            return {"type": "http.request", "body": b"", "more_body": False}
        received[0] += 1
        return {"type": "http.request", "body": piece, "more_body": True}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/chunks",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    return Request(scope, receive), received


def test_declared_length_over_the_cap_is_413_without_reading() -> None:
    request, received = _request([b"x" * 1000] * 100, {"content-length": str(100 * 1000)})
    with pytest.raises(RequestRefused) as refused:
        asyncio.run(read_bounded_body(request, 4096, "chunk_max_body_bytes"))
    assert refused.value.status == 413 and "chunk_max_body_bytes" in refused.value.message
    assert received[0] == 0


def test_streamed_body_without_length_stops_at_the_cap() -> None:
    request, received = _request([b"x" * 1000] * 100, {"transfer-encoding": "chunked"})
    with pytest.raises(RequestRefused) as refused:
        asyncio.run(read_bounded_body(request, 4096, "chunk_max_body_bytes"))
    assert refused.value.status == 413
    assert received[0] == 5  # the piece that crossed 4096 bytes, and nothing after it


def test_body_within_the_cap_is_read_whole() -> None:
    request, _ = _request([b'{"a":', b" 1}"], {})
    assert asyncio.run(read_bounded_body(request, 4096, "cap")) == b'{"a": 1}'
    bad_length, _ = _request([], {"content-length": "-5"})
    with pytest.raises(RequestRefused, match="Content-Length"):
        asyncio.run(read_bounded_body(bad_length, 4096, "cap"))


@pytest.mark.parametrize(
    "body",
    [b"", b"  ", b"{", b'{"a": NaN}', b"[Infinity]", b"-Infinity", b"\xff\xfe{", b"[" * 100_000],
    ids=["empty", "blank", "truncated", "nan", "infinity", "neg-infinity", "bad-utf8", "deep"],
)
def test_strict_json_refuses(body: bytes) -> None:
    with pytest.raises(RequestRefused) as refused:
        parse_json(body)
    assert refused.value.status == 400


def test_strict_json_accepts_plain_json() -> None:
    assert parse_json(b'{"text": "caf\\u00e9", "n": [1, 2.5]}') == {"text": "café", "n": [1, 2.5]}


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_rate_limiter_burst_refill_and_retry_after() -> None:
    clock = _Clock()
    limiter = RateLimiter(6, "chunk_registrations_per_minute", clock=clock)  # one per 10 s
    for _ in range(6):
        limiter.acquire("10.0.0.1")
    with pytest.raises(RequestRefused) as refused:
        limiter.acquire("10.0.0.1")
    assert refused.value.status == 429
    assert refused.value.headers["Retry-After"] == "10"
    assert "chunk_registrations_per_minute" in refused.value.message
    limiter.acquire("10.0.0.2")  # per client host
    clock.now += 10.0
    limiter.acquire("10.0.0.1")
    with pytest.raises(RequestRefused):
        limiter.acquire("10.0.0.1")


def test_rate_limiter_zero_is_unlimited_and_table_is_bounded() -> None:
    clock = _Clock()
    unlimited = RateLimiter(0, "x", clock=clock)
    for _ in range(1000):
        unlimited.acquire("a")
    limiter = RateLimiter(10, "x", clock=clock)
    limiter.MAX_TRACKED_CLIENTS = 100
    for i in range(100):
        limiter.acquire(f"old-{i}")
    clock.now += 61.0  # every old bucket has refilled: forgetting it changes nothing
    for i in range(50):
        limiter.acquire(f"new-{i}")
    assert len(limiter._buckets) <= 101


@pytest.mark.parametrize(
    "params",
    [
        {"fusion_selector": ["a3"]},
        {"fusion_selector": {"a3": 1}},
        {"fusion_selector": None},
        {"fusion_selector": 3},
        {"fusion": "true"},
        {"fusion": None},
        {"fusion_recompute_ratio": [0.1]},
        {"fusion_recompute_ratio": math.nan},
        {"fusion_recompute_ratio": math.inf},
        {"fusion_recompute_ratio": 10**400},
        {"fusion_sink_tokens": "4"},
        {"fusion_sink_tokens": {"n": 4}},
        [],
        "fusion",
    ],
)
def test_option_types_are_checked_first(params: object) -> None:
    with pytest.raises(ValueError) as err:
        parse_options(params, DEFAULTS)
    assert len(str(err.value)) < 300


def _manager() -> SimpleNamespace:
    return SimpleNamespace(server_args=SimpleNamespace(hicache_storage_backend_extra_config=None))


def test_registration_key_is_refused_outside_the_route() -> None:
    sneaky = SimpleNamespace(sampling_params={"custom_params": {REGISTER_PARAM: "0" * 64}})
    with pytest.raises(ValueError, match="POST /chunks"):
        validate_request(_manager(), sneaky)
    batch = SimpleNamespace(sampling_params=[{}, {"custom_params": {REGISTER_PARAM: "x"}}])
    with pytest.raises(ValueError, match="internal"):
        validate_request(_manager(), batch)
    token = registering_chunk.set(True)
    try:
        validate_request(_manager(), sneaky)  # the route's own prefill
    finally:
        registering_chunk.reset(token)
    validate_request(_manager(), SimpleNamespace(sampling_params={"custom_params": {"x": 1}}))


class _Online:
    def __init__(self) -> None:
        self.tables: list[Any] = []
        self.policy = SimpleNamespace(update=self.tables.append)

    def replan(self) -> None:
        return None

    def status(self) -> dict[str, Any]:
        return {"tables": len(self.tables)}


@pytest.mark.parametrize(
    "body",
    [
        {"default_ttl_s": "5"},
        {"default_ttl_s": True},
        {"default_ttl_s": None},
        {"default_ttl_s": -1},
        {"default_ttl_s": math.inf},
        {"default_ttl_s": math.nan},
        {"default_ttl_s": [5]},
        {"default_ttl_s": 5, "ttls": {"g0": "5"}},
        {"default_ttl_s": 5, "ttls": {"g0": False}},
        {"default_ttl_s": 5, "ttls": [5]},
        {"default_ttl_s": 5, "ttls": None},
        {"default_ttl_s": 5, "ttl": {}},
        {"replan": "yes"},
        {"replan": 1},
        {"replan": True, "default_ttl_s": 5},
        {},
    ],
)
def test_ttl_request_takes_only_real_numbers_and_booleans(body: dict[str, Any]) -> None:
    disk_tier = SimpleNamespace(online=_Online())
    with pytest.raises(ValueError):
        _apply_ttl_request(disk_tier, body)
    assert disk_tier.online.tables == []


def test_ttl_request_good_forms() -> None:
    disk_tier = SimpleNamespace(online=_Online())
    assert _apply_ttl_request(disk_tier, {"replan": True}) == {
        "replanned": False,
        "ttl": {"tables": 0},
    }
    _apply_ttl_request(disk_tier, {"default_ttl_s": 5, "ttls": {"g0": 0.5}})
    _apply_ttl_request(disk_tier, {"replan": False, "default_ttl_s": 0})
    assert [t.as_dict() for t in disk_tier.online.tables] == [
        {"default": 5.0, "g0": 0.5},
        {"default": 0.0},
    ]


def test_chunk_token_bound_is_the_tightest_and_named() -> None:
    from sglang_hicache_ext.sglang_ext.server.http_routes import chunk_token_bound

    assert chunk_token_bound(32768, 4096, 0, None) == (4095, "the model's context length 4096")
    assert chunk_token_bound(32768, 4096, 0, 2043)[0] == 2042
    assert "max request input length" in chunk_token_bound(32768, 4096, 0, 2043)[1]
    assert chunk_token_bound(512, 4096, 0, 2043) == (512, "chunk_max_tokens")
    assert chunk_token_bound(32768, 4096, 3, None)[0] == 4092
