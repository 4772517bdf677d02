"""One placement round, run by the launching process (`POST /hicache_ext/placement`, or every
`chunk_placement_interval_s` seconds): profile, then place (EvicPress §4.2 and Algorithm 1).

1. The scheduler reports every chunk the disk keeps: its forms' bytes and decode times, its
   reads since the last round (decayed) and the questions real requests asked with it.
2. **Profile** the chunks never profiled, or asked new questions since (never profiled first,
   then the most read; a few per round): each probe question (recorded real ones first, then templates) is answered
   greedily from the chunk's registered rows and from each more compressed form, through the
   real server (fused requests whose chunk rows pass through the form's codec); a form's
   quality is the mean token F1 of its answers against the registered rows' answers. The
   delays of the forms are the scheduler's measurements (decode times, the disk's read rate).
3. **Place**: Algorithm 1 over (alpha * quality - TTFT) * frequency, host memory and disk
   capacities, never below the quality floor; then the scheduler makes host memory hold each
   chunk's chosen form (the disk keeps the registered rows).

A probe that does not fuse (a fallback) leaves its chunk unprofiled for the round and is
counted: its compressed forms are not offered to the placement without a measured quality.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from sglang_hicache_ext.evaluation.answer_quality import mean_answer_f1
from sglang_hicache_ext.sglang_ext.chunk_fusion.placement_probe import (
    PROBE_FORM_PARAM,
    probing_placement,
)
from sglang_hicache_ext.sglang_ext.chunk_fusion.request_options import META_KEY
from sglang_hicache_ext.tuning.placement.host_forms import (
    ChunkForms,
    Timing,
    host_choices,
    plan_host_forms,
)
from sglang_hicache_ext.tuning.placement.probes import (
    ANSWER_TOKENS,
    PROBE_LEAD,
    TEMPLATE_QUESTIONS,
    probe_questions,
    template_question,
)

logger = logging.getLogger(__name__)

PROFILE_CHUNKS_PER_ROUND = 8  # default: bounds the probe load one round adds to the server
PROBES_IN_FLIGHT = 16
MAX_PROBE_FAILURES = 3  # rounds whose probes of a chunk fell back before it is left unprofiled

Control = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


class RoundRunning(RuntimeError):
    """Another placement round is in progress."""


@dataclasses.dataclass
class Profile:
    quality: dict[str, float]
    questions: tuple[tuple[int, ...], ...]  # the recorded questions it was probed with


class PlacementRounds:
    """The profiles and the last round's result (one per launching process)."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self.profiles: dict[str, Profile] = {}
        self.failures: Counter[str] = Counter()
        self.rounds = 0
        self.attempts = 0  # rounds started, failed ones too (the probes' lead text)
        self.counters: Counter[str] = Counter()
        self.last: dict[str, Any] | None = None

    def status(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "profiled_chunks": len(self.profiles),
            "counters": dict(self.counters),
            "last": self.last,
        }

    async def run(
        self,
        manager: Any,
        control: Control,
        alpha: float,
        quality_floor: float,
        profile_chunks: int = PROFILE_CHUNKS_PER_ROUND,
    ) -> dict[str, Any]:
        if self._lock.locked():
            raise RoundRunning("a placement round is running; retry when it is done")
        async with self._lock:
            began = time.perf_counter()
            self.attempts += 1
            inputs = await control("placement.inputs", {})
            chunks = inputs["chunks"]
            live = set(inputs["stored"])  # every chunk the disk holds, measured or not
            self.profiles = {k: p for k, p in self.profiles.items() if k in live}
            self.failures = Counter({k: n for k, n in self.failures.items() if k in live})
            profiled = await self._profile(manager, control, chunks, profile_chunks)
            timing = self._timing(inputs)
            result: dict[str, Any] = {
                "round": self.rounds + 1,
                "alpha": alpha,
                "quality_floor": quality_floor,
                "profiled": profiled,
                "probe_fallbacks": self.counters["probe_fallbacks"],
                "timing": None if timing is None else dataclasses.asdict(timing),
                "capacities": inputs["capacities"],
            }
            if timing is None:
                result["skipped"] = "no chunk to place yet (no disk read timed)"
            else:
                result.update(
                    await self._place(control, chunks, timing, inputs, alpha, quality_floor)
                )
            result["seconds"] = round(time.perf_counter() - began, 3)
            self.rounds += 1
            self.last = result
            logger.info(
                "chunk placement round %d: %d chunks profiled, outcomes %s, %.1f s",
                self.rounds,
                len(profiled),
                result.get("outcomes"),
                result["seconds"],
            )
            return result

    async def _place(
        self,
        control: Control,
        chunks: list[dict[str, Any]],
        timing: Timing,
        inputs: dict[str, Any],
        alpha: float,
        quality_floor: float,
    ) -> dict[str, Any]:
        forms = [
            ChunkForms(
                c["id"],
                c["num_tokens"],
                c["registered"],
                c["nbytes"],
                c["decode_s"],
                self.profiles[c["id"]].quality if c["id"] in self.profiles else {},
            )
            for c in chunks
        ]
        frequencies = {c["id"]: c["frequency"] for c in chunks}
        capacities = dict(inputs["capacities"])
        # Chunks only host memory holds (their disk write failed) keep their room.
        capacities["host"] = max(0, capacities["host"] - inputs["host_bytes_outside"])
        chosen, placement = plan_host_forms(
            forms, frequencies, timing, capacities, alpha, quality_floor
        )
        applied = await control("placement.apply", {"forms": chosen})
        return {
            "outcomes": applied["outcomes"],
            "planned_bytes": placement.used_bytes,
            "total_utility": placement.total_utility,
            "chunks": [
                {
                    "id": c["id"],
                    "frequency": c["frequency"],
                    "before": c["host_form"],
                    "host_form": chosen[c["id"]],
                    "tier": placement.chosen[c["id"]].tier,
                    "quality": self.profiles[c["id"]].quality if c["id"] in self.profiles else None,
                }
                for c in chunks
            ],
        }

    def _timing(self, inputs: dict[str, Any]) -> Timing | None:
        rate = inputs.get("disk_bytes_per_s")
        return Timing(float(rate)) if rate else None

    async def _profile(
        self, manager: Any, control: Control, chunks: list[dict[str, Any]], limit: int
    ) -> list[str]:
        tokenizer = manager.tokenizer
        if tokenizer is None:  # --skip-tokenizer-init: no templates, no lead text
            self.counters["unprofiled_no_tokenizer"] += 1
            return []

        def encode(text: str) -> list[int]:
            return list(tokenizer.encode(text, add_special_tokens=False))

        # A lead of its own per round: a probe that fell back to the normal prefill left its
        # prompt in the prefix tree, and the next round's probe must not reuse it.
        lead = encode(PROBE_LEAD.format(round=self.attempts))
        templates = [encode(template_question(q)) for q in TEMPLATE_QUESTIONS]
        due = [
            c
            for c in chunks
            if self.failures[c["id"]] < MAX_PROBE_FAILURES
            and (
                c["id"] not in self.profiles
                or self.profiles[c["id"]].questions != tuple(map(tuple, c["questions"]))
            )
        ]
        # Never profiled first (else a popular chunk asked new questions every round would
        # keep the others waiting), then the most read.
        due = sorted(due, key=lambda c: (c["id"] in self.profiles, -c["frequency"]))[:limit]
        if not due:
            return []
        tokens = (await control("placement.tokens", {"ids": [c["id"] for c in due]}))["tokens"]
        room = int(manager.context_len) - ANSWER_TOKENS - 1
        prompts: dict[str, list[list[int]]] = {}
        for chunk in due:
            ids = tokens.get(chunk["id"]) or []
            questions = probe_questions(chunk["questions"], templates)
            candidates = [lead + ids + q for q in questions]
            if ids and max(map(len, candidates)) <= room:
                prompts[chunk["id"]] = candidates
            else:  # no tokens (gone meanwhile), or too long for the model's context with a
                # question: never profiled
                self.counters["probe_too_long" if ids else "probe_no_tokens"] += 1
                self.failures[chunk["id"]] = MAX_PROBE_FAILURES
        due = [c for c in due if c["id"] in prompts]
        # Every probe of the round at once: the server batches their decodes.
        gate = asyncio.Semaphore(PROBES_IN_FLIGHT)

        async def answer(prompt: list[int], form: str) -> tuple[str, bool]:
            async with gate:
                custom = {"fusion": True, PROBE_FORM_PARAM: form}
                return await _generate(manager, prompt, custom, ANSWER_TOKENS)

        jobs = [
            (c["id"], form, answer(prompt, form))
            for c in due
            for form in host_choices(c["registered"])
            for prompt in prompts[c["id"]]
        ]
        replies = await asyncio.gather(*(job for _, _, job in jobs), return_exceptions=True)
        answers: dict[str, dict[str, list[str]]] = {c["id"]: {} for c in due}
        failed: set[str] = set()
        for (key, form, _), reply in zip(jobs, replies, strict=True):
            if isinstance(reply, BaseException):
                logger.error("placement probe of chunk %s as %s failed: %s", key[:12], form, reply)
                self.counters["probe_errors"] += 1
                failed.add(key)
                continue
            text, fused = reply
            answers[key].setdefault(form, []).append(text)
            if not fused:
                failed.add(key)
        self.counters["probe_fallbacks"] += len(failed)
        profiled = []
        for chunk in due:
            key = chunk["id"]
            if key in failed:  # a probe did not read the chunk: no quality measured
                self.failures[key] += 1
                continue
            reference = answers[key][chunk["registered"]]
            quality = {form: mean_answer_f1(reference, got) for form, got in answers[key].items()}
            self.profiles[key] = Profile(quality, tuple(map(tuple, chunk["questions"])))
            self.failures.pop(key, None)  # only failures in a row count
            profiled.append(key)
        return profiled


async def _generate(
    manager: Any, input_ids: list[int], custom: dict[str, Any], max_new_tokens: int
) -> tuple[str, bool]:
    """A greedy answer through the server, and whether every prefill round of it was fused."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    request = GenerateReqInput(
        input_ids=input_ids,
        sampling_params={
            "max_new_tokens": max_new_tokens,
            "temperature": 0,
            "custom_params": custom,
        },
    )
    token = probing_placement.set(True)
    try:
        output: dict[str, Any] = {}
        async for item in manager.generate_request(request, None):
            output = item
    finally:
        probing_placement.reset(token)
    rounds = output.get("meta_info", {}).get(META_KEY) or []
    fused = bool(rounds) and all(info and info.get("fused") for info in rounds)
    return str(output.get("text", "")), fused
