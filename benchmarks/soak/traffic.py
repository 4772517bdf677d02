"""The workers' request kinds; shared state (registered chunks, first outputs) under a lock."""

from __future__ import annotations

import random
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

from benchmarks.soak.client import SoakClient
from benchmarks.soak.records import Outcome
from benchmarks.soak.soak_options import SoakOptions
from benchmarks.soak.workload import (
    BAD_REQUESTS,
    SELECTORS,
    TOPICS,
    fusion_params,
    long_prompt,
    shared_prompt,
)
from sglang_hicache_ext.evaluation.hotpotqa import HotpotQAExample


@dataclass
class Paragraph:
    text: str
    example: int
    chunk_id: str | None = None  # set while registered


class Traffic:
    """`run(kind, rng)` sends one request of that kind; counters of what the answers said."""

    def __init__(
        self,
        client: SoakClient,
        examples: list[HotpotQAExample],
        tokenizer: Any,
        args: SoakOptions,
    ) -> None:
        self.client = client
        self.args = args
        self.examples = examples
        self.lock = threading.Lock()
        self.paragraphs = [
            Paragraph(doc, i) for i, ex in enumerate(examples) for doc in ex.documents
        ]
        self.next_new = 0  # index into self.paragraphs of the next never-registered paragraph
        self.selector_turn = 0
        self.first_outputs: dict[str, list[int]] = {}
        self.output_checks: dict[str, Counter[str]] = defaultdict(Counter)
        self.fusion: dict[str, Counter[str]] = defaultdict(Counter)
        self.cached_tokens: dict[str, Counter[str]] = defaultdict(Counter)
        self.bad_cases: dict[str, Counter[str]] = defaultdict(Counter)
        self.shared_prompts = [shared_prompt(topic) for topic in TOPICS]
        self.long_prompts = [long_prompt(seed, examples, tokenizer) for seed in range(12)]

    # -- prompts ------------------------------------------------------------------------------

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

    def _any_prompt(self, rng: random.Random) -> tuple[str, dict[str, Any] | None]:
        """A fused prompt (half the time, when chunks are registered) or a normal one."""
        if rng.random() < 0.5:
            prompt = self.fused_prompt(rng)
            if prompt is not None:
                return prompt, fusion_params(*self.next_selector())
        prompts = self.shared_prompts if rng.random() < 0.7 else self.long_prompts
        return rng.choice(prompts), None

    @staticmethod
    def generate_body(
        rng: random.Random, prompt: str, custom: dict[str, Any] | None, **extra: Any
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"max_new_tokens": rng.choice((4, 8, 16)), "temperature": 0}
        if custom:
            params["custom_params"] = custom
        return {"text": prompt, "sampling_params": params, **extra}

    # -- answers ------------------------------------------------------------------------------

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

    def run(self, kind: str, rng: random.Random) -> Outcome:
        return getattr(self, "do_" + kind)(rng)

    def _generate(self, body: dict[str, Any]) -> tuple[int | None, str, Any]:
        return self.client.call("POST", "/generate", self.args.request_timeout_s, json=body)

    def do_fused(self, rng: random.Random) -> Outcome:
        prompt = self.fused_prompt(rng)
        if prompt is None:
            return self.do_register(rng)
        selector, ratio = self.next_selector()
        status, cls, body = self._generate(
            self.generate_body(rng, prompt, fusion_params(selector, ratio))
        )
        detail = {"selector": selector}
        if cls == "2xx":
            detail.update(self.note_generate("fused", prompt, body, compare=False))
            with self.lock:
                self.fusion[selector]["requests"] += 1
                outcome = "fused" if detail.get("fused") else "fallback"
                self.fusion[selector][outcome] += 1
        return status, cls, detail

    def _normal(self, kind: str, prompt: str, rng: random.Random) -> Outcome:
        status, cls, body = self._generate(self.generate_body(rng, prompt, None))
        detail = self.note_generate(kind, prompt, body, compare=True) if cls == "2xx" else {}
        return status, cls, detail

    def do_normal_shared(self, rng: random.Random) -> Outcome:
        return self._normal("normal_shared", rng.choice(self.shared_prompts), rng)

    def do_normal_long(self, rng: random.Random) -> Outcome:
        return self._normal("normal_long", rng.choice(self.long_prompts), rng)

    def do_stream(self, rng: random.Random) -> Outcome:
        prompt, custom = self._any_prompt(rng)
        body = self.generate_body(rng, prompt, custom)
        status, cls, detail = self.client.stream(body, None, self.args.request_timeout_s)
        detail["fusion_requested"] = custom is not None
        return status, cls, detail

    def do_abort(self, rng: random.Random) -> Outcome:
        prompt, custom = self._any_prompt(rng)
        body = self.generate_body(rng, prompt, custom)
        body["sampling_params"]["max_new_tokens"] = 64
        abort_after = rng.randint(1, 3)
        status, cls, detail = self.client.stream(body, abort_after, self.args.request_timeout_s)
        detail["fusion_requested"] = custom is not None
        return status, cls, detail

    def do_logprob(self, rng: random.Random) -> Outcome:
        prompt, custom = self._any_prompt(rng)
        body = self.generate_body(
            rng, prompt, custom, return_logprob=True, top_logprobs_num=rng.choice((0, 2))
        )
        status, cls, response = self._generate(body)
        detail: dict[str, Any] = {"fusion_requested": custom is not None}
        if cls == "2xx":
            meta = (response or {}).get("meta_info") or {}
            detail["output_logprobs"] = len(meta.get("output_token_logprobs") or [])
        return status, cls, detail

    def do_register(self, rng: random.Random) -> Outcome:
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
        status, cls, body = self.client.call(
            "POST", "/chunks", self.args.admin_timeout_s, json={"text": paragraph.text}
        )
        detail: dict[str, Any] = {"new": fresh}
        if cls == "2xx" and isinstance(body, dict):
            with self.lock:
                paragraph.chunk_id = body.get("id")
            detail["created"] = body.get("created")
            detail["num_tokens"] = body.get("num_tokens")
        return status, cls, detail

    def do_delete(self, rng: random.Random) -> Outcome:
        with self.lock:
            registered = [p for p in self.paragraphs[: self.next_new] if p.chunk_id]
        if not registered:
            return self.do_register(rng)
        paragraph = rng.choice(registered)
        status, cls, _ = self.client.call(
            "DELETE", f"/chunks/{paragraph.chunk_id}", self.args.admin_timeout_s
        )
        if status == 200:
            with self.lock:
                paragraph.chunk_id = None  # a later repeat registration brings it back
        return status, cls, {}

    def do_list(self, rng: random.Random) -> Outcome:
        status, cls, _ = self.client.call("GET", "/chunks", self.args.admin_timeout_s)
        return status, cls, {}

    def do_storage(self, rng: random.Random) -> Outcome:
        status, cls, _ = self.client.call(
            "GET", "/hicache_ext/storage", self.args.admin_timeout_s, params={"pages": 5}
        )
        return status, cls, {}

    def do_bad(self, rng: random.Random) -> Outcome:
        name, method, path, kwargs = rng.choice(BAD_REQUESTS)
        status, cls, _ = self.client.call(method, path, self.args.admin_timeout_s, **kwargs)
        with self.lock:
            self.bad_cases[name][str(status if status is not None else cls)] += 1
        return status, cls, {"case": name}
