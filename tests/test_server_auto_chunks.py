"""Documents reused from ordinary OpenAI traffic (setting `auto_chunks`): no POST /chunks.

One server with `auto_chunks`, `fusion_by_default`, a chunk disk tier and
`--enable-cache-report`; requests through the `openai` package as SGLang users send them. Its
model is SmolLM2's tokenizer and chat template over random weights (`tiny_smollm2_path`): what
is asserted here (pieces captured and matched, cached tokens, r = 1 equal to the normal prefill
under concurrency, bounds) is the server's, not the weights'; the reuse of real traffic on
SmolLM2 itself is benchmarks/auto_reuse.py. The
server also keeps what shadow checks compute (`fusion_shadow_refresh`): reuse of documents
computed in their real context is a kind of reuse from ordinary traffic.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from sglang_hicache_ext.evaluation.hotpotqa import load_hotpotqa
from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings
from sglang_hicache_ext.sglang_ext.frontend import wait_for_shadow_check
from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig, running_server
from sglang_hicache_ext.sglang_ext.server.ports import free_port
from tests.test_server_retention_pressure import twin_prompts

pytestmark = pytest.mark.server

SYSTEM = "Answer the question from the documents in a few words."
PER_MINUTE = 60


def _config(model_path: Path, workdir: Path, port: int) -> ServerConfig:
    settings = {
        "auto_chunks": True,
        "auto_chunks_per_minute": PER_MINUTE,
        "fusion_by_default": True,
        "chunk_disk_dir": str(workdir / "chunks"),
        "fusion_shadow_refresh": True,
    }
    return ServerConfig(
        model_path=str(model_path),
        port=port,
        max_total_tokens=20_000,
        extra_args=("--enable-cache-report", "--enable-metrics", "--chunked-prefill-size", "512"),
    ).with_settings(workdir / "settings.json", settings)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("auto_chunks")


class AutoServer:
    """The module's server, restartable on the same chunk disk folder."""

    def __init__(self, model_path: Path, workdir: Path) -> None:
        self._path, self._workdir = model_path, workdir
        self._stack = contextlib.ExitStack()
        self.url = self._start()

    def _start(self) -> str:
        config = _config(self._path, self._workdir, free_port())
        log = self._workdir / f"server-{config.port}.log"
        return self._stack.enter_context(running_server(config, log_path=log)).url

    def restart(self) -> None:
        self._stack.close()
        self._stack = contextlib.ExitStack()
        self.url = self._start()

    def close(self) -> None:
        self._stack.close()


@pytest.fixture(scope="module")
def auto_server(tiny_smollm2_path: Path, workdir: Path) -> Iterator[AutoServer]:
    server = AutoServer(tiny_smollm2_path, workdir)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    docs = [doc for example in load_hotpotqa(12, seed=23) for doc in example.documents]
    return [doc for doc in docs if len(doc) > 250][:24]


def _messages(documents: list[str], question: str) -> list[dict[str, str]]:
    body = "\n\n".join(f"Document {i + 1}. {doc}" for i, doc in enumerate(documents))
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"{body}\n\nQuestion: {question}"},
    ]


def _chat(url: str, documents: list[str], question: str, **custom: Any) -> Any:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    extra = {"custom_params": custom} if custom else None
    return client.chat.completions.create(
        model="default",
        messages=_messages(documents, question),
        max_tokens=8,
        temperature=0,
        extra_body=extra,
    )


def _stats(url: str) -> dict[str, Any]:
    info = requests.get(url + "/server_info", timeout=30).json()
    return info["internal_states"][0]["hicache_ext"]


def test_second_sight_of_documents_is_reused_without_registration(
    auto_server: AutoServer, corpus: list[str]
) -> None:
    import openai

    url = auto_server.url
    first = _chat(url, corpus[0:4], "Which document is the oldest?")
    assert first.usage.prompt_tokens_details.cached_tokens < 40  # nothing stored yet
    captured = _stats(url)["auto_chunks"]
    assert captured["captured"] >= 4, captured
    # The same documents in another order, at other positions, streamed by the openai client.
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    stream = client.chat.completions.create(
        model="default",
        messages=_messages([corpus[3], corpus[1], corpus[0], corpus[2]], "Who is named first?"),
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    document_tokens = sum(
        len(t) for t in _tokenize(url, [corpus[3], corpus[1], corpus[0], corpus[2]])
    )
    # cached_tokens counts the reused chunk rows (85 % of the matched ones at r = 0.15).
    assert usage.prompt_tokens_details.cached_tokens >= 0.9 * 0.85 * document_tokens * 0.9
    chunks_listed = requests.get(url + "/chunks", timeout=30).json()
    assert len(chunks_listed["chunks"]) >= 4


def test_openai_rag_example_reuses_its_documents(auto_server: AutoServer) -> None:
    from examples import openai_rag

    first, second = openai_rag.main(["--base-url", auto_server.url + "/v1"])
    assert first.text and second.text
    document_tokens = sum(len(t) for t in _tokenize(auto_server.url, list(openai_rag.DOCUMENTS)))
    # The second request computes only the question and its header, and the recomputed share.
    assert second.cached_tokens - first.cached_tokens >= 0.7 * document_tokens


def test_completions_api_reuses_documents_too(auto_server: AutoServer, corpus: list[str]) -> None:
    import openai

    client = openai.OpenAI(base_url=auto_server.url + "/v1", api_key="none")
    docs = [corpus[4], corpus[5]]

    def complete(order: list[str], question: str) -> Any:
        body = "\n\n".join(f"[{i}] {doc}" for i, doc in enumerate(order))
        return client.completions.create(
            model="default", prompt=f"{body}\n\n{question}\nAnswer:", max_tokens=4, temperature=0
        )

    first = complete(docs, "Which is older?")
    second = complete(docs[::-1], "Which is newer?")
    document_tokens = sum(len(t) for t in _tokenize(auto_server.url, docs))
    gained = second.usage.prompt_tokens_details.cached_tokens - (
        first.usage.prompt_tokens_details.cached_tokens
    )
    assert gained >= 0.7 * document_tokens


def _tokenize(url: str, texts: list[str]) -> list[list[int]]:
    return [
        requests.post(url + "/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]
        for text in texts
    ]


def test_a_mostly_new_prompt_gets_the_normal_prefill_and_its_paragraphs_are_kept(
    auto_server: AutoServer, corpus: list[str]
) -> None:
    """Stored chunks under `fusion_min_matched_share` of the prompt: the normal prefill at the
    server's ratio (`below_break_even`, counted), new paragraphs kept; a pinned ratio fuses."""
    url = auto_server.url
    # A short paragraph (49 tokens): under half the default minimum share of a prompt that fits
    # the context, with fewer new pieces than the capture cap's minute holds.
    seen = corpus[6][:160]
    seeded = _stats(url)["auto_chunks"]["captured"]
    # Its paragraph kept: stored from now on (this test runs before the capture cap's).
    _generate(url, {"text": f"{seen}\n\nQuestion: what?", "sampling_params": {"max_new_tokens": 1}})
    assert _stats(url)["auto_chunks"]["captured"] == seeded + 1
    logs = [
        f"Log {i}: the ferry from pier {i * 37 % 11} carried {i * 13 % 50} cars, {i * 7 % 40} "
        f"vans and {i % 9} trucks across the bay on day {i * 3 % 28} of the month; the harbour "
        "master signed the manifest and the crew logged the weather as calm and the sea as flat."
        for i in range(80)
    ]
    half = ExtensionSettings().fusion_min_matched_share / 2  # by characters: a margin
    new = logs[: next(n for n in range(4, 80) if len(seen) < half * sum(map(len, logs[:n])))]
    text = "\n\n".join([*new[:2], seen, *new[2:]]) + "\n\nQuestion: which day?"
    before = _stats(url)
    body = {"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    (meta,) = _generate(url, body)["meta_info"]["hicache_ext_fusion"]
    # Past its first prefill round the stored paragraph is in the cached prefix.
    assert not meta["fused"] and meta["fallback"] in ("below_break_even", "prefix_cached"), meta
    after = _stats(url)
    assert after["auto_chunks"]["captured"] - before["auto_chunks"]["captured"] >= 4
    fallbacks = before["fusion"].get("fallback_below_break_even", 0)
    assert after["fusion"].get("fallback_below_break_even", 0) == fallbacks + 1
    body["sampling_params"]["custom_params"] = {"fusion_recompute_ratio": 0.15}
    pinned = _generate(url, {**body, "text": f"Pinned.\n\n{text}"})  # not a cached prefix
    (meta,) = pinned["meta_info"]["hicache_ext_fusion"]
    assert meta["fused"] is True and meta["chunks_hit"] >= 5, meta
    metrics = requests.get(url + "/metrics", timeout=30).text
    assert 'reason="below_break_even"' in metrics


def test_concurrent_capture_and_fusion_equal_one_by_one(
    auto_server: AutoServer, corpus: list[str]
) -> None:
    """16 requests at once over fresh documents: some capture a document while others fuse it.
    Each prompt holds a document seen once before (so it fuses whatever the scheduling) and one
    new to the mix (so the mix captures). Each pair of documents is asked twice in the mix, fused
    at ratio 1 and with fusion off, the second time in the other order: at ratio 1 a fused
    prefill is the normal one, so every output must equal its prompt's one-by-one run (with
    fusion off) however the captures interleave.

    No fused prompt may find its documents all in the prefix tree, or it is rightly a normal
    prefill (`prefix_cached`) and the mix fuses nothing: SGLang's in-batch prefix caching holds
    back a prompt that repeats a waiting one until the first is computed, so twins of the same
    text would decide by arrival order which of the two fuses (13 of 16 did not, once all 16).
    Hence distinct pairs and the twin in the other order."""
    url = auto_server.url
    fresh = corpus[8:20]
    before = _stats(url)
    _chat(url, fresh[:6], "Which document is the longest?")
    seeded = _stats(url)
    assert seeded["auto_chunks"]["captured"] - before["auto_chunks"]["captured"] >= 6, seeded
    prompts, jobs = twin_prompts(fresh, 8, seed=5)
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        together = list(pool.map(lambda job: _answer(url, *job), jobs))
    after = _stats(url)
    assert after["auto_chunks"]["captured"] > seeded["auto_chunks"]["captured"]
    fused = after["fusion"].get("fused_requests", 0) - seeded["fusion"].get("fused_requests", 0)
    assert fused > 0, after["fusion"]
    alone = [_answer(url, docs, question, {"fusion": False}) for docs, question in prompts]
    assert together == alone


def _answer(url: str, docs: list[str], question: str, custom: dict[str, Any]) -> str:
    return _chat(url, docs, question, **custom).choices[0].message.content


def _generate(url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = requests.post(url + "/generate", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


def test_pathological_prompts_are_answered_and_capture_stays_bounded(
    auto_server: AutoServer, corpus: list[str]
) -> None:
    """One token repeated 1,500 times, 350 one-line paragraphs (each prompt over three of the
    server's 512-token prefill rounds), documents that differ by one word: answered, fused or
    not, and at most a piece kept per distinct paragraph (benchmarks/auto_reuse_limits.py
    times them at 7,000 tokens and 700 lines)."""
    url = auto_server.url
    before = _stats(url)["auto_chunks"]
    (token,) = _tokenize(url, [" the"])[0][-1:]
    body = {"input_ids": [token] * 1500, "sampling_params": {"max_new_tokens": 2}}
    for _ in range(2):  # the second time its pieces are stored already
        _generate(url, body)
    repeated = _stats(url)["auto_chunks"]
    # Identical content is cut identically: one distinct piece, and the tail joined to the last.
    assert repeated["captured"] - before["captured"] <= 2
    lines = "\n".join(f"Line {i}: all quiet." for i in range(350))
    _generate(url, {"text": lines, "sampling_params": {"max_new_tokens": 2}})
    assert _stats(url)["auto_chunks"]["captured"] == repeated["captured"]  # none is a piece
    doc = corpus[21]
    twin = doc.replace(" the ", " a ", 1)
    assert twin != doc
    for docs in ([doc, twin], [twin, doc], [doc, twin]):
        reply = _chat(url, docs, "What differs?")
        assert reply.choices[0].message.content is not None
    after = _stats(url)["auto_chunks"]
    # Each paragraph of the pair kept once at most (its pieces: one per paragraph here).
    assert after["captured"] - repeated["captured"] <= 2


def test_capture_cap_is_counted_and_honoured(auto_server: AutoServer) -> None:
    """More new paragraphs than the per-minute cap in one prompt: the rest are counted."""
    url = auto_server.url
    before = _stats(url)["auto_chunks"]
    paragraphs = [
        f"Note {i}: the shipment of crate {i * 7919 % 10007} left harbour {i % 13} on day "
        f"{i % 29} with {i * 31 % 97} barrels of oil, {i * 17 % 89} of wine and one clerk."
        for i in range(PER_MINUTE + 15)
    ]
    body = {"text": "\n\n".join(paragraphs), "sampling_params": {"max_new_tokens": 1}}
    assert requests.post(url + "/generate", json=body, timeout=600).status_code == 200
    after = _stats(url)["auto_chunks"]
    assert after["captured"] - before["captured"] <= PER_MINUTE
    assert after["over_cap"] > before["over_cap"]
    metrics = requests.get(url + "/metrics", timeout=30).text
    assert "sglang:hicache_ext_auto_chunks_total{" in metrics and 'outcome="over_cap"' in metrics


def test_a_shadow_checks_rows_serve_the_same_documents_later(
    auto_server: AutoServer, corpus: list[str]
) -> None:
    """Two registered documents asked once, fused and checked: the check's rows of both are kept
    for that document set. The same documents asked again in the same order read them, and then
    every reused row is the normal prefill's: the fused answer is the normal one, whatever the
    ratio (fp32 here: a bf16 pool rounds the keys on their way back to pre-RoPE and again). In the other order they are read too; beside another document they are not. Deleting
    a document drops the rows kept with it."""
    url = auto_server.url
    docs = [corpus[22], corpus[23], corpus[20]]
    ids = []
    for doc in docs:
        response = requests.post(url + "/chunks", json={"text": doc}, timeout=120)
        assert response.status_code == 200, response.text
        ids.append(response.json()["id"])

    def ask(order: list[int], question: str, **custom: Any) -> dict[str, Any]:
        text = "Documents:\n\n" + "\n\n".join(docs[i] for i in order) + f"\n\n{question}"
        params = {"max_new_tokens": 8, "temperature": 0, "custom_params": custom}
        return _generate(url, {"text": text, "sampling_params": params})

    fused = {"fusion": True, "fusion_recompute_ratio": 0.15}
    first = ask([1, 0], "Question: who is named first?", **fused, fusion_shadow=True)
    (meta,) = first["meta_info"]["hicache_ext_fusion"]
    assert meta["fused"] is True and meta["chunk_prefixes"]["in_context"] == 0
    checked = wait_for_shadow_check(url, first["meta_info"]["id"], timeout_s=300)
    assert checked is not None, f"the check of {first['meta_info']['id']} did not run"
    kept = _stats(url)["context_variants"]
    assert kept["kept"] >= 2, kept

    again = ask([1, 0], "Question: where does it happen?", **fused, fusion_shadow=False)
    (meta,) = again["meta_info"]["hicache_ext_fusion"]
    assert meta["fused"] is True and meta["chunk_prefixes"]["in_context"] == 2, meta
    assert meta["tokens_reused"] > 0
    normal = ask([1, 0], "Question: where does it happen?", fusion=False)
    assert again["text"] == normal["text"]

    swapped = ask([0, 1], "Question: who is named last?", **fused, fusion_shadow=False)
    assert swapped["meta_info"]["hicache_ext_fusion"][0]["chunk_prefixes"]["in_context"] == 2
    other = ask([0, 2], "Question: who is named last?", **fused, fusion_shadow=False)
    assert other["meta_info"]["hicache_ext_fusion"][0]["chunk_prefixes"]["in_context"] == 0
    used = _stats(url)["context_variants"]
    assert used["used"] - kept["used"] == 4, used

    assert requests.delete(f"{url}/chunks/{ids[0]}", timeout=30).status_code == 200
    dropped = _stats(url)["context_variants"]
    assert dropped["variants"] <= used["variants"] - 2, dropped
    metrics = requests.get(url + "/metrics", timeout=30).text
    assert "sglang:hicache_ext_fusion_context_variants_total{" in metrics


def test_restart_keeps_captured_documents(auto_server: AutoServer, corpus: list[str]) -> None:
    """What the disk tier holds of captured documents is found again after a restart: the
    first prompt after it reuses them."""
    listed = {
        c["id"] for c in requests.get(auto_server.url + "/chunks", timeout=30).json()["chunks"]
    }
    assert listed
    auto_server.restart()
    again = {
        c["id"] for c in requests.get(auto_server.url + "/chunks", timeout=30).json()["chunks"]
    }
    assert listed <= again
    reply = _chat(auto_server.url, [corpus[2], corpus[0]], "Which came first?")
    assert reply.usage.prompt_tokens_details.cached_tokens > 100
