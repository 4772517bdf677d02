"""The soak's HTTP client: every request answers an `Outcome`, never raises for a server's fault."""

from __future__ import annotations

import contextlib
from typing import Any

import requests

from benchmarks.soak.records import Outcome, status_class
from sglang_hicache_ext.sglang_ext.tools.streaming_client import StreamError, stream_chunks

CONNECT_TIMEOUT_S = 10


class SoakClient:
    def __init__(self, url: str) -> None:
        self.url = url

    def call(
        self, method: str, path: str, timeout_s: float, **kwargs: Any
    ) -> tuple[int | None, str, Any]:
        """One request; (status, class, JSON body or None)."""
        try:
            response = requests.request(
                method, self.url + path, timeout=(CONNECT_TIMEOUT_S, timeout_s), **kwargs
            )
        except requests.Timeout:
            return None, "timeout", None
        except requests.ConnectionError:
            return None, "conn_error", None
        except requests.RequestException:
            return None, "other", None
        try:
            body = response.json()
        except ValueError:
            body = None
        return response.status_code, status_class(response.status_code), body

    def stream(self, body: dict[str, Any], abort_after: int | None, timeout_s: float) -> Outcome:
        """A streaming /generate; with `abort_after`, close the connection after that many chunks."""
        chunks = 0
        try:
            timeout = (CONNECT_TIMEOUT_S, timeout_s)
            with contextlib.closing(stream_chunks(self.url, body, timeout)) as items:
                for _ in items:
                    chunks += 1
                    if abort_after is not None and chunks >= abort_after:
                        return 200, "aborted", {"chunks": chunks}  # closing it ends the connection
        except requests.HTTPError as error:
            code = error.response.status_code
            return code, status_class(code), {}
        except StreamError as error:
            return (
                200,
                "stream_error",
                {"bad_chunk" if error.malformed else "error": str(error)[:300]},
            )
        except requests.Timeout:
            return None, "timeout", {"chunks": chunks}
        except requests.ConnectionError:
            return None, "conn_error", {"chunks": chunks}
        return 200, "2xx", {"chunks": chunks}
