"""What the soak sends: the request mix, the fusion selectors, the prompts and the bad requests."""

from __future__ import annotations

import random
from typing import Any

from sglang_hicache_ext.evaluation.hotpotqa import HotpotQAExample

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


def fusion_params(selector: str, ratio: float) -> dict[str, Any]:
    """`custom_params` of a fused /generate."""
    return {"fusion": True, "fusion_selector": selector, "fusion_recompute_ratio": ratio}


def shared_prompt(topic: str) -> str:
    """The long shared system prefix + one record set (tree / host / disk hits)."""
    body = " ".join(
        f"Record {i} on {topic}: entry {i * 7 % 11} was filed in {1900 + i}." for i in range(12)
    )
    return f"{SYSTEM}\n{body}\nQuestion: what are these records about?\nAnswer:"


def long_prompt(seed: int, examples: list[HotpotQAExample], tokenizer: Any) -> str:
    """~0.9-2K tokens of HotpotQA paragraphs behind the system prefix, and a question."""
    rng = random.Random(1000 + seed)
    target = rng.randint(900, 2000)
    docs: list[str] = []
    tokens = len(tokenizer.encode(SYSTEM))
    pool = [d for ex in rng.sample(examples[-40:], 6) for d in ex.documents]
    for doc in pool:
        docs.append(doc)
        tokens += len(tokenizer.encode(doc, add_special_tokens=False))
        if tokens >= target:
            break
    question = rng.choice(examples).question
    return f"{SYSTEM}\nDocuments:\n" + "\n\n".join(docs) + f"\n\nQuestion: {question}\nAnswer:"


def _generate(custom: dict[str, Any], **params: Any) -> dict[str, Any]:
    return {
        "json": {
            "text": "Is the server still serving?",
            "sampling_params": {"max_new_tokens": 2, "custom_params": custom, **params},
        }
    }


# (case, method, path, keyword arguments of `requests.request`): each must get a 4xx.
BAD_REQUESTS: tuple[tuple[str, str, str, dict[str, Any]], ...] = (
    ("chunk_empty_object", "POST", "/chunks", {"json": {}}),
    ("chunk_empty_text", "POST", "/chunks", {"json": {"text": "  "}}),
    ("chunk_text_and_ids", "POST", "/chunks", {"json": {"text": "a", "input_ids": [1]}}),
    ("chunk_negative_id", "POST", "/chunks", {"json": {"input_ids": [-1]}}),
    ("chunk_ids_not_ints", "POST", "/chunks", {"json": {"input_ids": ["x"]}}),
    ("chunk_not_json", "POST", "/chunks", {"data": b"{not json"}),
    ("chunk_unknown_get", "GET", f"/chunks/{_UNKNOWN_ID}", {}),
    ("chunk_unknown_delete", "DELETE", f"/chunks/{_UNKNOWN_ID}", {}),
    ("chunk_probe_half", "GET", f"/chunks/{_UNKNOWN_ID}?probe_layer=0", {}),
    ("fusion_ratio_high", "POST", "/generate", _generate({"fusion_recompute_ratio": 1.5})),
    ("fusion_ratio_negative", "POST", "/generate", _generate({"fusion_recompute_ratio": -0.1})),
    ("fusion_selector_unknown", "POST", "/generate", _generate({"fusion_selector": "magic"})),
    ("fusion_selector_list", "POST", "/generate", _generate({"fusion_selector": ["a3"]})),
    ("fusion_flag_string", "POST", "/generate", _generate({"fusion": "yes"})),
    ("fusion_sink_negative", "POST", "/generate", _generate({"fusion_sink_tokens": -4})),
    ("generate_max_tokens_negative", "POST", "/generate", _generate({}, max_new_tokens=-1)),
    ("ttl_negative", "POST", "/hicache_ext/storage/ttl", {"json": {"default_ttl_s": -1}}),
    ("ttl_unknown_key", "POST", "/hicache_ext/storage/ttl", {"json": {"foo": 1}}),
    ("ttl_not_object", "POST", "/hicache_ext/storage/ttl", {"json": [1, 2]}),
    ("storage_pages_negative", "GET", "/hicache_ext/storage?pages=-1", {}),
)
