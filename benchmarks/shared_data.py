"""The data the benchmarks read from the `shared/` folder beside the repository's checkout
(`<repo>/../shared/data`): the production request trace. Installed code never looks there: a
benchmark passes the path (each trace benchmark has `--trace` / `--real` to read another file)."""

from __future__ import annotations

from pathlib import Path

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
CONVERSATION_TRACE = SHARED_DATA / "traces" / "mooncake_conversation_trace.jsonl"
