"""The method names of `benchmarks/fusion_retention.py`.

`full`, `reuse` or `<selector>@<ratio>` (`default`: the server's default selector and its
options), each followed by modifiers joined with `+`:

- `sink<N>`: each chunk's first N tokens first in the budget (EPIC);
- `fresh<F>`: every token computed in the first F layers and that KV kept (CacheBlend);
- `layers<a>-<b>`: the scoring layers of `question_attention`, as fractions of the depth;
- `inline<a>-<b>`: where a request's reuse cannot afford the pass's smallest read,
  `question_attention` measures the question's attention inside the prefill at these layers
  (fractions of the depth), every token computed up to the last of them (default 0.25-0.5);
  `noinline`: a scoring pass whatever the request's reuse (the default before f0bdfa9);
- `wholeprompt`: `question_attention`'s scoring pass reads every token of the prompt (the new
  text between the chunks too) instead of the chunks and the question;
- `wholequestion`: that pass reads all the text after the last chunk (the question when none is
  marked) instead of its last `SCORING_QUESTION_TOKENS`;
- `share<S>`: that pass's read bounded to a share S of the token-layers the request's reuse
  saves (default `SCORING_COST_SHARE`, 0.1);
- `fullread`: that pass reads the question's last `SCORING_QUESTION_TOKENS` whatever the
  request's reuse saves (no `SCORING_COST_SHARE` bound);
- `prefix`: chunks precomputed after the prompt's system prompt and chat header instead of
  alone (`fusion/precompute.py`);
- `traffic`: chunks captured from traffic as the server's `auto_chunks` does: the pieces
  (`radix/segments.py`) of another prompt holding the same paragraphs in another order with
  another question, their KV the rows that prompt's prefill computed (with `prefix`: the same
  pieces precomputed after the system prompt and chat header instead);
- `mixed`: (after `traffic`) the first prompts hold the paragraphs in two halves, each among as
  many paragraphs of other questions: the co-occurring documents differ, as in real traffic;
- `new<S>`: a share S of each prompt's paragraphs (drawn per question) is never stored: new
  text the prefill computes, the rest chunks (a prompt part new, part seen before);
- `ape` or `ape<T>x<S>`: the question's attention over the chunks tempered as APE does
  (default T = S = 0.9, the APE code's);
- `fp32`, `batch` (with `full` only): the full prefill again in float32, or inside a batch with
  another prompt: the noise floor of "agrees with the full prefill".

then optionally `#<codec>` (chunks stored through a codec) and `:keep<C>` (decode-time eviction).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_hicache_ext.fusion import make_selector
from sglang_hicache_ext.fusion.selectors import Selector
from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings

_DEFAULTS = ExtensionSettings()
DEFAULT_SELECTOR = _DEFAULTS.fusion_selector
DEFAULT_SINK_TOKENS = _DEFAULTS.fusion_sink_tokens
APE_DEFAULT = (0.9, 0.9)


@dataclass(frozen=True)
class Method:
    """How one method prefills: the selector, which chunk KV it reads, the attention it uses."""

    selector: Selector
    prefix_chunks: bool = False
    traffic_chunks: bool = False
    mixed_traffic: bool = False
    new_paragraphs: float = 0.0
    tempering: tuple[float, float] = (1.0, 1.0)
    noise: str | None = field(default=None)  # "fp32" or "batch": a full prefill computed otherwise


def split_codec(method: str) -> tuple[str, str | None]:
    """`<method>#<codec>` -> (method, codec); the codec is None for uncompressed chunks."""
    name, sep, codec = split_keep(method)[0].partition("#")
    return name, codec if sep else None


def split_keep(method: str) -> tuple[str, float | None]:
    """`<method>:keep<C>` -> (method, C); C is None when the decode keeps every token."""
    name, sep, keep = method.partition(":keep")
    return name, float(keep) if sep else None


def parse_method(method: str) -> Method:
    name, _, ratio = method.partition("@")
    base, *modifiers = name.split("+")
    options: dict[str, object] = {}
    prefix, traffic, mixed, tempering, noise = False, False, False, (1.0, 1.0), None
    new = 0.0
    if base == "default":
        base = DEFAULT_SELECTOR
        options["sink_tokens"] = DEFAULT_SINK_TOKENS
    for modifier in modifiers:
        if modifier.startswith("sink"):
            options["sink_tokens"] = int(modifier[4:])
        elif modifier.startswith("fresh"):
            options["fresh_layers"] = int(modifier[5:])
        elif modifier.startswith("layers"):
            start, end = modifier[6:].split("-")
            options["layers"] = (float(start), float(end))
        elif modifier == "noinline":
            options["inline_layers"] = None
        elif modifier.startswith("inline"):
            start, end = modifier[6:].split("-")
            options["inline_layers"] = (float(start), float(end))
        elif modifier == "wholeprompt":
            options["whole_prompt"] = True
        elif modifier == "wholequestion":
            options["question_tokens"] = None
        elif modifier == "fullread":
            options["cost_share"] = None
        elif modifier.startswith("share"):
            try:
                options["cost_share"] = float(modifier[5:])
            except ValueError:
                raise SystemExit(f"modifier {modifier!r}: share<S> needs a number S") from None
        elif modifier == "prefix":
            prefix = True
        elif modifier == "traffic":
            traffic = True
        elif modifier == "mixed" and traffic:
            mixed = True
        elif modifier.startswith("new"):
            try:
                new = float(modifier[3:])
            except ValueError:
                new = -1.0
            if not 0.0 <= new <= 1.0:
                raise SystemExit(f"modifier {modifier!r}: new<S> needs a share S in [0, 1]")
        elif modifier.startswith("ape"):
            given = modifier[3:]
            t, s = given.split("x") if given else APE_DEFAULT
            tempering = (float(t), float(s))
        elif modifier in ("fp32", "batch") and base == "full":
            noise = modifier
        else:
            raise SystemExit(f"unknown modifier {modifier!r} in method {method!r}")
    if base in ("full", "reuse"):
        value = 1.0 if base == "full" else 0.0
    elif not ratio:
        raise SystemExit(f"method {method!r} needs @<ratio>")
    else:
        value = float(ratio)
    try:
        selector = make_selector(base, value, **options)
    except (TypeError, ValueError) as err:
        raise SystemExit(f"method {method!r}: {err}") from None
    return Method(selector, prefix, traffic, mixed, new, tempering, noise)
