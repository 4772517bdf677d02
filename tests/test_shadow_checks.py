"""The shadow checks' bookkeeping in the HTTP process (sglang_ext/server/shadow_checks.py), with
SGLang's tokenizer manager replaced by a stand-in that answers what the scheduler would: which
requests are checked, the bounded queue, a check that fails or is preempted, and the measure.
The real server path is tests/test_server_shadow_checks.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings
from sglang_hicache_ext.sglang_ext.server import shadow_checks as module
from sglang_hicache_ext.sglang_ext.server.shadow_check_hooks import served_greedily
from sglang_hicache_ext.sglang_ext.server.shadow_checks import ShadowChecks

FUSED = {"fused": True, "selector": "question_attention", "recompute_ratio": 0.3}


class StandIn:
    """What ShadowChecks reads of SGLang's TokenizerManager; `greedy` answers every check with
    these choices (entry 0 empty, as SGLang leaves it), `fail` makes the prefill raise."""

    def __init__(self, greedy: list[int], fail: bool = False) -> None:
        self.greedy, self.fail = greedy, fail
        self.rid_to_state: dict[str, Any] = {}
        self.sent: list[Any] = []
        self.aborted: list[str] = []

    def abort_request(self, rid: str) -> None:
        self.aborted.append(rid)

    async def generate_request(self, request: Any, http: Any) -> AsyncIterator[dict[str, Any]]:
        self.sent.append(request)
        await asyncio.sleep(0)
        if self.fail:
            raise ValueError("the prefill was refused")
        tops = [None, *([[-0.1, token, None]] for token in self.greedy)]
        yield {"meta_info": {"finish_reason": {"type": "length"}, "input_top_logprobs": tops}}


def _request(rid: str, temperature: float = 0.0, **custom: Any) -> tuple[Any, dict[str, Any]]:
    params = {"temperature": temperature, "custom_params": {"fusion": True, **custom}}
    obj = SimpleNamespace(rid=rid, sampling_params=params, is_single=True)
    output = {"meta_info": {"finish_reason": {"type": "stop"}, "hicache_ext_fusion": [FUSED]}}
    return obj, output


def _checks(manager: StandIn, **settings: Any) -> ShadowChecks:
    values = {"fusion_shadow_rate": 1.0, "fusion_shadow_idle_s": 0.0, **settings}
    return ShadowChecks(manager, ExtensionSettings(**values), seed=0)


def _offer(checks: ShadowChecks, rid: str, served: list[int], **kwargs: Any) -> None:
    greedily = kwargs.get("temperature", 0.0) == 0
    state = SimpleNamespace(output_ids=served, customized_info_accumulated={})
    checks.prompts[rid] = (state, [1, 2, 3], greedily)
    checks.consider(*_request(rid, **kwargs))


async def _drain(checks: ShadowChecks) -> None:
    for _ in range(200):
        if not checks.queue and checks._running is None:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("checks did not drain")


@pytest.fixture(autouse=True)
def _no_scheduler(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def control(method: str, body: dict[str, Any]) -> dict[str, Any]:
        sent.append(body)
        return {}

    monkeypatch.setattr(module, "control", control)
    return sent


def test_a_check_compares_the_served_tokens_with_the_normal_prefills_choices(
    _no_scheduler: list[dict[str, Any]],
) -> None:
    async def run() -> ShadowChecks:
        manager = StandIn(greedy=[5, 6, 9, 8])
        checks = _checks(manager)
        _offer(checks, "a", [5, 6, 7, 8])
        await _drain(checks)
        (request,) = manager.sent
        assert request.input_ids == [1, 2, 3, 5, 6, 7, 8]
        assert request.logprob_start_len == 2 and request.top_logprobs_num == 1
        assert request.sampling_params["custom_params"]["fusion"] is False
        return checks

    checks = asyncio.run(run())
    (result,) = checks.recent
    assert result["token_agreement"] == 0.75 and result["first_token_agree"] is True
    assert _no_scheduler[0]["recompute_ratio"] == 0.3 and checks.counts["checked"] == 1


def test_which_requests_are_checked() -> None:
    async def run() -> ShadowChecks:
        checks = _checks(StandIn(greedy=[5]), fusion_shadow_rate=0.0)
        _offer(checks, "at-rate-0", [5])  # not drawn
        _offer(checks, "forced", [5], fusion_shadow=True)
        _offer(checks, "refused", [5], fusion_shadow=False)
        _offer(checks, "sampled", [5], temperature=0.7, fusion_shadow=True)
        await _drain(checks)
        return checks

    checks = asyncio.run(run())
    assert [r["rid"] for r in checks.recent] == ["forced"]
    assert checks.counts["skipped_sampled"] == 1 and checks.counts["queued"] == 1
    assert checks.prompts == {}  # every remembered prompt was taken


def test_the_queue_is_bounded_and_what_it_drops_is_counted() -> None:
    async def run() -> ShadowChecks:
        checks = _checks(StandIn(greedy=[5]), fusion_shadow_queue=3)
        checks.user_started()  # a user request in flight: no spare capacity, nothing runs
        for index in range(10):
            _offer(checks, f"r{index}", [5])
        assert len(checks.queue) == 3
        assert [c.rid for c in checks.queue] == ["r7", "r8", "r9"]  # the newest are kept
        checks.user_finished()
        await _drain(checks)
        return checks

    checks = asyncio.run(run())
    assert checks.counts["dropped_queue_full"] == 7 and checks.counts["checked"] == 3


def test_a_failed_check_is_counted_and_the_next_one_runs() -> None:
    async def run() -> ShadowChecks:
        manager = StandIn(greedy=[5], fail=True)
        checks = _checks(manager)
        _offer(checks, "a", [5])
        await _drain(checks)
        manager.fail = False
        _offer(checks, "b", [5])
        await _drain(checks)
        return checks

    checks = asyncio.run(run())
    assert checks.counts["failed"] == 1 and checks.counts["checked"] == 1


def test_a_user_request_preempts_a_running_check_which_runs_again_later() -> None:
    async def run() -> tuple[ShadowChecks, StandIn]:
        manager = StandIn(greedy=[5])
        checks = _checks(manager)
        original = manager.generate_request

        async def slow(request: Any, http: Any) -> AsyncIterator[dict[str, Any]]:
            if len(manager.sent) == 0:  # the first try: a user arrives while it runs
                manager.sent.append(request)
                checks.user_started()
                checks.user_finished()
                raise ValueError("aborted")
            async for item in original(request, http):
                yield item

        manager.generate_request = slow  # type: ignore[method-assign]
        _offer(checks, "a", [5])
        await _drain(checks)
        return checks, manager

    checks, manager = asyncio.run(run())
    assert len(manager.aborted) == 1 and checks.counts["requeued"] == 1
    assert checks.counts["checked"] == 1 and checks.counts.get("failed", 0) == 0


@pytest.mark.parametrize(
    ("params", "greedily"),
    [
        ({"temperature": 0}, True),
        ({"temperature": 0.7, "top_k": 1}, True),
        ({"temperature": 0.7}, False),
        ({"temperature": 0, "repetition_penalty": 1.1}, False),
        ({"temperature": 0, "frequency_penalty": 0.5}, False),
        ({"temperature": 0, "min_new_tokens": 4}, False),
        ({"temperature": 0, "regex": "[0-9]+"}, False),
        ({"temperature": 0, "logit_bias": {"13": 2.0}}, False),
    ],
)
def test_only_answers_decoded_by_the_raw_greedy_choice_are_checked(
    params: dict[str, Any], greedily: bool
) -> None:
    # SGLang's own resolved sampling parameters: anything that changes a token after the logits
    # would read as a disagreement whatever the KV.
    from sglang.srt.sampling.sampling_params import SamplingParams

    tokenized = SimpleNamespace(sampling_params=SamplingParams(**params))
    assert served_greedily(tokenized) is greedily
