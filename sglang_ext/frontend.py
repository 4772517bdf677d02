"""Frontend helpers: register documents and pass fusion options from `sgl.function` programs.

    backend = FusionEndpoint("http://127.0.0.1:30000", chat_template_name="chatml")
    register_documents(backend.base_url, docs)
    with backend.fusion(selector="a3", recompute_ratio=0.15):
        state = my_rag_program.run(documents=docs, question=q, backend=backend)

`sgl.gen` has no field for SGLang's `custom_params`, so the endpoint adds the fusion options to
every `/generate` body it sends while a `fusion(...)` block is active.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import requests
import sglang as sgl


@dataclass(frozen=True)
class RegisteredChunk:
    id: str
    num_tokens: int
    created: bool


class ChunkRegistrationError(RuntimeError):
    """The server refused a document; the message is the server's."""


def register_documents(
    url: str,
    documents: Sequence[str],
    timeout_s: float = 600.0,
    prefix: str | None = None,
    in_flight: int = 8,
) -> list[RegisteredChunk]:
    """POST each document to `/chunks` (idempotent); returns their ids in the documents' order.
    `prefix`: the text the documents are computed after (the prompts' system prompt and chat
    header; None: the server's setting chunk_prefix). Up to `in_flight` registrations are sent
    at once, so the server prefills them in batches (docs/fusion-sglang.md); a refusal raises
    ChunkRegistrationError (the first in the documents' order) once the others have answered."""
    if in_flight < 1:
        raise ValueError(f"in_flight must be >= 1, got {in_flight}")

    def register(document: str) -> RegisteredChunk:
        body: dict[str, Any] = {"text": document}
        if prefix is not None:
            body["prefix"] = prefix
        response = requests.post(url.rstrip("/") + "/chunks", json=body, timeout=timeout_s)
        if response.status_code != 200:
            raise ChunkRegistrationError(
                f"/chunks answered {response.status_code}: {response.text}"
            )
        answer = response.json()
        return RegisteredChunk(answer["id"], answer["num_tokens"], answer["created"])

    with ThreadPoolExecutor(max_workers=min(in_flight, max(len(documents), 1))) as pool:
        return list(pool.map(register, documents))


def wait_for_shadow_check(url: str, rid: str, timeout_s: float = 900.0) -> dict[str, Any] | None:
    """The server's shadow check of request `rid` (its entry of `GET /hicache_ext/shadow_checks`
    "recent") once it has run. None when the check queue is idle without it (the check failed
    or was dropped), or after `timeout_s`. Checks run while the server is idle of user
    requests, so this may wait for other traffic to end."""
    status_url = url.rstrip("/") + "/hicache_ext/shadow_checks"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = requests.get(status_url, timeout=60).json()
        for result in status["recent"]:
            if result["rid"] == rid:
                return result
        if not status["pending"] and status["running"] is None:
            time.sleep(0.5)  # the check may not be queued yet: the answer just arrived
            status = requests.get(status_url, timeout=60).json()
            if not status["pending"] and status["running"] is None:
                return next((r for r in status["recent"] if r["rid"] == rid), None)
        time.sleep(0.1)
    return None


@dataclass(frozen=True)
class FusionRequest:
    """Per-request fusion options, as the server's `custom_params` keys.

    None leaves an option to the server's settings (`fusion_selector`, `fusion_recompute_ratio`,
    `fusion_sink_tokens`, `fusion_fresh_layers`, `fusion_context_temperature`,
    `fusion_context_scale`, `fusion_overlap_loads`, `fusion_decode_capacity`), the one place
    where its default is written. `recompute_ratio="auto"`: the ratio tuned for the tier each chunk is
    loaded from; `decode_capacity`: the share of the prompt's rows the decode attends; `shadow`:
    True checks each fused answer against the normal prefill after it is served (the server's
    shadow checks), False never does, None leaves it to the setting `fusion_shadow_rate`.
    """

    selector: str | None = None
    recompute_ratio: float | Literal["auto"] | None = None
    enabled: bool = True
    sink_tokens: int | None = None
    overlap_loads: bool | None = None
    decode_capacity: float | None = None
    fresh_layers: int | None = None
    context_temperature: float | None = None
    context_scale: float | None = None
    shadow: bool | None = None

    def custom_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {"fusion": self.enabled}
        optional = {
            "fusion_selector": self.selector,
            "fusion_recompute_ratio": self.recompute_ratio,
            "fusion_sink_tokens": self.sink_tokens,
            "fusion_overlap_loads": self.overlap_loads,
            "fusion_decode_capacity": self.decode_capacity,
            "fusion_fresh_layers": self.fresh_layers,
            "fusion_context_temperature": self.context_temperature,
            "fusion_context_scale": self.context_scale,
            "fusion_shadow": self.shadow,
        }
        params.update({key: value for key, value in optional.items() if value is not None})
        return params


class FusionEndpoint(sgl.RuntimeEndpoint):
    """A RuntimeEndpoint that sends fusion options with its generate requests."""

    def __init__(
        self, base_url: str, *args: Any, fusion: FusionRequest | None = None, **kwargs: Any
    ) -> None:
        super().__init__(base_url, *args, **kwargs)
        # Programs execute in the interpreter's own threads, so the options live on the endpoint:
        # use one endpoint per option set when running programs with different options at once.
        self.fusion_request = fusion

    @contextmanager
    def fusion(
        self,
        selector: str | None = None,
        recompute_ratio: float | Literal["auto"] | None = None,
        enabled: bool = True,
        sink_tokens: int | None = None,
        decode_capacity: float | None = None,
        shadow: bool | None = None,
    ) -> Iterator[FusionRequest]:
        """Fusion options for the programs run inside the block."""
        previous = self.fusion_request
        self.fusion_request = FusionRequest(
            selector,
            recompute_ratio,
            enabled,
            sink_tokens,
            decode_capacity=decode_capacity,
            shadow=shadow,
        )
        try:
            yield self.fusion_request
        finally:
            self.fusion_request = previous

    def _add_images(self, s: Any, data: dict[str, Any]) -> None:
        # The one hook both generate paths call with the request body just before sending it.
        super()._add_images(s, data)
        options = self.fusion_request
        if options is not None:
            params = data["sampling_params"].setdefault("custom_params", {}) or {}
            params.update(options.custom_params())
            data["sampling_params"]["custom_params"] = params
