"""Bounded `POST /chunks` on a real server: body bytes, tokens and registrations per minute.

The acceptance bar of issue 11: a 100 MB `POST /chunks` is refused in under 1 s with the
server's resident memory (summed over its process group) growing by less than 50 MB, whether
the body declares its length or comes with chunked transfer encoding.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from sglang_hicache_ext.sglang_ext.config.settings_sources import EXTRA_CONFIG_KEY
from sglang_hicache_ext.sglang_ext.server.launcher import (
    ServerConfig,
    generate,
    group_rss_bytes,
    running_server,
    server_process_group,
)
from sglang_hicache_ext.sglang_ext.server.ports import free_port

pytestmark = pytest.mark.server

HUNDRED_MB = 100 * 1024**2
MAX_TOKENS = 256
PER_MINUTE = 8
MAX_RSS_GROWTH = 50 * 1024**2


@pytest.fixture(scope="module")
def limited_server(
    tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerConfig]:
    settings = {"chunk_max_tokens": MAX_TOKENS, "chunk_registrations_per_minute": PER_MINUTE}
    config = ServerConfig(
        model_path=str(tiny_llama_path),
        port=free_port(),
        max_total_tokens=2048,
        extra_args=(
            "--hicache-storage-backend-extra-config",
            json.dumps({EXTRA_CONFIG_KEY: settings}),
        ),
    )
    log = tmp_path_factory.mktemp("limits") / "server.log"
    with running_server(config, log_path=log) as running:
        yield running


def _body_pieces(total: int, piece: int = 1024**2) -> Iterator[bytes]:
    """`{"text": "aaa...a"}` of `total` bytes, in pieces (never held whole in memory)."""
    head, tail = b'{"text": "', b'"}'
    yield head
    left = total - len(head) - len(tail)
    filler = b"a" * piece
    while left > 0:
        yield filler[: min(piece, left)]
        left -= piece
    yield tail


def _post_huge(config: ServerConfig, chunked: bool) -> tuple[int, dict[str, str], bytes, float]:
    """POST a 100 MB body on a raw socket while reading the answer; the sender stops when the
    server closes. Returns status, headers, body and the seconds until the full answer."""
    sock = socket.create_connection((config.host, config.port), timeout=30)
    framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % HUNDRED_MB
    head = b"POST /chunks HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n%s\r\n\r\n" % (
        config.host.encode(),
        framing,
    )

    def send() -> None:
        try:
            sock.sendall(head)
            for piece in _body_pieces(HUNDRED_MB):
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered and closed: what we expect

    started = time.monotonic()
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    answer = b""
    while b"\r\n\r\n" not in answer:
        data = sock.recv(65536)
        assert data, f"the server closed without an answer: {answer!r}"
        answer += data
    raw_head, body = answer.split(b"\r\n\r\n", 1)
    lines = raw_head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        data = sock.recv(65536)
        if not data:
            break
        body += data
    elapsed = time.monotonic() - started
    sock.close()
    sender.join(timeout=30)
    return int(lines[0].split()[1]), headers, body, elapsed


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked-transfer"])
def test_100mb_body_is_refused_fast_without_memory_growth(
    limited_server: ServerConfig, chunked: bool
) -> None:
    pgid = server_process_group(limited_server.port)
    before = group_rss_bytes(pgid)
    status, _headers, body, elapsed = _post_huge(limited_server, chunked)
    time.sleep(0.5)  # anything the server still buffered would show now
    growth = group_rss_bytes(pgid) - before
    print(
        f"100 MB POST ({'chunked' if chunked else 'declared'}): {status} in {elapsed:.3f} s, "
        f"RSS growth {growth / 1024**2:.1f} MB"
    )
    assert status == 413, body[:300]
    assert "chunk_max_body_bytes" in json.loads(body)["error"]
    assert elapsed < 1.0
    assert growth < MAX_RSS_GROWTH
    assert (
        generate(limited_server.url, "Hello", max_new_tokens=2)["meta_info"]["completion_tokens"]
        == 2
    )


def test_chunk_token_bounds_are_413(limited_server: ServerConfig) -> None:
    url = limited_server.url + "/chunks"
    too_many_ids = requests.post(url, json={"input_ids": [5] * (MAX_TOKENS + 1)}, timeout=60)
    assert too_many_ids.status_code == 413
    assert "chunk_max_tokens" in too_many_ids.json()["error"]
    # Far more characters than MAX_TOKENS tokens can hold: refused before tokenizing.
    too_long_text = requests.post(url, json={"text": "word " * (MAX_TOKENS * 8)}, timeout=60)
    assert too_long_text.status_code == 413
    assert "characters" in too_long_text.json()["error"]
    # Within the character bound, but more tokens than allowed once tokenized.
    many_tokens = " ".join(f"{i * 7919 % 100003}" for i in range(MAX_TOKENS))
    assert len(many_tokens) < MAX_TOKENS * 32
    over = requests.post(url, json={"text": many_tokens}, timeout=60)
    assert over.status_code == 413 and "tokens" in over.json()["error"], over.text
    ok = requests.post(url, json={"input_ids": list(range(10, 10 + MAX_TOKENS))}, timeout=120)
    assert ok.status_code == 200 and ok.json()["num_tokens"] == MAX_TOKENS


def test_registrations_per_minute_are_429_with_retry_after(limited_server: ServerConfig) -> None:
    url = limited_server.url + "/chunks"
    statuses = []
    for _ in range(PER_MINUTE + 2):
        response = requests.post(url, json={}, timeout=30)  # cheap: a 400 once admitted
        statuses.append(response.status_code)
        if response.status_code == 429:
            break
    assert statuses[-1] == 429, statuses
    assert set(statuses[:-1]) <= {400}
    assert int(response.headers["Retry-After"]) >= 1
    assert "chunk_registrations_per_minute" in response.json()["error"]
    # Reading chunks is not limited.
    assert requests.get(url, timeout=30).status_code == 200
