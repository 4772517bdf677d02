"""A RAG pipeline written as an SGLang frontend program (`sgl.function`, `RuntimeEndpoint`).

Documents come from a retriever (here: the HotpotQA paragraphs of each question), go into the
prompt ahead of the question, and the answer is generated greedily. TTFT is measured on the
client as the time to the first streamed chunk of the answer.

With chunk fusion, the documents are registered once (`register_documents`) and a program run
inside `backend.fusion(...)` reuses their KV wherever they appear in the prompt.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import sglang as sgl

from sglang_hicache_ext.sglang_ext.frontend import FusionEndpoint

SYSTEM_PROMPT = "Answer the question using the documents. Reply with a short phrase."


def chat_prefix() -> str:
    """How this program's prompts start under ChatML (the system turn and the user header): the
    prefix its documents are registered after, so their KV is computed as it is served."""
    return f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"


def format_documents(documents: Sequence[str]) -> str:
    return "\n\n".join(f"Document {i + 1}. {doc}" for i, doc in enumerate(documents))


@sgl.function
def answer_with_documents(s, documents: Sequence[str], question: str, max_tokens: int = 24):
    s += sgl.system(SYSTEM_PROMPT)
    s += sgl.user(f"{format_documents(documents)}\n\nQuestion: {question}")
    s += sgl.assistant(sgl.gen("answer", max_tokens=max_tokens, temperature=0))


@dataclass(frozen=True)
class RagResult:
    question: str
    answer: str
    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    tokens_reused: int  # chunk KV reused by fusion (0 without fusion)
    rid: str = ""  # the server's request id (a shadow check of the answer reports it)
    recompute_ratio: float | None = None  # the ratio the fused prefill used (None: not fused)
    ratio_source: str | None = None  # what chose it: fixed, tuned, self_tuned or target


def connect(url: str) -> FusionEndpoint:
    # Qwen2.5, SmolLM2 and our tiny models use ChatML; the frontend cannot infer it from a local path.
    backend = FusionEndpoint(url, chat_template_name="chatml")
    sgl.set_default_backend(backend)
    return backend


def ask(documents: Sequence[str], question: str, max_tokens: int = 24) -> RagResult:
    start = time.perf_counter()
    state = answer_with_documents.run(
        documents=documents, question=question, max_tokens=max_tokens, stream=True
    )
    first_chunk_at: float | None = None
    pieces = []
    for chunk in state.text_iter("answer"):
        if first_chunk_at is None:
            first_chunk_at = time.perf_counter()
        pieces.append(chunk)
    end = time.perf_counter()
    meta = state.get_meta_info("answer") or {}
    fusion = (meta.get("hicache_ext_fusion") or [{}])[0]
    return RagResult(
        question=question,
        answer="".join(pieces).strip(),
        ttft_s=(first_chunk_at or end) - start,
        total_s=end - start,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        cached_tokens=int(meta.get("cached_tokens", 0)),
        tokens_reused=int(fusion.get("tokens_reused", 0)),
        rid=str(meta.get("id", "")),
        recompute_ratio=fusion.get("recompute_ratio") if fusion.get("fused") else None,
        ratio_source=fusion.get("ratio_source") if fusion.get("fused") else None,
    )
