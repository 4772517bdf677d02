"""Auth of the extension routes is SGLang's own, per key setup.

For each key setup ({no keys, --api-key, --admin-api-key, both}) a tiny Qwen2 server runs (no
keys: the session's `tiny_qwen2_server`; the three with keys start together) and every extension
route is called with no key, the API key and the admin key.
The outcome (allowed, or refused with 401/403) must be what SGLang's `decide_request_auth`
decides for the route's level, and the same as the live reference route of that level:
`/flush_cache` for the routes that change or drop shared state, `/generate` for the others.
Allowed requests may still be 4xx for payload reasons (an unknown chunk is a 404).

The internal registration key is refused on every generate path (`/generate`,
`/v1/completions`, `/v1/chat/completions`), whatever the key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from sglang.srt.utils.auth import AuthLevel, decide_request_auth

from sglang_hicache_ext.sglang_ext.chunk_fusion.registration import REGISTER_PARAM
from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig, running_servers
from tests.conftest import tiny_qwen2_config

pytestmark = pytest.mark.server

API_KEY = "api-key-K"
ADMIN_KEY = "admin-key-A"
UNKNOWN_CHUNK = "0" * 64


@dataclasses.dataclass(frozen=True)
class Route:
    method: str
    path: str
    level: AuthLevel
    body: dict[str, Any] | None = None
    reference: bool = False  # one of SGLang's own routes


ROUTES = (
    Route(
        "POST",
        "/generate",
        AuthLevel.NORMAL,
        {"text": "Hi", "sampling_params": {"max_new_tokens": 1}},
        reference=True,
    ),
    Route("POST", "/flush_cache", AuthLevel.ADMIN_OPTIONAL, reference=True),
    Route("POST", "/chunks", AuthLevel.NORMAL, {"input_ids": [5, 6, 7, 8]}),
    Route("GET", "/chunks", AuthLevel.NORMAL),
    Route("GET", f"/chunks/{UNKNOWN_CHUNK}", AuthLevel.NORMAL),
    Route("DELETE", f"/chunks/{UNKNOWN_CHUNK}", AuthLevel.ADMIN_OPTIONAL),
    Route("GET", "/hicache_ext/storage", AuthLevel.NORMAL),
    Route("POST", "/hicache_ext/storage/ttl", AuthLevel.ADMIN_OPTIONAL, {"replan": True}),
)
REFERENCE = {route.level: route for route in ROUTES if route.reference}
CREDENTIALS = {"no key": None, "API key": API_KEY, "admin key": ADMIN_KEY}


@dataclasses.dataclass(frozen=True)
class KeySetup:
    api_key: str | None
    admin_api_key: str | None

    @property
    def args(self) -> tuple[str, ...]:
        args: tuple[str, ...] = ()
        if self.api_key:
            args += ("--api-key", self.api_key)
        if self.admin_api_key:
            args += ("--admin-api-key", self.admin_api_key)
        return args


KEY_SETUPS = {
    "no-keys": KeySetup(None, None),
    "api-key": KeySetup(API_KEY, None),
    "admin-key": KeySetup(None, ADMIN_KEY),
    "both-keys": KeySetup(API_KEY, ADMIN_KEY),
}


@pytest.fixture(scope="module")
def keyed_servers(
    request: pytest.FixtureRequest,
    tiny_qwen2_server: ServerConfig,
    tiny_qwen2_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, ServerConfig]]:
    """A server per key setup, all `tiny_qwen2_config` (tests/conftest.py): no keys is the
    session's `tiny_qwen2_server`; the selected setups with keys add them and start together
    (their starts overlap)."""
    selected = {
        item.callspec.params["keyed_server"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    }
    keyed = {
        name: dataclasses.replace(tiny_qwen2_config(tiny_qwen2_path), extra_args=setup.args)
        for name, setup in KEY_SETUPS.items()
        if setup.args and name in selected
    }
    workdir = tmp_path_factory.mktemp("auth")
    logs = [workdir / f"{name}.log" for name in keyed]
    with running_servers(list(zip(keyed.values(), logs, strict=True))) as started:
        yield {"no-keys": tiny_qwen2_server, **dict(zip(keyed, started, strict=True))}


@pytest.fixture(params=list(KEY_SETUPS), ids=list(KEY_SETUPS))
def keyed_server(
    request: pytest.FixtureRequest, keyed_servers: dict[str, ServerConfig]
) -> tuple[ServerConfig, KeySetup]:
    return keyed_servers[request.param], KEY_SETUPS[request.param]


def _call(url: str, route: Route, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = requests.request(
        route.method, url + route.path, json=route.body, headers=headers, timeout=120
    )
    assert response.status_code < 500, (route, response.status_code, response.text[:300])
    return response.status_code


def test_auth_matrix_matches_sglang(keyed_server: tuple[ServerConfig, KeySetup]) -> None:
    config, setup = keyed_server
    mismatches = []
    for route in ROUTES:
        for credential, key in CREDENTIALS.items():
            decision = decide_request_auth(
                method=route.method,
                path=route.path,
                authorization_header=f"Bearer {key}" if key else None,
                api_key=setup.api_key,
                admin_api_key=setup.admin_api_key,
                auth_level=route.level,
            )
            status = _call(config.url, route, key)
            reference = _call(config.url, REFERENCE[route.level], key)
            allowed = status not in (401, 403)
            expected_status_ok = allowed or status == decision.error_status_code
            reference_agrees = allowed == (reference not in (401, 403))
            if allowed != decision.allowed or not reference_agrees or not expected_status_ok:
                mismatches.append((route.method, route.path, credential, status, reference))
    cells = len(ROUTES) * len(CREDENTIALS)
    print(f"\nauth matrix, {setup}: {cells} cells, {len(mismatches)} differ from SGLang")
    assert not mismatches, mismatches


def _chunk_ids(url: str, key: str | None) -> set[str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    listing = requests.get(url + "/chunks", headers=headers, timeout=30).json()
    return {chunk["id"] for chunk in listing["chunks"]}


def test_registration_key_is_refused_on_every_generate_path(
    keyed_server: tuple[ServerConfig, KeySetup],
) -> None:
    config, setup = keyed_server
    key = setup.api_key  # what /generate needs; the admin key must not help either
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    sneaky = {REGISTER_PARAM: "1" * 64}
    before = _chunk_ids(config.url, key)
    calls = {
        "/generate": {
            "input_ids": [5, 6, 7, 8, 9],
            "sampling_params": {"max_new_tokens": 0, "custom_params": sneaky},
        },
        "/v1/completions": {"model": "default", "prompt": "Hi", "max_tokens": 1},
        "/v1/chat/completions": {
            "model": "default",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 1,
        },
    }
    for path, body in calls.items():
        if path != "/generate":  # the same request without the key succeeds
            ok = requests.post(config.url + path, json=body, headers=headers, timeout=120)
            assert ok.status_code == 200, (path, ok.text[:300])
            body = {**body, "custom_params": sneaky}
        refused = requests.post(config.url + path, json=body, headers=headers, timeout=120)
        assert refused.status_code == 400, (path, refused.status_code, refused.text[:300])
        assert "internal" in refused.text and "POST /chunks" in refused.text, refused.text
    if setup.admin_api_key and not setup.api_key:
        admin = {"Authorization": f"Bearer {setup.admin_api_key}"}
        refused = requests.post(
            config.url + "/generate", json=calls["/generate"], headers=admin, timeout=120
        )
        assert refused.status_code == 400
    assert _chunk_ids(config.url, key) == before
