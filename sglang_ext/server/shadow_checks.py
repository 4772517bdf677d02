"""Shadow checks: fused answers compared with the normal prefill after they are served.

In SGLang's HTTP process. A sampled share of fused requests (`fusion_shadow_rate`; per request
`custom_params.fusion_shadow` forces or skips one) is checked after its answer has gone out: its
prompt and its first `fusion_shadow_tokens` served tokens are prefilled once more with fusion
off, asking SGLang for the greedy (top-1) token at every served position (input logprobs), and
the served tokens are compared with those choices (`evaluation/token_agreement.py`: the measure
of the offline harness too). Only requests decoded greedily are checked: a sampled token may
differ from the greedy choice by design, whatever the KV.

A check never delays a user: it waits in a bounded queue (`fusion_shadow_queue`; one more is
dropped and counted) until the server has served no user request for `fusion_shadow_idle_s`,
runs alone (the scheduler batches it with nobody and queues it behind every user request:
`chunk_fusion/shadow_request.py`), and when a user request arrives while it runs it is aborted
and queued again (dropped after three tries). Its rows never enter the prefix tree. Results go
to `/metrics` (`ShadowCheckMetrics`), to the scheduler's rolling window and agreement target
(`tuning/ratio/live_fidelity.py`, over the control channel), and to `GET /hicache_ext/shadow_checks`.
A check that fails is logged and counted; the checked request was answered long before.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from sglang_hicache_ext.evaluation.token_agreement import Agreement, token_agreement
from sglang_hicache_ext.sglang_ext.chunk_fusion.request_options import (
    ENABLE_KEY,
    META_KEY,
    SHADOW_KEY,
)
from sglang_hicache_ext.sglang_ext.chunk_fusion.shadow_request import (
    FIDELITY_RECORD_METHOD,
    SHADOW_PARAM,
    running_shadow_check,
)
from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings
from sglang_hicache_ext.sglang_ext.metrics.http_process_metrics import ShadowCheckMetrics
from sglang_hicache_ext.sglang_ext.server.control_routes import control

logger = logging.getLogger(__name__)

MAX_TRIES = 3  # a check preempted by users this many times is dropped
RECENT = 256  # results kept for GET /hicache_ext/shadow_checks
_POLL_S = 0.05


@dataclass
class PendingCheck:
    rid: str
    prompt: list[int]
    served: list[int]
    fusion: dict[str, Any]  # the request's last fused round (meta_info.hicache_ext_fusion[-1])
    queued_at: float
    tries: int = 0


def fused_round(rounds: Any) -> dict[str, Any] | None:
    """The last prefill round's fusion report when every round of the request was fused (a
    placement probe's excepted), else None."""
    rounds = rounds or []
    if rounds and all(r and r.get("fused") and "probe_form" not in r for r in rounds):
        return dict(rounds[-1])
    return None


class ShadowChecks:
    """The queue, the idle gate, the runner, and what the checks found (one per HTTP process)."""

    def __init__(self, manager: Any, settings: ExtensionSettings, seed: int | None = None) -> None:
        self.manager = manager
        self.settings = settings
        self.queue: deque[PendingCheck] = deque()
        self.counts: Counter[str] = Counter()
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self.metrics = (
            ShadowCheckMetrics(manager.metrics_collector.labels)
            if getattr(manager, "enable_metrics", False)
            else None
        )
        self._random = random.Random(seed)
        self._users = 0  # user requests in flight
        self._last_user = time.monotonic()
        self._running: PendingCheck | None = None
        self._running_rid: str | None = None
        self._aborted = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # by request id, from tokenizing to the answer (`remember_prompt`): the request's state
        # (its output ids and fusion reports, complete when it finishes), its prompt ids, and
        # whether it is decoded greedily
        self.prompts: dict[str, tuple[Any, list[int], bool]] = {}

    # -- users' requests ------------------------------------------------------------------

    def user_started(self) -> None:
        self._users += 1
        self._last_user = time.monotonic()
        if self._running_rid is not None and not self._aborted:
            # Users first: the check is stopped and queued again.
            self._aborted = True
            self.manager.abort_request(self._running_rid)

    def user_finished(self) -> None:
        self._users = max(0, self._users - 1)
        self._last_user = time.monotonic()

    def consider(self, obj: Any, output: dict[str, Any]) -> None:
        """A user's single request has its final output: queue a check when it is due."""
        remembered = self.prompts.pop(str(obj.rid), None)
        meta = output.get("meta_info") or {}
        finish = meta.get("finish_reason") or {}
        if remembered is None or finish.get("type") not in ("stop", "length"):
            return
        state, prompt, greedily = remembered
        # Every round's report as accumulated (an incremental stream's last chunk has only its
        # own slice of them).
        accumulated = getattr(state, "customized_info_accumulated", None) or {}
        fusion = fused_round(accumulated.get(META_KEY) or meta.get(META_KEY))
        if fusion is None:
            return
        params = obj.sampling_params if isinstance(obj.sampling_params, dict) else {}
        custom = params.get("custom_params") or {}
        forced = custom.get(SHADOW_KEY)
        if forced is False:
            return
        if forced is not True and self._random.random() >= self.settings.fusion_shadow_rate:
            return
        if not greedily:
            self.counts["skipped_sampled"] += 1
            return
        served = list(state.output_ids[: self.settings.fusion_shadow_tokens])
        if not served or not prompt:
            return
        check = PendingCheck(str(obj.rid), list(prompt), served, fusion, time.monotonic())
        if len(self.queue) >= self.settings.fusion_shadow_queue:
            self._drop(self.queue.popleft(), "queue_full")  # the newest reflect the ratio now
        self.queue.append(check)
        self.counts["queued"] += 1
        self._start()

    # -- the runner -----------------------------------------------------------------------

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.queue:
                await self._spare_capacity()
                check = self.queue.popleft()
                try:
                    await self._check(check)
                except Exception:  # noqa: BLE001 - a check must never take the runner down
                    logger.exception("shadow check of request %s failed", check.rid)
                    self._failed()

    async def _spare_capacity(self) -> None:
        """Until no user request is in flight and none came for fusion_shadow_idle_s."""
        while True:
            idle = time.monotonic() - self._last_user
            if self._users == 0 and idle >= self.settings.fusion_shadow_idle_s:
                return
            await asyncio.sleep(max(_POLL_S, self.settings.fusion_shadow_idle_s - idle))

    async def _check(self, check: PendingCheck) -> None:
        from sglang.srt.managers.io_struct import GenerateReqInput

        check.tries += 1
        rid = f"hicache-ext-shadow-{uuid.uuid4().hex}"
        request = GenerateReqInput(
            rid=rid,
            input_ids=check.prompt + check.served,
            sampling_params={
                "max_new_tokens": 0,
                # Fusion off whatever fusion_by_default says: this is the normal prefill.
                "custom_params": {ENABLE_KEY: False, SHADOW_PARAM: check.rid},
            },
            return_logprob=True,
            log_metrics=False,  # not a user's request: SGLang's own series do not count it
            # Entry i of the input logprobs is token logprob_start_len + i with the top choice
            # before it; SGLang leaves the first entry's empty, so the range starts one token
            # early and entry i + 1 is the greedy choice before served[i].
            logprob_start_len=len(check.prompt) - 1,
            top_logprobs_num=1,
        )
        self._running, self._running_rid, self._aborted = check, rid, False
        token = running_shadow_check.set(True)
        output: dict[str, Any] = {}
        try:
            async for item in self.manager.generate_request(request, None):
                output = item
        except Exception as err:  # noqa: BLE001 - SGLang's refusal or our abort
            if self._aborted:
                return self._preempted(check)
            logger.error("shadow check of request %s failed: %s", check.rid, err)
            return self._failed()
        finally:
            running_shadow_check.reset(token)
            self._running, self._running_rid = None, None
        meta = output.get("meta_info") or {}
        if (meta.get("finish_reason") or {}).get("type") == "abort":
            if self._aborted:
                return self._preempted(check)
            logger.error("shadow check of request %s was aborted: %s", check.rid, meta)
            return self._failed()
        choices = [int(top[0][1]) for top in (meta.get("input_top_logprobs") or [])[1:] if top]
        if len(choices) < len(check.served):
            logger.error(
                "shadow check of request %s: %d greedy choices for %d served tokens",
                check.rid,
                len(choices),
                len(check.served),
            )
            return self._failed()
        await self._report(check, token_agreement(check.served, choices[: len(check.served)]))

    def _preempted(self, check: PendingCheck) -> None:
        if check.tries >= MAX_TRIES:
            self._drop(check, "preempted")
        else:
            self.queue.appendleft(check)
            self.counts["requeued"] += 1

    async def _report(self, check: PendingCheck, agreement: Agreement) -> None:
        fusion = check.fusion
        ratio = float(fusion.get("recompute_ratio", 0.0))
        selector = str(fusion.get("selector", ""))
        self.counts["checked"] += 1
        result = {
            "rid": check.rid,
            "token_agreement": agreement.token_agreement,
            "first_token_agree": agreement.first_token,
            "tokens": agreement.tokens,
            "recompute_ratio": ratio,
            "ratio_source": fusion.get("ratio_source"),
            "selector": selector,
            "waited_s": round(time.monotonic() - check.queued_at, 3),
        }
        for key in ("ratio_tier", "tier_ratio"):
            if key in fusion:
                result[key] = fusion[key]
        self.recent.append(result)
        if self.metrics is not None:
            self.metrics.checked(selector, ratio, agreement.token_agreement, agreement.first_token)
        try:
            await control(FIDELITY_RECORD_METHOD, {**result, "counts": dict(self.counts)})
        except Exception as err:  # noqa: BLE001 - the check ran; only the scheduler's copy is lost
            logger.error("shadow check result of %s not recorded: %s", check.rid, err)

    def _drop(self, check: PendingCheck, reason: str) -> None:
        self.counts[f"dropped_{reason}"] += 1
        if self.metrics is not None:
            self.metrics.dropped(reason)
        logger.debug("shadow check of request %s dropped (%s)", check.rid, reason)

    def _failed(self) -> None:
        self.counts["failed"] += 1
        if self.metrics is not None:
            self.metrics.failed()

    def status(self) -> dict[str, Any]:
        return {
            "rate": self.settings.fusion_shadow_rate,
            "pending": len(self.queue),
            "running": self._running.rid if self._running is not None else None,
            "counts": dict(self.counts),
            "recent": list(self.recent),
        }
