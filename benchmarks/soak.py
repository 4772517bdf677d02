"""Bounded soak: mixed traffic against one real CPU server for a fixed time, a disk fault midway.

One SmolLM2-135M-Instruct server (fp32, `--radix-cache-backend hicache_ext`, HiCache host tier,
our disk tier `KaretoDiskStorage` with a small capacity and a short TTL period, a small device
pool and a small chunked-prefill size). For `--minutes`, `--workers` client threads send a
weighted mix of requests, each with a timeout:

- `register`: `POST /chunks` of HotpotQA paragraphs (new ones over time, and repeats);
- `fused`: `/generate` with `custom_params.fusion`, selectors cycling a3/freq/cacheblend/epic/reuse,
  2-6 registered paragraphs in shuffled order + a question (the longer ones are split by chunked
  prefill and fall back to the normal prefill);
- `normal_shared`: a long shared system prefix + one of a few record sets (tree/host/disk hits);
- `normal_long`: ~0.9-2K tokens, split across chunked-prefill rounds;
- `stream`, `logprob` (fused or normal), `abort` (streaming, the client closes the connection
  after the first chunks: counted as `aborted`, deliberate);
- `delete` (`DELETE /chunks/{id}`), `bad` (malformed requests, a 4xx is expected), `list`
  (`GET /chunks`), `storage` (`GET /hicache_ext/storage`).

An admin thread re-plans the TTLs (`POST /hicache_ext/storage/ttl {"replan": true}`) and reads
`GET /chunks` / `GET /hicache_ext/storage` periodically. At 50 % of the duration it injects a
storage fault from outside the server (`Soak.inject_fault`): new requests are held until none is
in flight; two shared-prefix prompts, sent alone after `/flush_cache`, show which disk pages they
use; a few page files under the disk dir get bytes flipped in their payload (one of them in the
first prompt's pages) and one page subdirectory is deleted (one of the second prompt's pages);
both prompts are sent again, each alone after a flush, so the damage is read at once (the store
must drop it and count it: `disk.corrupt_pages`, `io_errors`); then traffic resumes.

A monitor thread samples the RSS of the server's process group (psutil) and checks the process
and `/health` every `--sample-s` seconds; an exited server or 3 failed health checks in a row is
a crash and ends the run (the log tail goes into the JSON).

Output: JSON (`--out`, default benchmarks/results/soak.json) and a PNG next to it (RSS and
request latency over time, fault marked). Acceptance (issue 11): 0 crashes; RSS growth over the
last 10 minutes (the last half for shorter runs) < 5 %, measured as the median RSS of the last
minute of that window over the median of its first minute (samples taken while the fault held
the traffic left out); every request answered or refused
with a clear status (no 5xx, no connection error except the deliberate aborts, no timeout).
Exit status 1 when any of them fails.

    python benchmarks/soak.py --minutes 20
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sglang_hicache_ext.evaluation.hotpotqa import HotpotQAExample, load_hotpotqa  # noqa: E402
from sglang_hicache_ext.sglang_ext.disk_tier.storage_backend import disk_tier_extra_config  # noqa: E402
from sglang_hicache_ext.sglang_ext.server.launcher import (  # noqa: E402
    ServerConfig,
    ServerStartError,
    free_port,
    running_server,
)

from scripts.prepare_models import SMOLLM2, prepare  # noqa: E402

# Request mix of the worker threads (relative weights).
WEIGHTS: dict[str, float] = {
    "fused": 30,
    "normal_shared": 16,
    "normal_long": 6,
    "stream": 8,
    "logprob": 6,
    "abort": 6,
    "register": 12,
    "delete": 2,
    "bad": 5,
    "list": 2,
    "storage": 2,
}
# Kinds sent by the admin thread (not drawn by the workers).
ADMIN_KINDS = ("ttl_replan", "list_periodic", "storage_periodic")
SELECTORS: tuple[tuple[str, float], ...] = (
    ("a3", 0.15),
    ("freq", 0.15),
    ("cacheblend", 0.15),
    ("epic", 0.3),
    ("reuse", 0.0),
)
# `client_error`: an exception in this script (a bug here, never blamed on the server, but it
# fails the run so that it gets fixed); `other`: a status outside 2xx/4xx/5xx, or a request error
# of `requests` that is neither a timeout nor a connection error.
STATUS_CLASSES = (
    "2xx",
    "4xx",
    "5xx",
    "other",
    "conn_error",
    "timeout",
    "stream_error",
    "client_error",
    "aborted",
)
FAILURE_CLASSES = ("5xx", "other", "conn_error", "timeout", "stream_error", "client_error")

SYSTEM = (
    "You are a careful archivist working for a regional records office. Answer questions about "
    "the records below briefly and only from the records; say 'unknown' when they do not say. "
    "Quote entry numbers and years exactly as written, keep units, and never invent names. "
) * 4
TOPICS = (
    "lighthouses",
    "glaciers",
    "river barges",
    "harbour cranes",
    "orchards",
    "observatories",
    "canal locks",
    "salt marshes",
)

_UNKNOWN_ID = "0" * 64
STORAGE_SERIES_KEYS = (
    "entries",
    "used_bytes",
    "hits",
    "misses",
    "evicted",
    "expired",
    "corrupt_pages",
    "write_errors",
    "io_errors",
    "rejected_writes",
)


# --------------------------------------------------------------------------------------------
# Recording


@dataclass
class Record:
    t: float  # seconds since the start of the traffic, at the request's start
    kind: str
    status: int | None  # HTTP status, None when no response came
    cls: str  # one of STATUS_CLASSES
    latency_s: float
    detail: dict[str, Any] = field(default_factory=dict)


class Recorder:
    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.records: list[Record] = []
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def add(self, record: Record) -> None:
        with self._lock:
            self.records.append(record)

    def snapshot(self) -> list[Record]:
        with self._lock:
            return list(self.records)


def status_class(code: int) -> str:
    if 200 <= code < 300:
        return "2xx"
    if 400 <= code < 500:
        return "4xx"
    if 500 <= code < 600:
        return "5xx"
    return "other"


# --------------------------------------------------------------------------------------------
# Server process group


def find_server_process(port: int) -> psutil.Process:
    """Our child `sglang.launch_server` on `port` (the launcher keeps the Popen to itself)."""
    for child in psutil.Process().children(recursive=False):
        with contextlib.suppress(psutil.Error):
            cmd = child.cmdline()
            if "sglang.launch_server" in cmd and str(port) in cmd:
                return child
    raise RuntimeError(f"no sglang.launch_server child process on port {port}")


def group_rss(pgid: int) -> dict[int, int]:
    """RSS in bytes of every live process in the process group `pgid`."""
    rss: dict[int, int] = {}
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) != pgid or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            rss[proc.pid] = proc.memory_info().rss
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return rss


def key_paths(root: Path) -> dict[str, Path]:
    """Page key -> file, from the page headers (read from outside the server)."""
    from sglang_hicache_ext.tiers.page_file import read_header

    paths = {}
    for path in root.rglob("*.page"):
        with contextlib.suppress(Exception):  # evicted meanwhile, or a format we cannot read
            paths[read_header(path).key] = path
    return paths


def fault_targets(root: Path, pages: list[dict[str, Any]], now: float) -> list[Path]:
    """Page files under `root`, the best targets first: live pages that were read or refreshed
    after their write (reused, e.g. the shared system prefix) with the latest expiry, so that
    the requests after the fault read them while still live. `pages` is the store's own page
    list (`GET /hicache_ext/storage?pages=N`); a file is matched to it by the key in its header.
    Without usable headers: the most recently accessed files (mtime = last access) first."""
    from sglang_hicache_ext.tiers.page_file import read_header

    info = {p.get("key"): p for p in pages if isinstance(p, dict)}
    scored = []
    for path in root.rglob("*.page"):
        try:
            mtime = path.stat().st_mtime
        except OSError:  # evicted or expired meanwhile
            continue
        try:
            page = info.get(read_header(path).key)
        except Exception:  # the file format may change: fall back to recency alone
            page = None
        if page is None:
            scored.append((False, 0.0, mtime, path))
            continue
        reused = page["last_access"] - page["write_time"] > 0.5
        scored.append((reused, page["expiry"] - now, mtime, path))
    scored.sort(key=lambda item: item[:3], reverse=True)
    return [item[3] for item in scored]


def process_alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def log_tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


_LOG_ERROR = re.compile(r"Traceback|Error|ERROR|Exception|exception|CRITICAL")
_LOG_NUMBERS = re.compile(r"0x[0-9a-f]+|\b[0-9a-f]{12,}\b|\d+(\.\d+)?")


def scan_log(path: Path, limit: int = 40) -> dict[str, Any]:
    """Lines of the server log that look like errors, grouped by their shape (numbers masked)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {"lines": 0, "matching": 0, "patterns": []}
    counts: Counter[str] = Counter()
    example: dict[str, str] = {}
    lines = text.splitlines()
    for line in lines:
        if not _LOG_ERROR.search(line) or "UserWarning" in line or "warnings.warn" in line:
            continue
        shape = _LOG_NUMBERS.sub("#", line.split("] ", 1)[-1])[:200]
        counts[shape] += 1
        example.setdefault(shape, line[:400])
    return {
        "lines": len(lines),
        "matching": sum(counts.values()),
        "patterns": [
            {"count": n, "example": example[shape]} for shape, n in counts.most_common(limit)
        ],
    }


# --------------------------------------------------------------------------------------------
# Traffic


@dataclass
class Paragraph:
    text: str
    example: int
    chunk_id: str | None = None


class Traffic:
    """The request generators; shared state (registered chunks, first outputs) under a lock."""

    def __init__(self, url: str, examples: list[HotpotQAExample], tokenizer: Any, args) -> None:
        self.url = url
        self.args = args
        self.examples = examples
        self.tokenizer = tokenizer
        self.lock = threading.Lock()
        self.paragraphs: list[Paragraph] = [
            Paragraph(doc, i) for i, ex in enumerate(examples) for doc in ex.documents
        ]
        self.next_new = 0  # index into self.paragraphs of the next never-registered paragraph
        self.selector_turn = 0
        self.first_outputs: dict[str, list[int]] = {}
        self.output_checks: dict[str, Counter[str]] = defaultdict(Counter)
        self.fusion: dict[str, Counter[str]] = defaultdict(Counter)
        self.cached_tokens: dict[str, Counter[str]] = defaultdict(Counter)
        self.bad_cases: dict[str, Counter[str]] = defaultdict(Counter)
        self.shared_prompts = [self._shared_prompt(topic) for topic in TOPICS]
        self.long_prompts = [self._long_prompt(seed) for seed in range(12)]

    # -- prompts ------------------------------------------------------------------------------

    def _shared_prompt(self, topic: str) -> str:
        body = " ".join(
            f"Record {i} on {topic}: entry {i * 7 % 11} was filed in {1900 + i}." for i in range(12)
        )
        return f"{SYSTEM}\n{body}\nQuestion: what are these records about?\nAnswer:"

    def _long_prompt(self, seed: int) -> str:
        rng = random.Random(1000 + seed)
        target = rng.randint(900, 2000)
        docs: list[str] = []
        tokens = len(self.tokenizer.encode(SYSTEM))
        pool = [d for ex in rng.sample(self.examples[-40:], 6) for d in ex.documents]
        for doc in pool:
            docs.append(doc)
            tokens += len(self.tokenizer.encode(doc, add_special_tokens=False))
            if tokens >= target:
                break
        question = rng.choice(self.examples).question
        return f"{SYSTEM}\nDocuments:\n" + "\n\n".join(docs) + f"\n\nQuestion: {question}\nAnswer:"

    def fused_prompt(self, rng: random.Random) -> str | None:
        with self.lock:
            ready: dict[int, list[Paragraph]] = defaultdict(list)
            for p in self.paragraphs[: self.next_new]:
                if p.chunk_id is not None:
                    ready[p.example].append(p)
            candidates = sorted(e for e, ps in ready.items() if len(ps) >= 2)
        if not candidates:
            return None
        # Mostly the recently registered examples, sometimes an older one (LRU-evicted chunks).
        example = rng.choice(candidates[-6:] if rng.random() < 0.8 else candidates)
        docs = [p.text for p in ready[example]]
        k = min(len(docs), rng.choice((2, 2, 3, 3, 4, 6)))
        docs = rng.sample(docs, k)
        question = self.examples[example].question
        return "Documents:\n" + "\n\n".join(docs) + f"\n\nQuestion: {question}\nAnswer:"

    def next_selector(self) -> tuple[str, float]:
        with self.lock:
            selector = SELECTORS[self.selector_turn % len(SELECTORS)]
            self.selector_turn += 1
        return selector

    # -- HTTP ---------------------------------------------------------------------------------

    def call(
        self, method: str, path: str, timeout: float, **kwargs: Any
    ) -> tuple[int | None, str, Any]:
        """One request; (status, class, JSON body or None)."""
        try:
            response = requests.request(method, self.url + path, timeout=(10, timeout), **kwargs)
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

    def generate_body(
        self, rng: random.Random, prompt: str, custom: dict[str, Any] | None, **extra: Any
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"max_new_tokens": rng.choice((4, 8, 16)), "temperature": 0}
        if custom:
            params["custom_params"] = custom
        return {"text": prompt, "sampling_params": params, **extra}

    def stream(
        self, body: dict[str, Any], abort_after: int | None
    ) -> tuple[int | None, str, dict[str, Any]]:
        """A streaming /generate; with `abort_after`, close the connection after that many chunks."""
        chunks = 0
        detail: dict[str, Any] = {}
        try:
            with requests.post(
                self.url + "/generate",
                json={**body, "stream": True},
                stream=True,
                timeout=(10, self.args.request_timeout_s),
            ) as response:
                if response.status_code != 200:
                    return response.status_code, status_class(response.status_code), detail
                for line in response.iter_lines():
                    if not line or not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    try:
                        item = json.loads(data)
                    except ValueError:
                        detail["bad_chunk"] = data[:200].decode(errors="replace")
                        return 200, "stream_error", detail
                    if isinstance(item, dict) and "error" in item:
                        detail["error"] = str(item["error"])[:300]
                        return 200, "stream_error", detail
                    chunks += 1
                    if abort_after is not None and chunks >= abort_after:
                        detail["chunks"] = chunks
                        return 200, "aborted", detail  # leaving `with` closes the connection
        except requests.Timeout:
            return None, "timeout", {"chunks": chunks}
        except requests.ConnectionError:
            return None, "conn_error", {"chunks": chunks}
        detail["chunks"] = chunks
        return 200, "2xx", detail

    def note_generate(self, kind: str, prompt: str, body: Any, compare: bool) -> dict[str, Any]:
        """Tier hits and fusion outcome of a /generate answer; first vs later greedy outputs."""
        detail: dict[str, Any] = {}
        if not isinstance(body, dict):
            return detail
        meta = body.get("meta_info") or {}
        detail["prompt_tokens"] = meta.get("prompt_tokens")
        details = meta.get("cached_tokens_details") or {}
        with self.lock:
            for tier, n in details.items():
                if isinstance(n, int | float):
                    self.cached_tokens[kind][tier] += n
            self.cached_tokens[kind]["prompt"] += meta.get("prompt_tokens") or 0
            self.cached_tokens[kind]["cached"] += meta.get("cached_tokens") or 0
            if compare and isinstance(body.get("output_ids"), list):
                # Informative only: greedy fp32 outputs can differ with the batch they ran in.
                first = self.first_outputs.setdefault(prompt, body["output_ids"])
                n = min(len(first), len(body["output_ids"]))
                same = first[:n] == body["output_ids"][:n]
                self.output_checks[kind]["compared"] += 1
                self.output_checks[kind]["same" if same else "changed"] += 1
        fusion = [f for f in meta.get("hicache_ext_fusion") or [] if isinstance(f, dict)]
        if fusion:
            detail["fused"] = bool(fusion[0].get("fused"))
            detail["chunks_hit"] = fusion[0].get("chunks_hit")
        return detail

    # -- request kinds ------------------------------------------------------------------------

    def resolve(self, kind: str) -> str:
        """`register` instead of a kind that needs registered chunks while there are none."""
        if kind not in ("fused", "delete"):
            return kind
        with self.lock:
            ready = Counter(p.example for p in self.paragraphs[: self.next_new] if p.chunk_id)
        enough = max(ready.values(), default=0) >= (2 if kind == "fused" else 1)
        return kind if enough else "register"

    def run(self, kind: str, rng: random.Random) -> tuple[int | None, str, dict[str, Any]]:
        return getattr(self, "do_" + kind)(rng)

    def do_fused(self, rng: random.Random) -> tuple[int | None, str, dict[str, Any]]:
        prompt = self.fused_prompt(rng)
        if prompt is None:
            return self.do_register(rng)
        selector, ratio = self.next_selector()
        custom = {"fusion": True, "fusion_selector": selector, "fusion_recompute_ratio": ratio}
        status, cls, body = self.call(
            "POST",
            "/generate",
            self.args.request_timeout_s,
            json=self.generate_body(rng, prompt, custom),
        )
        detail = {"selector": selector}
        if cls == "2xx":
            detail.update(self.note_generate("fused", prompt, body, compare=False))
            with self.lock:
                self.fusion[selector]["requests"] += 1
                outcome = "fused" if detail.get("fused") else "fallback"
                self.fusion[selector][outcome] += 1
        return status, cls, detail

    def _normal(
        self, kind: str, prompt: str, rng: random.Random
    ) -> tuple[int | None, str, dict[str, Any]]:
        status, cls, body = self.call(
            "POST",
            "/generate",
            self.args.request_timeout_s,
            json=self.generate_body(rng, prompt, None),
        )
        detail = self.note_generate(kind, prompt, body, compare=True) if cls == "2xx" else {}
        return status, cls, detail

    def probe(self, prompt: str) -> tuple[int | None, str, dict[str, Any]]:
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        status, cls, response = self.call(
            "POST", "/generate", self.args.request_timeout_s, json=body
        )
        detail: dict[str, Any] = {}
        if cls == "2xx" and isinstance(response, dict):
            meta = response.get("meta_info") or {}
            detail["cached_tokens"] = meta.get("cached_tokens")
            detail["storage_tokens"] = (meta.get("cached_tokens_details") or {}).get("storage")
            detail["prompt_tokens"] = meta.get("prompt_tokens")
        return status, cls, detail

    def do_normal_shared(self, rng: random.Random) -> tuple[int | None, str, dict[str, Any]]:
        return self._normal("normal_shared", rng.choice(self.shared_prompts), rng)

    def do_normal_long(self, rng: random.Random) -> tuple[int | None, str, dict[str, Any]]:
        return self._normal("normal_long", rng.choice(self.long_prompts), rng)

    def _any_prompt(self, rng: random.Random) -> tuple[str, dict[str, Any] | None]:
        if rng.random() < 0.5:
            prompt = self.fused_prompt(rng)
            if prompt is not None:
                selector, ratio = self.next_selector()
                return prompt, {
                    "fusion": True,
                    "fusion_selector": selector,
                    "fusion_recompute_ratio": ratio,
                }
        prompts = self.shared_prompts if rng.random() < 0.7 else self.long_prompts
        return rng.choice(prompts), None

    def do_stream(self, rng: random.Random) -> tuple[int | None, str, dict[str, Any]]:
        prompt, custom = self._any_prompt(rng)
        status, cls, detail = self.stream(self.generate_body(rng, prompt, custom), None)
        detail["fusion_requested"] = custom is not None
        return status, cls, detail

    def do_abort(self, rng: random.Random) -> tuple[int | None, str, dict[str, Any]]:
        prompt, custom = self._any_prompt(rng)
        body = self.generate_body(rng, prompt, custom)
        body["sampling_params"]["max_new_tokens"] = 64
        status, cls, detail = self.stream(body, abort_after=rng.randint(1, 3))
        detail["fusion_requested"] = custom is not None
        return status, cls, detail

    def do_logprob(self, rng: random.Random) -> tuple[int | None, str, dict[str, Any]]:
        prompt, custom = self._any_prompt(rng)
        body = self.generate_body(
            rng, prompt, custom, return_logprob=True, top_logprobs_num=rng.choice((0, 2))
        )
        status, cls, response = self.call(
            "POST", "/generate", self.args.request_timeout_s, json=body
        )
        detail: dict[str, Any] = {"fusion_requested": custom is not None}
        if cls == "2xx":
            meta = (response or {}).get("meta_info") or {}
            detail["output_logprobs"] = len(meta.get("output_token_logprobs") or [])
        return status, cls, detail

    def do_register(self, rng: random.Random) -> tuple[int | None, str, dict[str, Any]]:
        with self.lock:
            registered = [p for p in self.paragraphs[: self.next_new] if p.chunk_id]
            fresh = self.next_new < len(self.paragraphs) and (
                not registered or rng.random() < self.args.new_chunk_share
            )
            if fresh:
                paragraph = self.paragraphs[self.next_new]
                self.next_new += 1
            else:
                paragraph = rng.choice(registered)
        status, cls, body = self.call(
            "POST", "/chunks", self.args.admin_timeout_s, json={"text": paragraph.text}
        )
        detail: dict[str, Any] = {"new": fresh}
        if cls == "2xx" and isinstance(body, dict):
            with self.lock:
                paragraph.chunk_id = body.get("id")
            detail["created"] = body.get("created")
            detail["num_tokens"] = body.get("num_tokens")
        return status, cls, detail

    def do_delete(self, rng: random.Random) -> tuple[int | None, str, dict[str, Any]]:
        with self.lock:
            registered = [p for p in self.paragraphs[: self.next_new] if p.chunk_id]
        if not registered:
            return self.do_register(rng)
        paragraph = rng.choice(registered)
        status, cls, _ = self.call(
            "DELETE", f"/chunks/{paragraph.chunk_id}", self.args.admin_timeout_s
        )
        if status == 200:
            with self.lock:
                paragraph.chunk_id = None  # a later repeat registration brings it back
        return status, cls, {}

    def do_list(self, rng: random.Random) -> tuple[int | None, str, dict[str, Any]]:
        status, cls, _ = self.call("GET", "/chunks", self.args.admin_timeout_s)
        return status, cls, {}

    def do_storage(self, rng: random.Random) -> tuple[int | None, str, dict[str, Any]]:
        status, cls, _ = self.call(
            "GET", "/hicache_ext/storage", self.args.admin_timeout_s, params={"pages": 5}
        )
        return status, cls, {}

    def bad_requests(self) -> list[tuple[str, str, str, dict[str, Any]]]:
        def gen(custom: dict[str, Any], **params: Any) -> dict[str, Any]:
            return {
                "json": {
                    "text": "Is the server still serving?",
                    "sampling_params": {"max_new_tokens": 2, "custom_params": custom, **params},
                }
            }

        return [
            ("chunk_empty_object", "POST", "/chunks", {"json": {}}),
            ("chunk_empty_text", "POST", "/chunks", {"json": {"text": "  "}}),
            ("chunk_text_and_ids", "POST", "/chunks", {"json": {"text": "a", "input_ids": [1]}}),
            ("chunk_negative_id", "POST", "/chunks", {"json": {"input_ids": [-1]}}),
            ("chunk_ids_not_ints", "POST", "/chunks", {"json": {"input_ids": ["x"]}}),
            ("chunk_not_json", "POST", "/chunks", {"data": b"{not json"}),
            ("chunk_unknown_get", "GET", f"/chunks/{_UNKNOWN_ID}", {}),
            ("chunk_unknown_delete", "DELETE", f"/chunks/{_UNKNOWN_ID}", {}),
            ("chunk_probe_half", "GET", f"/chunks/{_UNKNOWN_ID}?probe_layer=0", {}),
            ("fusion_ratio_high", "POST", "/generate", gen({"fusion_recompute_ratio": 1.5})),
            ("fusion_ratio_negative", "POST", "/generate", gen({"fusion_recompute_ratio": -0.1})),
            ("fusion_selector_unknown", "POST", "/generate", gen({"fusion_selector": "magic"})),
            ("fusion_selector_list", "POST", "/generate", gen({"fusion_selector": ["a3"]})),
            ("fusion_flag_string", "POST", "/generate", gen({"fusion": "yes"})),
            ("fusion_sink_negative", "POST", "/generate", gen({"fusion_sink_tokens": -4})),
            ("generate_max_tokens_negative", "POST", "/generate", gen({}, max_new_tokens=-1)),
            ("ttl_negative", "POST", "/hicache_ext/storage/ttl", {"json": {"default_ttl_s": -1}}),
            ("ttl_unknown_key", "POST", "/hicache_ext/storage/ttl", {"json": {"foo": 1}}),
            ("ttl_not_object", "POST", "/hicache_ext/storage/ttl", {"json": [1, 2]}),
            ("storage_pages_negative", "GET", "/hicache_ext/storage?pages=-1", {}),
        ]

    def do_bad(self, rng: random.Random) -> tuple[int | None, str, dict[str, Any]]:
        name, method, path, kwargs = rng.choice(self.bad_requests())
        status, cls, _ = self.call(method, path, self.args.admin_timeout_s, **kwargs)
        with self.lock:
            self.bad_cases[name][str(status if status is not None else cls)] += 1
        return status, cls, {"case": name}


# --------------------------------------------------------------------------------------------
# The run


class Soak:
    def __init__(
        self, args, config: ServerConfig, log_path: Path, disk_dir: Path, traffic: Traffic
    ) -> None:
        self.args = args
        self.config = config
        self.log_path = log_path
        self.disk_dir = disk_dir
        self.traffic = traffic
        self.duration_s = args.minutes * 60.0
        self.stop = threading.Event()
        self.gate = threading.Event()  # set: workers may start requests
        self.gate.set()
        self.inflight = 0
        self.inflight_lock = threading.Lock()
        self.recorder: Recorder | None = None
        self.rss_samples: list[tuple[float, int, dict[int, int]]] = []
        self.health_failures: list[dict[str, Any]] = []
        self.crash: dict[str, Any] | None = None
        self.fault: dict[str, Any] = {}
        self.storage: dict[str, Any] = {}
        self.proc_names: dict[int, str] = {}
        self.storage_series: list[dict[str, Any]] = []
        self.chunk_series: list[dict[str, Any]] = []
        self.workers_done = threading.Event()
        self.traffic_end_s: float | None = None

    # -- threads ------------------------------------------------------------------------------

    def worker(self, index: int) -> None:
        assert self.recorder is not None
        rng = random.Random(self.args.seed * 1000 + index)
        kinds = list(WEIGHTS)
        weights = [WEIGHTS[k] for k in kinds]
        while not self.stop.is_set() and self.recorder.now() < self.duration_s:
            if not self.gate.wait(timeout=1.0):
                continue
            with self.inflight_lock:  # the fault holds new requests under this lock
                if not self.gate.is_set():
                    continue
                self.inflight += 1
            kind = self.traffic.resolve(rng.choices(kinds, weights)[0])
            self.timed(kind, lambda kind=kind: self.traffic.run(kind, rng), counted=True)

    def timed(self, kind: str, call, counted: bool = False) -> Any:
        """Run and record one request; `counted`: the caller has already added it in flight."""
        assert self.recorder is not None
        if not counted:
            with self.inflight_lock:
                self.inflight += 1
        start = time.monotonic()
        t = self.recorder.now()
        try:
            status, cls, detail = call()
        except Exception as error:  # a bug of this script must not pass as a server error
            status, cls, detail = None, "client_error", {"client_exception": repr(error)[:300]}
        finally:
            with self.inflight_lock:
                self.inflight -= 1
        self.recorder.add(Record(t, kind, status, cls, time.monotonic() - start, detail))
        return status, cls, detail

    def admin(self) -> None:
        assert self.recorder is not None
        fault_at = self.duration_s * self.args.fault_at
        next_replan = self.args.replan_every_s
        next_read = self.args.read_every_s
        turn = 0
        while not self.stop.is_set():
            now = self.recorder.now()
            if now >= self.duration_s:
                break
            if not self.fault and now >= fault_at:
                self.inject_fault()
            elif now >= next_replan:
                self.timed("ttl_replan", self.replan)
                next_replan = now + self.args.replan_every_s
            elif now >= next_read:
                if turn % 2 == 0:
                    self.timed("list_periodic", self.list_chunks)
                else:
                    self.timed("storage_periodic", self.read_storage)
                turn += 1
                next_read = now + self.args.read_every_s
            if self.fault and "after_fault_60s" not in self.storage and now >= self.fault["t"] + 60:
                self.storage["after_fault_60s"] = self.storage_status()
            self.stop.wait(0.5)

    def replan(self) -> tuple[int | None, str, dict[str, Any]]:
        status, cls, body = self.traffic.call(
            "POST", "/hicache_ext/storage/ttl", self.args.admin_timeout_s, json={"replan": True}
        )
        detail: dict[str, Any] = {}
        if cls == "2xx" and isinstance(body, dict):
            detail["replanned"] = body.get("replanned")
            plan = (body.get("ttl") or {}).get("last_plan") or {}
            detail["groups"] = plan.get("groups") if isinstance(plan, dict) else None
        return status, cls, detail

    def list_chunks(self) -> tuple[int | None, str, dict[str, Any]]:
        status, cls, body = self.traffic.call("GET", "/chunks", self.args.admin_timeout_s)
        detail: dict[str, Any] = {}
        if cls == "2xx" and isinstance(body, dict):
            chunks = body.get("chunks")
            detail["chunks"] = len(chunks) if isinstance(chunks, list | dict) else None
            self.chunk_series.append({"t": round(self.recorder.now(), 1), **detail})
        return status, cls, detail

    def read_storage(self) -> tuple[int | None, str, dict[str, Any]]:
        status, cls, body = self.traffic.call(
            "GET", "/hicache_ext/storage", self.args.admin_timeout_s
        )
        if cls == "2xx" and isinstance(body, dict):
            disk = body.get("disk") or {}
            self.storage_series.append(
                {"t": round(self.recorder.now(), 1)} | {k: disk.get(k) for k in STORAGE_SERIES_KEYS}
            )
        return status, cls, {}

    def monitor(self, server: psutil.Process) -> None:
        assert self.recorder is not None
        pgid = os.getpgid(server.pid)
        failures_in_row = 0
        while not self.stop.is_set():
            t = self.recorder.now()
            rss = group_rss(pgid)
            for pid in rss:
                if pid not in self.proc_names:
                    with contextlib.suppress(psutil.Error):
                        self.proc_names[pid] = " ".join(psutil.Process(pid).cmdline()[:3])[:120]
            if not process_alive(server):
                self.declare_crash(t, f"server process {server.pid} exited")
                return
            self.rss_samples.append((t, sum(rss.values()), rss))
            try:
                code = requests.get(self.config.url + "/health", timeout=10).status_code
                error = None if code == 200 else f"HTTP {code}"
            except requests.RequestException as err:
                error = type(err).__name__
            if error is None:
                failures_in_row = 0
            else:
                failures_in_row += 1
                self.health_failures.append({"t": t, "error": error})
                if failures_in_row >= 3:
                    self.declare_crash(t, f"/health failed 3 times in a row (last: {error})")
                    return
            if t >= self.duration_s and self.workers_done.is_set():
                return
            self.stop.wait(self.args.sample_s)

    def declare_crash(self, t: float, reason: str) -> None:
        self.crash = {"t": t, "reason": reason, "log_tail": log_tail(self.log_path)}
        print(f"[{t:7.1f}s] CRASH: {reason}", flush=True)
        self.stop.set()

    # -- the fault ----------------------------------------------------------------------------

    def storage_status(self) -> dict[str, Any] | None:
        status, cls, body = self.traffic.call(
            "GET", "/hicache_ext/storage", self.args.admin_timeout_s
        )
        if cls != "2xx" or not isinstance(body, dict):
            return {"http_status": status, "class": cls}
        return {key: body.get(key) for key in ("root", "disk", "errors", "by_group")} | {
            "ttl_last_plan": (body.get("ttl") or {}).get("last_plan"),
            "hit_ratio": (body.get("ttl") or {}).get("hit_ratio"),
        }

    def page_listing(self) -> list[dict[str, Any]]:
        _, cls, body = self.traffic.call(
            "GET", "/hicache_ext/storage", self.args.admin_timeout_s, params={"pages": 100_000}
        )
        pages = body.get("pages") if cls == "2xx" and isinstance(body, dict) else None
        return [p for p in pages or [] if isinstance(p, dict)]

    def flush(self) -> bool:
        for _ in range(60):  # refused while requests are still running (aborts wind down)
            _, cls, _ = self.traffic.call("POST", "/flush_cache", self.args.admin_timeout_s)
            if cls == "2xx":
                return True
            time.sleep(1.0)
        return False

    def probe(self, prompt: str, step: str) -> dict[str, Any]:
        _, cls, detail = self.timed("fault_probe", lambda: self.traffic.probe(prompt))
        return {"step": step, "class": cls, **detail}

    def locate(self, prompt: str, step: str, probes: list[dict[str, Any]]) -> list[str]:
        """Keys of the disk pages that `prompt` reads, in prefix order: every read sets the
        page's last access, one page after the other."""
        since = time.time() - 0.5
        probes.append(self.probe(prompt, step))
        read = [p for p in self.page_listing() if p.get("last_access", 0) >= since]
        return [p["key"] for p in sorted(read, key=lambda p: p["last_access"])]

    def inject_fault(self) -> None:
        """Hold new requests and damage the disk tier from outside the server, then resume.

        Deterministic, so that the damage is read while the pages are live: after /flush_cache
        (device and host; the disk stays) shared-prefix prompt A, then prompt B (same system
        prefix, other records) are sent alone, and the disk pages each one read or wrote are
        found in the store's page list (by their last access, which also gives their order).
        Then: flip payload bytes of a page in the middle of A's pages and of
        `--corrupt-pages - 1` other hot pages, delete the page subdirectory of a page in the
        second half of B's own pages, and send B, then A, each alone after a flush: each should
        read its prefix from disk up to the damaged page and recompute the rest (the store
        counts corrupt_pages / io_errors). Then traffic resumes.
        """
        assert self.recorder is not None
        t = self.recorder.now()
        self.fault = {"t": t}
        print(f"[{t:7.1f}s] fault: holding new requests", flush=True)
        with self.inflight_lock:
            self.gate.clear()
        drain_deadline = time.monotonic() + self.args.request_timeout_s + 30
        while time.monotonic() < drain_deadline and not self.stop.is_set():
            with self.inflight_lock:
                if self.inflight == 0:
                    break
            time.sleep(0.2)
        self.fault["drained_s"] = self.recorder.now() - t
        self.storage["before_fault"] = self.storage_status()
        root = self.disk_dir  # only files under our own temp disk dir are touched
        prompt_a, prompt_b = self.traffic.shared_prompts[:2]
        probes: list[dict[str, Any]] = []
        flushed = [self.flush()]
        run_a = self.locate(prompt_a, "locate A", probes)
        run_b = self.locate(prompt_b, "locate B", probes)
        run_b = [k for k in run_b if k not in run_a]
        path_of = key_paths(root)
        files = fault_targets(root, self.page_listing(), time.time())
        in_runs = {path_of.get(k) for k in run_a + run_b}
        corrupt = (
            [path_of[run_a[len(run_a) // 2]]] if run_a and run_a[len(run_a) // 2] in path_of else []
        )
        corrupt += [f for f in files if f not in in_runs][
            : max(0, self.args.corrupt_pages - len(corrupt))
        ]
        corrupted = []
        for path in corrupt:
            with contextlib.suppress(OSError), open(path, "r+b") as handle:
                size = handle.seek(0, os.SEEK_END)
                for k in range(16):  # payload bytes near the end (the header is at the start)
                    offset = size - 1 - k * 997
                    if offset < size // 2:
                        break
                    handle.seek(offset)
                    byte = handle.read(1)
                    handle.seek(offset)
                    handle.write(bytes([byte[0] ^ 0xFF]))
                corrupted.append(str(path.relative_to(root)))
        corrupted_dirs = {path.parent for path in corrupt}
        candidates = [path_of.get(k) for k in run_b[len(run_b) // 2 :]] + files
        deleted_dir, deleted_files = None, 0
        for path in candidates:
            if path is not None and path.parent not in corrupted_dirs and path.parent.is_dir():
                deleted_files = sum(1 for _ in path.parent.glob("*.page"))
                shutil.rmtree(path.parent, ignore_errors=True)
                deleted_dir = str(path.parent.relative_to(root))
                break
        # Each alone after a flush: a storage prefetch needs a long enough miss (SGLang's
        # prefetch threshold), so B must not find the shared system prefix on the device.
        flushed.append(self.flush())
        probes.append(self.probe(prompt_b, "after fault B"))
        flushed.append(self.flush())
        probes.append(self.probe(prompt_a, "after fault A"))
        self.fault.update(
            pages_on_disk=len(files),
            disk_run_pages={"A": len(run_a), "B": len(run_b)},
            corrupted_files=corrupted,
            deleted_dir=deleted_dir,
            deleted_dir_pages=deleted_files,
            flushed_device_and_host=flushed,
            probes=probes,
        )
        after = self.storage_status()
        self.storage["after_probes"] = after
        self.fault["held_s"] = self.recorder.now() - t
        self.gate.set()
        disk = (after or {}).get("disk") or {}
        print(
            f"[{self.recorder.now():7.1f}s] fault: disk runs A {len(run_a)} / B {len(run_b)} "
            f"pages; {len(corrupted)} of {len(files)} page files corrupted, {deleted_dir} deleted "
            f"({deleted_files} pages); probes after: storage tokens "
            f"{[p.get('storage_tokens') for p in probes[-2:]]}; corrupt_pages "
            f"{disk.get('corrupt_pages')}, io_errors {disk.get('io_errors')}; resumed after "
            f"{self.fault['held_s']:.1f}s",
            flush=True,
        )

    # -- main ---------------------------------------------------------------------------------

    def run(self, server: psutil.Process) -> None:
        self.recorder = Recorder(time.monotonic())
        monitor = threading.Thread(target=self.monitor, args=(server,), daemon=True)
        admin = threading.Thread(target=self.admin, daemon=True)
        workers = [
            threading.Thread(target=self.worker, args=(i,), daemon=True)
            for i in range(self.args.workers)
        ]
        monitor.start()
        # A few chunks registered before the mix starts, so fused requests have something.
        for _ in range(self.args.initial_chunks):
            if self.stop.is_set():
                break
            self.timed("register", lambda: self.traffic.do_register(random.Random(0)))
        admin.start()
        for thread in workers:
            thread.start()
        last_report = 0.0
        while any(t.is_alive() for t in workers):
            time.sleep(1.0)
            now = self.recorder.now()
            if self.crash is not None and now > self.crash["t"] + 30:
                break  # after a crash, do not wait for requests stuck until their timeout
            if now - last_report >= self.args.report_every_s:
                last_report = now
                self.progress(now)
        self.traffic_end_s = self.recorder.now()
        self.workers_done.set()
        self.stop.set()
        admin.join(timeout=self.args.admin_timeout_s + 5)
        monitor.join(timeout=30)
        if self.crash is None and process_alive(server):
            self.storage["end"] = self.storage_status()

    def progress(self, now: float) -> None:
        assert self.recorder is not None
        records = self.recorder.snapshot()
        classes = Counter(r.cls for r in records)
        rss = self.rss_samples[-1][1] / 2**20 if self.rss_samples else float("nan")
        print(
            f"[{now:7.1f}s] {len(records)} requests "
            + " ".join(f"{c}={n}" for c, n in sorted(classes.items()))
            + f"  RSS {rss:.0f} MiB",
            flush=True,
        )


# --------------------------------------------------------------------------------------------
# Summaries


def percentiles(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {
        "n": len(ordered),
        "p50_s": pct(0.5),
        "p90_s": pct(0.9),
        "p99_s": pct(0.99),
        "max_s": ordered[-1],
    }


def rss_growth(
    samples: list[tuple[float, int]], duration_s: float, held: tuple[float, float] | None = None
) -> dict[str, Any]:
    """Growth over the last min(10 min, half) of the run: point-to-point (the sample at the
    window start to the last one) and median-based (the median of the last `edge_s` over the
    median of the first `edge_s`, without the samples taken while the fault held the traffic)."""
    window_s = min(600.0, duration_s / 2)
    start = duration_s - window_s
    inside = [(t, b) for t, b in samples if start <= t <= duration_s + 1]
    edge_s = min(60.0, window_s / 3)
    report: dict[str, Any] = {"window_s": window_s, "window_start_s": start, "edge_s": edge_s}
    if len(inside) < 4:
        report["error"] = f"only {len(inside)} RSS samples in the window"
        return report
    first, last = inside[0][1], inside[-1][1]
    loaded = [(t, b) for t, b in inside if held is None or not held[0] <= t <= held[1]]
    head = [b for t, b in loaded if t <= loaded[0][0] + edge_s]
    tail = [b for t, b in loaded if t >= loaded[-1][0] - edge_s]
    report.update(
        bytes_at_window_start=first,
        bytes_at_end=last,
        growth=(last - first) / first,
        median_first_edge_bytes=statistics.median(head),
        median_last_edge_bytes=statistics.median(tail),
        growth_median=(statistics.median(tail) - statistics.median(head)) / statistics.median(head),
        max_bytes_in_window=max(b for _, b in inside),
    )
    return report


def flat_counters(status: dict[str, Any] | None) -> dict[str, float]:
    """The numeric counters of a storage status (`disk` and `errors`), flattened."""
    out: dict[str, float] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[prefix] = value

    for section in ("disk", "errors"):
        walk(section, (status or {}).get(section))
    return out


def counter_changes(
    before: dict[str, Any] | None, after: dict[str, Any] | None
) -> dict[str, list[float]]:
    """Counters that differ: name -> [before, after]."""
    old, new = flat_counters(before), flat_counters(after)
    return {k: [old.get(k), new[k]] for k in sorted(new) if old.get(k) != new[k]}


def summarise(soak: Soak, args, config: ServerConfig, extra: dict[str, Any]) -> dict[str, Any]:
    assert soak.recorder is not None
    records = soak.recorder.snapshot()
    duration = soak.duration_s
    by_kind: dict[str, Counter[str]] = defaultdict(Counter)
    codes: dict[str, Counter[str]] = defaultdict(Counter)
    for r in records:
        by_kind[r.kind][r.cls] += 1
        codes[r.kind][str(r.status)] += 1
    totals = Counter(r.cls for r in records)
    window_s = max(30.0, duration / 10)
    windows = []
    t0 = 0.0
    while t0 < max((r.t for r in records), default=0.0) + 1e-9:
        inside = [r for r in records if t0 <= r.t < t0 + window_s]
        kinds = sorted({r.kind for r in inside})
        windows.append(
            {
                "t0_s": t0,
                "t1_s": t0 + window_s,
                "requests": len(inside),
                "latency": {
                    k: percentiles([r.latency_s for r in inside if r.kind == k]) for k in kinds
                },
            }
        )
        t0 += window_s
    samples = [(t, b) for t, b, _ in soak.rss_samples]
    fault = soak.fault
    held = (fault["t"], fault["t"] + fault["held_s"]) if "held_s" in fault else None
    growth = rss_growth(samples, duration, held)
    failures = {c: totals.get(c, 0) for c in FAILURE_CLASSES}
    failing = [
        {"t": round(r.t, 2), "kind": r.kind, "status": r.status, "class": r.cls, **r.detail}
        for r in records
        if r.cls in FAILURE_CLASSES
    ][:50]
    rss_ok = "growth_median" in growth and growth["growth_median"] < args.max_rss_growth
    crashes = 1 if soak.crash else 0
    acceptance = {
        "crashes": {"value": crashes, "pass": crashes == 0},
        "rss_growth": {
            "value": growth.get("growth_median"),
            "point_to_point": growth.get("growth"),
            "limit": args.max_rss_growth,
            "window_s": growth["window_s"],
            "pass": bool(rss_ok),
        },
        "clear_status": {"failures": failures, "pass": sum(failures.values()) == 0},
    }
    acceptance["pass"] = all(v["pass"] for v in acceptance.values())
    before = soak.storage.get("before_fault") or {}
    probes = soak.storage.get("after_probes") or {}
    after = soak.storage.get("end") or soak.storage.get("after_fault_60s") or probes

    return {
        "benchmark": "soak",
        "model": SMOLLM2,
        "started_at": extra["started_at"],
        "config": {
            "server_command": config.command()[1:],
            "disk_tier": extra["disk_extra"],
            "workers": args.workers,
            "weights": WEIGHTS,
            "selectors": dict(SELECTORS),
            "request_timeout_s": args.request_timeout_s,
            "admin_timeout_s": args.admin_timeout_s,
            "replan_every_s": args.replan_every_s,
            "read_every_s": args.read_every_s,
            "sample_s": args.sample_s,
            "fault_at": args.fault_at,
            "flush_at_fault": args.flush_at_fault,
            "corrupt_pages": args.corrupt_pages,
            "seed": args.seed,
        },
        "duration_s": duration,
        "traffic_s": soak.traffic_end_s if soak.crash is None else soak.crash["t"],
        "requests": {
            "total": len(records),
            "by_class": dict(totals),
            "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
            "http_status_by_kind": {k: dict(v) for k, v in sorted(codes.items())},
            "first_failures": failing,
        },
        "fusion": {k: dict(v) for k, v in sorted(soak.traffic.fusion.items())},
        "cached_tokens": {k: dict(v) for k, v in sorted(soak.traffic.cached_tokens.items())},
        "normal_output_checks": {
            "note": "same prompt, greedy: later outputs vs the first (informative; batches differ)",
            **{k: dict(v) for k, v in soak.traffic.output_checks.items()},
        },
        "bad_requests": {k: dict(v) for k, v in sorted(soak.traffic.bad_cases.items())},
        "crashes": crashes,
        "crash": soak.crash,
        "health_failures": soak.health_failures,
        "rss": {
            "samples": [[round(t, 2), b] for t, b in samples],
            "processes": {str(pid): name for pid, name in soak.proc_names.items()},
            "last_sample_by_pid": {
                str(k): v for k, v in (soak.rss_samples[-1][2] if soak.rss_samples else {}).items()
            },
            "growth": growth,
        },
        "latency": {
            "overall": {
                k: percentiles([r.latency_s for r in records if r.kind == k])
                for k in sorted(by_kind)
            },
            "window_s": window_s,
            "windows": windows,
        },
        "fault": soak.fault,
        "storage": {
            "before_fault": before,
            "after_fault_60s": soak.storage.get("after_fault_60s"),
            "end": soak.storage.get("end"),
            "after_fault_probes": probes or None,
            "corrupt_pages_before": (before.get("disk") or {}).get("corrupt_pages"),
            "corrupt_pages_after": (after.get("disk") or {}).get("corrupt_pages"),
            "errors_before": before.get("errors"),
            "errors_after": after.get("errors"),
            "changed_by_fault_probes": counter_changes(before, probes),
            "changed_before_fault_to_end": counter_changes(before, after),
            "series": soak.storage_series,
        },
        "chunks_series": soak.chunk_series,
        "server_log": {"path": str(soak.log_path), **scan_log(soak.log_path)},
        "acceptance": acceptance,
        "records": [
            [round(r.t, 2), r.kind, r.status, r.cls, round(r.latency_s, 3)] for r in records
        ],
    }


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rss, ax_lat) = plt.subplots(2, 1, figsize=(12.5, 7.5), sharex=True)
    samples = report["rss"]["samples"]
    if samples:
        ax_rss.plot(
            [t / 60 for t, _ in samples], [b / 2**30 for _, b in samples], color="tab:blue", lw=1.2
        )
    growth = report["rss"]["growth"]
    ax_rss.axvspan(
        growth["window_start_s"] / 60,
        report["duration_s"] / 60,
        color="tab:green",
        alpha=0.08,
        label=f"growth window (median growth {growth.get('growth_median', float('nan')):+.2%})",
    )
    ax_rss.set_ylabel("server RSS, process group (GiB)")
    ax_rss.grid(alpha=0.3)
    records = report["records"]
    kinds = sorted({r[1] for r in records})
    cmap = plt.get_cmap("tab10")
    for i, kind in enumerate(kinds):
        ok = [(r[0] / 60, r[4]) for r in records if r[1] == kind and r[3] not in FAILURE_CLASSES]
        if ok:
            ax_lat.scatter(
                *zip(*ok, strict=True),
                s=9,
                color=cmap(i % 10),
                marker="o^sD"[i // 10 % 4],
                label=kind,
                alpha=0.7,
            )
    bad = [(r[0] / 60, r[4]) for r in records if r[3] in FAILURE_CLASSES]
    if bad:
        ax_lat.scatter(*zip(*bad, strict=True), s=30, marker="x", color="red", label="failure")
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("request latency (s), at request start")
    ax_lat.set_xlabel("minutes since start of traffic")
    ax_lat.grid(alpha=0.3)
    fault = report.get("fault") or {}
    for ax in (ax_rss, ax_lat):
        if "t" in fault:
            ax.axvline(fault["t"] / 60, color="red", ls="--", lw=1, label="storage fault")
            if "held_s" in fault:
                ax.axvspan(
                    fault["t"] / 60,
                    (fault["t"] + fault["held_s"]) / 60,
                    color="red",
                    alpha=0.08,
                    label="traffic held (fault)",
                )
        if report.get("crash"):
            ax.axvline(report["crash"]["t"] / 60, color="black", lw=2, label="crash")
    ax_rss.legend(loc="lower right", fontsize=8)
    ax_lat.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, markerscale=1.5)
    acc = report["acceptance"]
    fig.suptitle(
        f"soak {report['duration_s'] / 60:g} min, {report['requests']['total']} requests, "
        f"crashes {report['crashes']}, {'PASS' if acc['pass'] else 'FAIL'}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_summary(report: dict[str, Any]) -> None:
    req = report["requests"]
    print(
        f"\n{'kind':<18}"
        + "".join(f"{c:>13}" for c in STATUS_CLASSES)
        + f"{'p50 s':>9}{'p99 s':>9}"
    )
    for kind, counts in req["by_kind"].items():
        lat = report["latency"]["overall"][kind]
        print(
            f"{kind:<18}"
            + "".join(f"{counts.get(c, 0):>13}" for c in STATUS_CLASSES)
            + f"{lat.get('p50_s', float('nan')):>9.2f}{lat.get('p99_s', float('nan')):>9.2f}"
        )
    print(f"total {req['total']} requests: {req['by_class']}")
    if report["fusion"]:
        print("fusion:", {k: v for k, v in report["fusion"].items()})
    growth = report["rss"]["growth"]
    if "growth_median" in growth:
        print(
            f"RSS: window start {growth['bytes_at_window_start'] / 2**20:.0f} MiB, end "
            f"{growth['bytes_at_end'] / 2**20:.0f} MiB (point-to-point {growth['growth']:+.2%}); "
            f"medians {growth['median_first_edge_bytes'] / 2**20:.0f} -> "
            f"{growth['median_last_edge_bytes'] / 2**20:.0f} MiB ({growth['growth_median']:+.2%}) "
            f"over the last {growth['window_s'] / 60:.1f} min"
        )
    else:
        print(f"RSS: {growth.get('error')}")
    storage = report["storage"]
    print(
        f"disk tier corrupt_pages before fault / at the end: {storage['corrupt_pages_before']} "
        f"-> {storage['corrupt_pages_after']}"
    )
    wanted = ("corrupt_pages", "io_errors", "read_failures", "misses", "exceptions")
    changed = {
        k: v for k, v in storage["changed_by_fault_probes"].items() if any(w in k for w in wanted)
    }
    print(f"changed by the fault and its probes: {changed}")
    if report["crash"]:
        print(f"CRASH at {report['crash']['t']:.1f}s: {report['crash']['reason']}")
        print(report["crash"]["log_tail"])
    for failure in req["first_failures"][:10]:
        print("failure:", failure)
    print("\nacceptance:")
    for name, item in report["acceptance"].items():
        if name != "pass":
            print(
                f"  {name:<14} {'pass' if item['pass'] else 'FAIL'}  {json.dumps({k: v for k, v in item.items() if k != 'pass'})}"
            )
    print(f"  => {'PASS' if report['acceptance']['pass'] else 'FAIL'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "soak.json")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--admin-timeout-s", type=float, default=120.0)
    parser.add_argument("--replan-every-s", type=float, default=30.0)
    parser.add_argument("--read-every-s", type=float, default=10.0)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--report-every-s", type=float, default=30.0)
    parser.add_argument("--fault-at", type=float, default=0.5, help="fraction of the duration")
    parser.add_argument("--corrupt-pages", type=int, default=4)
    parser.add_argument(
        "--no-flush-at-fault",
        dest="flush_at_fault",
        action="store_false",
        help="do not /flush_cache after the fault (the damaged pages are then read only "
        "when their prefix leaves the host tier)",
    )
    parser.add_argument("--initial-chunks", type=int, default=8)
    parser.add_argument("--new-chunk-share", type=float, default=0.7)
    parser.add_argument("--max-total-tokens", type=int, default=4096)
    parser.add_argument("--chunked-prefill-size", type=int, default=512)
    parser.add_argument("--disk-capacity-mb", type=float, default=384.0)
    parser.add_argument(
        "--disk-budget-mb",
        type=float,
        default=None,
        help="average disk bytes the TTL plans may use (default: the capacity, so that bursts "
        "above the average are evicted while short-TTL groups expire)",
    )
    parser.add_argument("--ttl-period-s", type=float, default=60.0)
    parser.add_argument("--initial-ttl-s", type=float, default=120.0)
    parser.add_argument("--chunk-store-mb", type=float, default=256.0)
    parser.add_argument("--max-rss-growth", type=float, default=0.05)
    parser.add_argument(
        "--keep-workdir", action="store_true", help="keep the disk dir (the log is always kept)"
    )
    args = parser.parse_args()

    from transformers import AutoTokenizer

    model = prepare(SMOLLM2)
    tokenizer = AutoTokenizer.from_pretrained(model)
    examples = load_hotpotqa(400, seed=11)
    workdir = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    disk_extra = {
        **disk_tier_extra_config(str(workdir / "disk")),
        "capacity_bytes": args.disk_capacity_mb * 2**20,
        "disk_budget_bytes": (args.disk_budget_mb or args.disk_capacity_mb) * 2**20,
        "ttl_policy": "group",
        "ttl_groups": 4,
        "ttl_period_s": args.ttl_period_s,
        "initial_ttl_s": args.initial_ttl_s,
        "purge_interval_s": 1.0,
        "hicache_ext_config": {"chunk_store_bytes": int(args.chunk_store_mb * 2**20)},
    }
    config = ServerConfig(
        model_path=str(model),
        port=free_port(),
        max_total_tokens=args.max_total_tokens,
        hierarchical_cache=True,
        hicache_storage_backend="dynamic",
        extra_args=(
            "--hicache-ratio",
            "4",
            "--chunked-prefill-size",
            str(args.chunked_prefill_size),
            "--hicache-storage-backend-extra-config",
            json.dumps(disk_extra),
        ),
    )
    log_path = workdir / "server.log"
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    print(f"soak: {args.minutes:g} min, {args.workers} workers; server log {log_path}", flush=True)
    traffic = Traffic(config.url, examples, tokenizer, args)
    soak = Soak(args, config, log_path, workdir / "disk", traffic)
    try:
        with running_server(config, log_path=log_path):
            server = find_server_process(config.port)
            print(f"server up (pid {server.pid}); traffic starts", flush=True)
            soak.run(server)
    except ServerStartError as error:
        print(f"server did not start: {error}", file=sys.stderr)
        report = {
            "benchmark": "soak",
            "started_at": started_at,
            "crashes": 1,
            "startup_error": str(error),
            "acceptance": {"pass": False},
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        return 1
    finally:
        if not args.keep_workdir:
            shutil.rmtree(workdir / "disk", ignore_errors=True)
    report = summarise(soak, args, config, {"started_at": started_at, "disk_extra": disk_extra})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    png = args.out.with_suffix(".png")
    plot(report, png)
    print_summary(report)
    print(f"results: {args.out}, {png}; server log {log_path}")
    return 0 if report["acceptance"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
