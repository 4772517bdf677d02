"""Fuzz table over every extension route and every fusion option: only 2xx/4xx, never 5xx.

One tiny-llama server with chunks and the disk tier (`GroupTTLDiskStorage`), so the storage
routes are live. Each case is sent verbatim with `http.client` (no URL normalisation, raw JSON
tokens such as NaN and Infinity, any content type). Our routes' refusals must carry
`{"error": message}`; after the table the server still generates and lists chunks.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from sglang_hicache_ext.sglang_ext.chunk_fusion.registration import REGISTER_PARAM
from sglang_hicache_ext.sglang_ext.chunk_fusion.request_options import OPTION_KEYS
from sglang_hicache_ext.sglang_ext.config.settings_sources import EXTRA_CONFIG_KEY
from sglang_hicache_ext.sglang_ext.disk_tier.storage_backend import disk_tier_extra_config
from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig, generate, running_server
from sglang_hicache_ext.sglang_ext.server.ports import free_port

pytestmark = pytest.mark.server

DOCUMENT = "The lighthouse keeper logged every passing ship in a blue notebook."
JSON = "application/json"


@dataclasses.dataclass(frozen=True)
class Case:
    method: str
    path: str
    body: bytes | None = None
    content_type: str | None = JSON
    ours: bool = True  # one of our routes: a refusal must be {"error": message}
    expect: str | None = "4xx"  # "2xx", "4xx", or None where either is right


@pytest.fixture(scope="module")
def fuzz_server(
    tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerConfig]:
    workdir = tmp_path_factory.mktemp("fuzz")
    extra = {
        **disk_tier_extra_config(str(workdir / "disk")),
        "capacity_bytes": 2e8,
        "ttl_groups": 2,
        "ttl_period_s": 3600,
        "purge_interval_s": 0.5,
        # The table sends ~60 registrations at once; the limit has its own test.
        EXTRA_CONFIG_KEY: {"chunk_registrations_per_minute": 0},
    }
    config = ServerConfig(
        model_path=str(tiny_llama_path),
        port=free_port(),
        max_total_tokens=2048,
        hierarchical_cache=True,
        hicache_storage_backend="dynamic",
        extra_args=("--hicache-storage-backend-extra-config", json.dumps(extra)),
    )
    with running_server(config, log_path=workdir / "server.log") as running:
        yield running


HUGE_INT = "1" + "0" * 30
# Raw JSON value texts (NaN and Infinity are tokens Python's json accepts, strict JSON does not).
WRONG_VALUES = (
    "[]",
    '["a3"]',
    "{}",
    '{"a": 1}',
    "null",
    "true",
    "false",
    '"5"',
    '"0.5"',
    HUGE_INT,
    "1" + "0" * 5000,  # beyond Python's int-from-string digit limit
    "NaN",
    "Infinity",
    "-Infinity",
    "-1",
    "1e400",
    '"\\u00fc\\ud800 \\u0000"',
)


def _chunk_bodies() -> list[tuple[bytes, str]]:
    refused = [
        "",
        " ",
        "null",
        "true",
        "1",
        '"text"',
        "[]",
        "{}",
        '[{"text": "a"}]',
        "{",
        '{"text": "a"',
        "not json",
        '{"text": "a", "input_ids": [1]}',
        '{"input_ids": [5, 6], "extra": 1}',
        '{"input_ids": []}',
        '{"input_ids": [[1]]}',
        '{"input_ids": [1.5]}',
        '{"input_ids": [-1]}',
        '{"input_ids": [100000000]}',
        '{"text": "   "}',
        '{"text": "\\ud800"}',
        "[" * 50_000,
    ]
    refused += [f'{{"text": {value}}}' for value in WRONG_VALUES if value not in ('"5"', '"0.5"')]
    refused += [f'{{"input_ids": {value}}}' for value in WRONG_VALUES]
    refused += [f'{{"input_ids": [5, {value}]}}' for value in WRONG_VALUES[4:]]
    accepted = [
        '{"text": "Gr\\u00fc\\u00dfe aus K\\u00f6ln, \\u65e5\\u672c\\u8a9e \\ud83c\\udf89"}',
        '{"text": "' + "x" * 1000 + '"}',
        '{"text": "5"}',
    ]
    return (
        [(t.encode(), "4xx") for t in refused]
        + [(t.encode(), "2xx") for t in accepted]
        + [(b"\xff\xfe\x00{", "4xx"), (b"\x00" * 100, "4xx"), (b'{"text": "\\u0000"}', None)]
    )


def _ttl_bodies() -> list[tuple[bytes, str]]:
    texts = ["", "null", "[]", "{}", '"replan"', "{", '{"ttl": 5}', '{"replan": true, "x": 1}']
    numbers = [value for value in WRONG_VALUES if value != HUGE_INT]  # a huge TTL is a TTL
    texts += [f'{{"default_ttl_s": {value}}}' for value in numbers]
    texts += [f'{{"default_ttl_s": 60, "ttls": {{"g0": {value}}}}}' for value in numbers]
    texts += [f'{{"replan": {value}}}' for value in WRONG_VALUES if value not in ("true", "false")]
    texts += ['{"default_ttl_s": 60, "ttls": []}', '{"replan": false}']
    accepted = [
        '{"default_ttl_s": 600, "ttls": {"shared-prefix": 900}}',
        f'{{"default_ttl_s": {HUGE_INT}, "ttls": {{"g0": {HUGE_INT}}}}}',
        '{"replan": true}',
    ]
    return [(t.encode(), "4xx") for t in texts] + [(t.encode(), "2xx") for t in accepted]


def _generate_bodies() -> list[tuple[bytes, str | None]]:
    bodies: list[tuple[str, str | None]] = []

    def request(custom: str) -> str:
        return (
            '{"text": "Hi", "sampling_params": {"max_new_tokens": 1, '
            f'"custom_params": {custom}}}}}'
        )

    for key in [*OPTION_KEYS, REGISTER_PARAM]:
        for value in (*WRONG_VALUES, '"a3"', "0.5", "4"):
            # Some of these are right for some keys (true for fusion, 4 for sink tokens, ...);
            # the registration key is refused whatever its value.
            expect = "4xx" if key == REGISTER_PARAM else None
            bodies.append((request(f'{{"{key}": {value}}}'), expect))
    bodies += [(request(custom), "4xx") for custom in ("[]", '"fusion"', "1")]
    bodies += [
        (request("null"), "2xx"),
        (request('{"fusion": true, "fusion_selector": "a3"}'), "2xx"),
    ]
    bodies += [
        (request('{"fusion_selector": ["a3"]}'), "4xx"),
        (request('{"fusion_selector": {}}'), "4xx"),
    ]
    return [(text.encode(), expect) for text, expect in bodies]


BAD_IDS = [
    "abc",
    "%2e%2e%2f%2e%2e%2fetc%2fpasswd",
    "..%2f..%2fetc%2fpasswd",
    "%2e%2e",
    "..",
    "A" * 64,
    "0" * 63,
    "0" * 65,
    "g" * 64,
    "x" * 10_000,
    "%C3%BC" * 20,
    "%00",
    "%20",
    "0" * 64,  # well formed, unknown: 404
]


def _cases(chunk_id: str) -> list[Case]:
    cases = [Case("POST", "/chunks", body, expect=expect) for body, expect in _chunk_bodies()]
    good = json.dumps({"text": DOCUMENT}).encode()
    cases += [
        Case("POST", "/chunks", good, content_type=kind, expect="2xx")
        for kind in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data")
    ]
    cases += [Case("GET", "/chunks", expect="2xx"), Case("GET", "/chunks?x=1", expect="2xx")]
    cases += [Case(m, "/chunks", ours=False) for m in ("PUT", "PATCH")]
    probes = [
        "probe_layer=-1&probe_token=0",
        "probe_layer=abc&probe_token=0",
        "probe_layer=1.5&probe_token=0",
        "probe_layer=99999999999999999999999&probe_token=0",
        "probe_layer=0",
        "probe_token=0",
        "probe_layer=&probe_token=",
        "probe_layer=1e3&probe_token=0",
        "probe_layer=%EF%BC%91&probe_token=0",  # a full-width digit
        "probe_layer=99&probe_token=0",  # out of range
    ]
    cases += [Case("GET", f"/chunks/{chunk_id}?{query}") for query in probes]
    cases.append(Case("GET", f"/chunks/{chunk_id}?probe_layer=0&probe_token=0", expect="2xx"))
    cases += [Case("GET", f"/chunks/{bad}") for bad in BAD_IDS]
    cases += [Case("GET", f"/chunks/{BAD_IDS[-1]}?{query}") for query in probes[:4]]
    cases += [Case("DELETE", f"/chunks/{bad}") for bad in BAD_IDS]
    pages = ["-1", "abc", "1.5", "", "99999999999999999999999", "1e3", "%201", "%EF%BC%91"]
    cases += [Case("GET", f"/hicache_ext/storage?pages={value}") for value in pages]
    cases += [Case("GET", f"/hicache_ext/storage?pages={n}", expect="2xx") for n in (0, 10)]
    ttl = "/hicache_ext/storage/ttl"
    cases += [Case("POST", ttl, body, expect=expect) for body, expect in _ttl_bodies()]
    cases += [
        Case("POST", ttl, b'{"replan": true}', content_type=kind, expect="2xx")
        for kind in (None, "text/plain")
    ]
    cases += [
        Case("POST", "/generate", body, ours=False, expect=expect)
        for body, expect in _generate_bodies()
    ]
    cases.append(Case("DELETE", f"/chunks/{chunk_id}", expect="2xx"))  # last
    return cases


def _send(config: ServerConfig, case: Case) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection(config.host, config.port, timeout=120)
    headers = {} if case.content_type is None else {"Content-Type": case.content_type}
    try:
        connection.request(case.method, case.path, body=case.body, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _clear_refusal(status: int, body: bytes) -> bool:
    """`{"error": message}`; FastAPI's own 404/405 for paths no route matches say "detail"."""
    try:
        payload = json.loads(body)
    except ValueError:
        return False
    if not isinstance(payload, dict):
        return False
    message = payload.get("error")
    if isinstance(message, str) and 0 < len(message) < 1000:
        return True
    return status in (404, 405) and "detail" in payload


def test_fuzz_table_gets_no_5xx_and_the_server_keeps_serving(fuzz_server: ServerConfig) -> None:
    registered = requests.post(fuzz_server.url + "/chunks", json={"text": DOCUMENT}, timeout=120)
    assert registered.status_code == 200, registered.text
    cases = _cases(registered.json()["id"])
    assert len(cases) >= 100
    server_errors, unclear, unexpected, by_class = [], [], [], {"2xx": 0, "4xx": 0}
    for case in cases:
        status, body = _send(fuzz_server, case)
        seen = (case.method, case.path[:80], (case.body or b"")[:80], status, body[:120])
        if status >= 500 or status < 200 or 300 <= status < 400:
            server_errors.append(seen)
            continue
        outcome = "2xx" if status < 300 else "4xx"
        by_class[outcome] += 1
        if case.expect is not None and outcome != case.expect:
            unexpected.append(seen)
        if case.ours and status >= 400 and not _clear_refusal(status, body):
            unclear.append(seen)
    print(f"\nfuzz: {len(cases)} cases, {by_class}, 5xx: {len(server_errors)}")
    assert not server_errors, server_errors
    assert not unclear, unclear
    assert not unexpected, unexpected
    # Still serving.
    assert (
        generate(fuzz_server.url, "Hello", max_new_tokens=2)["meta_info"]["completion_tokens"] == 2
    )
    listing = requests.get(fuzz_server.url + "/chunks", timeout=30)
    assert listing.status_code == 200 and "chunks" in listing.json()
    assert requests.get(fuzz_server.url + "/hicache_ext/storage", timeout=30).status_code == 200
