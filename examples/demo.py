"""`make demo`: a real SGLang server on CPU with our plugin and HiCache, and a RAG pipeline.

Starts `python -m sglang.launch_server` with `--radix-cache-backend hicache_ext`, HiCache (host
tier + file tier) and the `torch_position` CPU attention backend on SmolLM2-135M-Instruct, runs
the `sgl.function` RAG program of examples/rag_pipeline.py over HotpotQA questions, prints
per-request TTFT and answers, and stops the server (no process is left behind).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from examples.rag_pipeline import ask, connect  # noqa: E402
from scripts.prepare_models import SMOLLM2, prepare  # noqa: E402
from sglang_ext.datasets import load_hotpotqa  # noqa: E402
from sglang_ext.launcher import ServerConfig, ServerStartError, free_port, running_server  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--documents", type=int, default=6, help="HotpotQA paragraphs per prompt")
    args = parser.parse_args()

    model = prepare(SMOLLM2)
    workdir = Path(tempfile.mkdtemp(prefix="sglang-ext-demo-"))
    config = ServerConfig(
        model_path=str(model),
        port=free_port(),
        hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(workdir / "hicache"),
    )
    examples = load_hotpotqa(args.questions, seed=7)
    print(f"Starting SGLang 0.5.23 on CPU: {' '.join(config.command()[1:])}", flush=True)
    try:
        with running_server(config, log_path=workdir / "server.log"):
            connect(config.url)
            print(f"{'pass':<6}{'TTFT (s)':>9}{'prompt':>8}{'cached':>8}  question -> answer")
            for label in ("cold", "cached"):
                for example in examples:
                    result = ask(example.documents[: args.documents], example.question)
                    print(
                        f"{label:<6}{result.ttft_s:>9.2f}{result.prompt_tokens:>8}{result.cached_tokens:>8}  "
                        f"{example.question} -> {result.answer!r} (gold: {example.answer!r})",
                        flush=True,
                    )
    except ServerStartError as err:
        print(f"demo failed: {err}", file=sys.stderr)
        return 1
    print(f"Server stopped. Log: {workdir / 'server.log'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
