"""Where the offline models prepared by `scripts/prepare_models.py` live, found without building them.

`$SGLANG_EXT_CACHE/models/<name>`, or `~/.cache/sglang-hicache-ext/models/<name>` when the
variable is unset. A folder counts as prepared once it holds the marker file written last.
"""

from __future__ import annotations

import os
from pathlib import Path

SMOLLM2 = "SmolLM2-135M-Instruct"
QWEN_CODER = "Qwen2.5-Coder-0.5B-Instruct"
TINY_LLAMA = "tiny-llama"
TINY_QWEN2 = "tiny-qwen2"
# Random weights behind SmolLM2's tokenizer: the prompts of the tier tests, at a fraction of the cost.
TINY_SMOLLM2 = "tiny-smollm2"
PREPARED_MARKER = ".prepared"
PREPARE_HINT = "python scripts/prepare_models.py smollm2"


def tiny_family_dir(family: str) -> str:
    """The folder name of the tiny random model of `family` (`evaluation/tiny_families.py`)."""
    return f"tiny-{family.replace('_', '-')}"


def cache_dir() -> Path:
    root = os.environ.get("SGLANG_EXT_CACHE") or Path.home() / ".cache" / "sglang-hicache-ext"
    return Path(root) / "models"


def model_dir(name: str) -> Path:
    return cache_dir() / name


def prepared_model(name: str) -> Path | None:
    """The model's folder when its preparation has completed, else None."""
    folder = model_dir(name)
    return folder if (folder / PREPARED_MARKER).exists() else None
