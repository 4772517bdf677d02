"""A streamed `POST /generate` of an SGLang server, read over HTTP (the benchmarks' and tools' client).

`stream_chunks` yields the server's chunks as they arrive (a caller may stop early: closing the
generator closes the connection); `stream_generate` reads the stream to its end and returns the
time to the first chunk, the total time, the arrival of every chunk, the text and `meta_info`.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Generator, Mapping
from typing import Any, NamedTuple

import requests

Timeout = float | tuple[float, float]


class StreamError(RuntimeError):
    """The server streamed an error object, or a chunk that is not JSON (`malformed`)."""

    def __init__(self, message: str, *, malformed: bool) -> None:
        super().__init__(message)
        self.malformed = malformed


class StreamedGeneration(NamedTuple):
    ttft_s: float  # first chunk, from the send
    latency_s: float  # last chunk, from the send
    token_times_s: tuple[float, ...]  # arrival of every chunk, from the send
    text: str  # the last chunk's text (SGLang streams the text so far)
    meta: dict[str, Any]  # the last chunk's meta_info


def stream_chunks(
    url: str, body: Mapping[str, Any], timeout: Timeout
) -> Generator[dict[str, Any], None, None]:
    """The JSON chunks of a streamed /generate of `body`, up to `[DONE]`.

    Raises `requests.HTTPError` (with the response) for a status other than 200, `StreamError`
    for an error chunk or one that is not JSON, and `requests` errors (timeouts, connection).
    """
    with requests.post(
        url + "/generate", json={**body, "stream": True}, stream=True, timeout=timeout
    ) as response:
        if response.status_code != 200:
            raise requests.HTTPError(f"HTTP {response.status_code}", response=response)
        for line in response.iter_lines():
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            try:
                item = json.loads(data)
            except ValueError:
                raise StreamError(data[:200].decode(errors="replace"), malformed=True) from None
            if isinstance(item, dict) and "error" in item:
                raise StreamError(str(item["error"]), malformed=False)
            yield item


def stream_generate(url: str, body: Mapping[str, Any], timeout: Timeout) -> StreamedGeneration:
    """Stream /generate to its end; `StreamError` also when the server streamed nothing."""
    start = time.perf_counter()
    times: list[float] = []
    text, meta = "", dict[str, Any]()
    with contextlib.closing(stream_chunks(url, body, timeout)) as chunks:
        for chunk in chunks:
            times.append(time.perf_counter() - start)
            text = chunk.get("text", text)
            meta = chunk.get("meta_info", meta)
    if not times:
        raise StreamError("the server streamed nothing", malformed=False)
    return StreamedGeneration(times[0], times[-1], tuple(times), text, meta)
