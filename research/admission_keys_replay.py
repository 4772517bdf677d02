"""Why the live run of `benchmarks/reuse_under_pressure.py` kept less than the trace: the keys.

The same 200 requests (5 HotpotQA paragraphs each, 80 % one-offs, 20 Zipf-popular paragraphs,
host memory 1.5x the popular set's dense KV) replayed offline through the shipped
`HostChunkCache` and `FrequencyAdmission`, with the pieces keyed two ways:

- `position_free`: a paragraph is one key wherever it stands (what the trace benchmark assumes);
- `labelled`: as the server keyed a piece before `radix/segments.py`'s `sight_key`, by the hash
  of its tokens, which include the label the client puts before the paragraph ("Document 3. "):
  the same paragraph at another position is another key, until one variant is stored; from then
  on the chunk index matches the paragraph at any position and its sights are counted on the
  stored variant. The server now counts sights by `sight_key` (a piece's last tokens, never its
  first), which is `position_free` here.

Reported: reused / seen-before tokens of the popular paragraphs after the first fifth, per
`chunk_admission`, and how often the adaptive rule followed recency.

    python -m research.admission_keys_replay   # research/results/admission_keys_replay.json
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

from benchmarks.reuse_under_pressure import dense_bytes_per_token, traffic
from benchmarks.smollm2_server import smollm2_tokenizer, write_json
from sglang_hicache_ext.tiers.chunks.admission import FrequencyAdmission
from sglang_hicache_ext.tiers.chunks.host_cache import HostCacheFullError, HostChunkCache

OUT = Path(__file__).resolve().parent / "results" / "admission_keys_replay.json"
SKETCH_ENTRIES = 10_000
BUDGET = 1.5


@dataclass(frozen=True)
class Piece:
    nbytes: int


def replay(
    draws: list[list[str]],
    hot: set[str],
    nbytes: dict[str, int],
    capacity: int,
    policy: str,
    labelled: bool,
) -> dict[str, float]:
    admission = None
    if policy != "lru":
        admission = FrequencyAdmission.for_entries(
            SKETCH_ENTRIES, capacity if policy == "adaptive" else None
        )
    host: HostChunkCache[Piece] = HostChunkCache(capacity, admission)
    stored_as: dict[str, str] = {}  # paragraph -> the key it is stored under
    seen: set[str] = set()
    start = len(draws) // 5
    reused = reusable = recency = 0
    for index, docs in enumerate(draws):
        keys = {}
        for position, doc in enumerate(docs):
            held = stored_as.get(doc)
            if held is not None and held not in host:
                del stored_as[doc]
                held = None
            keys[doc] = held or (f"{position + 1}:{doc}" if labelled else doc)
        if admission is not None:
            admission.record_prompt([(keys[doc], nbytes[doc]) for doc in docs])
            recency += admission.mode == "recency"
        for doc in docs:
            counted = index >= start and doc in hot and doc in seen
            reusable += nbytes[doc] if counted else 0
            if doc in stored_as and host.get(stored_as[doc]) is not None:
                reused += nbytes[doc] if counted else 0
                continue
            with contextlib.suppress(HostCacheFullError):
                host.put(keys[doc], Piece(nbytes[doc]), by_frequency=True)
                stored_as[doc] = keys[doc]
        seen.update(docs)
    return {"reused": round(reused / reusable, 4), "recency_share": round(recency / len(draws), 4)}


def main() -> None:
    draws, hot, _ = traffic(200, 5, 20, 0.8, 1.0)  # the live benchmark's defaults
    tokenizer = smollm2_tokenizer()
    per_token = dense_bytes_per_token()
    nbytes = {
        doc: len(tokenizer.encode(doc, add_special_tokens=False)) * per_token
        for docs in draws
        for doc in docs
    }
    capacity = int(BUDGET * sum(nbytes[doc] for doc in hot))
    report = {
        "command": "python -m research.admission_keys_replay",
        "requests": len(draws),
        "capacity_bytes": capacity,
        "keys": {
            keying: {
                policy: replay(draws, set(hot), nbytes, capacity, policy, keying == "labelled")
                for policy in ("lru", "frequency", "adaptive")
            }
            for keying in ("position_free", "labelled")
        },
    }
    write_json(OUT, report)
    print(json.dumps(report["keys"], indent=1))


if __name__ == "__main__":
    main()
