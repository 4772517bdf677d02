"""RAG through the `openai` package against a server with `auto_chunks`: no registration step.

Start a server whose settings turn on reuse from traffic, e.g. `settings.json`:

    {"auto_chunks": true, "fusion_by_default": true}

    SGLANG_HICACHE_EXT_CONFIG=settings.json python -m sglang.launch_server \\
        --model-path <model> --radix-cache-backend hicache_ext --enable-cache-report

then `python examples/openai_rag.py --base-url http://127.0.0.1:30000/v1`. The script asks two
questions over the same retrieved documents in different orders, streamed. The first request's
documents are kept as chunks from its own prefill; the second reuses them at their new
positions, and `usage.prompt_tokens_details.cached_tokens` says how many prompt tokens the
server did not compute (prefix-cache hits plus reused document rows). Per request options go in
`extra_body={"custom_params": {...}}` (e.g. `{"fusion": false}`, `{"fusion_recompute_ratio":
0.3}`).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass

import openai

SYSTEM = "Answer the question from the documents in a few words."
DOCUMENTS = (
    "Ada Lovelace: Augusta Ada King, Countess of Lovelace, was an English mathematician and "
    "writer, chiefly known for her work on Charles Babbage's proposed mechanical "
    "general-purpose computer, the Analytical Engine. She was the first to recognise that the "
    "machine had applications beyond pure calculation.",
    "Charles Babbage: Charles Babbage was an English polymath, a mathematician, philosopher, "
    "inventor and mechanical engineer, who originated the concept of a digital programmable "
    "computer. He is considered by some to be the father of the computer; he designed the "
    "Difference Engine and the Analytical Engine.",
    "Analytical Engine: The Analytical Engine was a proposed mechanical general-purpose "
    "computer designed by Charles Babbage. It was first described in 1837 as the successor "
    "to Babbage's Difference Engine, a design for a simpler mechanical calculator, and it "
    "was never completed in his lifetime.",
)


@dataclass(frozen=True)
class Answer:
    text: str
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


def ask(
    client: openai.OpenAI,
    model: str,
    documents: Sequence[str],
    question: str,
    headers: dict[str, str] | None = None,
    system: str = SYSTEM,
    max_tokens: int = 16,
    **custom: object,
) -> Answer:
    """One streamed chat request; the last event carries the usage. `headers`: e.g. the
    router's routing key (`x-smg-routing-key`); `custom`: the extension's request parameters."""
    body = "\n\n".join(f"Document {i + 1}. {doc}" for i, doc in enumerate(documents))
    began = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": system},
            {"role": "user", "content": f"{body}\n\nQuestion: {question}"},
        ],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"custom_params": custom} if custom else None,
        extra_headers=headers,
    )
    text, ttft, usage = "", None, None
    for event in stream:
        if event.choices and event.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - began
            text += event.choices[0].delta.content
        usage = event.usage or usage
    if usage is None:
        raise RuntimeError("the server sent no usage (stream_options include_usage)")
    details = usage.prompt_tokens_details
    return Answer(
        text.strip(),
        ttft if ttft is not None else time.perf_counter() - began,
        usage.prompt_tokens,
        details.cached_tokens if details is not None else 0,
    )


def main(argv: Sequence[str] | None = None) -> list[Answer]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:30000/v1")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--model", default="default")
    args = parser.parse_args(argv)
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    order = list(DOCUMENTS)
    answers = []
    for question in ("Who designed the Analytical Engine?", "Who wrote about its uses?"):
        answer = ask(client, args.model, order, question)
        answers.append(answer)
        print(
            f"{question!r} -> {answer.text!r}: TTFT {answer.ttft_s:.2f} s, "
            f"{answer.cached_tokens} of {answer.prompt_tokens} prompt tokens not computed"
        )
        order = order[1:] + order[:1]  # the next request sees them at other positions
    return answers


if __name__ == "__main__":
    main()
