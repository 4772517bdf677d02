"""The `live` policy of `benchmarks/placement.py`: the server places its chunks itself.

After the warm-up (the server recorded every chunk's reads and questions), one round of
`POST /hicache_ext/placement` profiles every chunk with probe requests (SmolLM2's answers
from the registered rows against int8 / int4) and chooses what host memory holds of each;
the measured requests follow. For the quality column, a context is read in the most
compressed form any of its chunks is held in (disk-held chunks are dense), and scored with
the Qwen2.5 profile of that codec, as the fixed policies are.
"""

from __future__ import annotations

from typing import Any

import requests

from sglang_hicache_ext.tuning.placement.host_forms import CODEC_ORDER


def place_live(
    url: str, chunk_ids: dict[str, list[str]], alpha: float, quality_floor: float
) -> tuple[dict[str, str], dict[str, Any]]:
    """Run one placement round on the server; the form each context is read in, and the round."""
    body = {"alpha": alpha, "quality_floor": quality_floor, "profile_chunks": 100_000}
    response = requests.post(url + "/hicache_ext/placement", json=body, timeout=3600)
    if response.status_code != 200:
        raise RuntimeError(
            f"/hicache_ext/placement answered {response.status_code}: {response.text}"
        )
    result = response.json()
    listing = requests.get(url + "/chunks", timeout=60).json()["chunks"]
    form = {c["id"]: c["codec"] or "none" for c in listing}
    read_as = {
        qid: max((form.get(i, "none") for i in ids), key=CODEC_ORDER.index)
        for qid, ids in chunk_ids.items()
    }
    return read_as, summarize_round(result)


def summarize_round(result: dict[str, Any]) -> dict[str, Any]:
    chunks = result.get("chunks", [])
    held: dict[str, int] = {}
    for chunk in chunks:
        key = chunk["host_form"] or "disk"
        held[key] = held.get(key, 0) + 1
    qualities = [c["quality"] for c in chunks if c["quality"]]
    return {
        "seconds": result["seconds"],
        "profiled": len(result["profiled"]),
        "probe_fallbacks": result["probe_fallbacks"],
        "timing": result["timing"],
        "chunks_by_form": held,
        "mean_probe_quality": {  # the forms every profiled chunk was probed in
            form: sum(q[form] for q in qualities) / len(qualities)
            for form in CODEC_ORDER
            if qualities and all(form in q for q in qualities)
        },
        "planned_bytes": result.get("planned_bytes"),
        "outcomes": result.get("outcomes"),
    }
