"""Shadow checks through the real server: fused requests checked against the normal prefill after
they are answered, what the checks report and where (their route, /server_info, /metrics), that a
check leaves the prefix tree as it was, and that a user request arriving while one runs goes
first. The bookkeeping alone (queue bound, failures) is tests/test_shadow_checks.py; the queue
filled by real traffic is tests/test_server_concurrency.py."""

from __future__ import annotations

import time
import uuid

import pytest
import requests

from sglang_hicache_ext.evaluation.hotpotqa import load_hotpotqa

pytestmark = pytest.mark.server


def _generate(url: str, prompt: str, temperature: float = 0.0, **custom: object) -> dict:
    body = {
        "text": prompt,
        "sampling_params": {
            "max_new_tokens": 8,
            "temperature": temperature,
            "custom_params": custom,
        },
    }
    response = requests.post(url + "/generate", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


def _checks(url: str) -> dict:
    return requests.get(url + "/hicache_ext/shadow_checks", timeout=30).json()


def _results(url: str, rids: list[str], timeout_s: float = 300) -> dict[str, dict]:
    """The checks of `rids` once they have all run (they wait for the server to be idle)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        recent = {r["rid"]: r for r in _checks(url)["recent"]}
        if all(rid in recent for rid in rids):
            return {rid: recent[rid] for rid in rids}
        time.sleep(0.2)
    raise AssertionError(f"checks did not run: {_checks(url)}")


@pytest.fixture(scope="module")
def documents(hicache_server) -> list[str]:
    # Paragraphs no other test registers.
    docs = list(load_hotpotqa(4, seed=23)[3].documents[:3])
    for doc in docs:
        response = requests.post(hicache_server.url + "/chunks", json={"text": doc}, timeout=120)
        assert response.status_code == 200, response.text
    return docs


def test_checks_at_ratio_one_agree_on_every_token_and_are_reported(
    hicache_server, documents: list[str]
) -> None:
    url = hicache_server.url
    before = _checks(url)["counts"]
    rids = []
    for index in range(3):
        order = documents[index:] + documents[:index]
        prompt = "Documents:\n\n" + "\n\n".join(order) + f"\n\nQuestion {index}: who is named?"
        out = _generate(url, prompt, fusion=True, fusion_recompute_ratio=1, fusion_shadow=True)
        (meta,) = out["meta_info"]["hicache_ext_fusion"]
        assert meta["fused"] is True and meta["recompute_ratio"] == 1.0
        rids.append(out["meta_info"]["id"])
    # Not checked: a sampled answer (temperature > 0), and a request that opts out.
    _generate(url, prompt, temperature=0.7, fusion=True, fusion_shadow=True)
    skipped = _generate(url, prompt, fusion=True, fusion_shadow=False)["meta_info"]["id"]
    results = _results(url, rids)
    # Exact KV: every served token is the normal prefill's greedy choice.
    for result in results.values():
        assert result["token_agreement"] == 1.0 and result["first_token_agree"] is True
        assert 1 <= result["tokens"] <= 8 and result["recompute_ratio"] == 1.0
    counts = _checks(url)["counts"]
    assert counts["skipped_sampled"] == before.get("skipped_sampled", 0) + 1
    assert skipped not in {r["rid"] for r in _checks(url)["recent"]}

    info = requests.get(url + "/server_info", timeout=30).json()
    (state,) = [s["hicache_ext"] for s in info["internal_states"] if "hicache_ext" in s]
    window = state["fusion"]["shadow"]
    assert window["samples"] >= 3 and window["checks"]["checked"] >= 3
    metrics = requests.get(url + "/metrics", timeout=30).text
    checked = [
        line
        for line in metrics.splitlines()
        if line.startswith("sglang:hicache_ext_fusion_shadow_checks_total")
        and 'ratio_bucket="1"' in line
    ]
    assert checked and float(checked[0].rsplit(" ", 1)[1]) >= 3


def test_a_check_leaves_the_prefix_tree_as_it_was(hicache_server, documents: list[str]) -> None:
    url = hicache_server.url
    prompt = f"Note {uuid.uuid4().hex}.\n\n{documents[0]}\n\nQuestion: what is described?"
    out = _generate(url, prompt, fusion=True, fusion_shadow=True)
    _results(url, [out["meta_info"]["id"]])
    # Neither the fused request nor its check put rows in the tree: the same prompt without
    # fusion finds nothing cached (the check prefilled exactly this prompt).
    plain = _generate(url, prompt)
    assert plain["meta_info"]["cached_tokens"] == 0


def test_a_user_request_arriving_during_a_check_goes_first(
    hicache_server, documents: list[str]
) -> None:
    url = hicache_server.url
    # A prompt whose check runs for over a second (1.2 s measured on the idle 2-core machine,
    # 1,600 tokens), so it is still running when the user's request comes, tens of ms later.
    filler = " ".join(load_hotpotqa(8, seed=29)[k].documents[0] for k in range(8))
    prompt = f"{filler}\n\n{documents[1]}\n\nQuestion {uuid.uuid4().hex[:6]}: who is named?"
    out = _generate(url, prompt, fusion=True, fusion_shadow=True)
    before = _checks(url)["counts"].get("requeued", 0)
    deadline = time.monotonic() + 60
    while _checks(url)["running"] != out["meta_info"]["id"]:
        assert time.monotonic() < deadline, _checks(url)
        time.sleep(0.02)
    user = _generate(url, "Question: what is two plus two?")
    assert user["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    assert _checks(url)["counts"].get("requeued", 0) == before + 1
    # Queued again and run at the next idle moment.
    (result,) = _results(url, [out["meta_info"]["id"]]).values()
    assert 0.0 <= result["token_agreement"] <= 1.0
