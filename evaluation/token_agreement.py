"""Token agreement: how many of the tokens a fused request served are the normal prefill's choice.

One measure for the offline harness (`benchmarks/fusion_retention.py`) and the server's live
shadow check (`sglang_ext/server/shadow_checks.py`), so their figures compare: the served tokens
are teacher-forced through the normal prefill (the prompt, then the served tokens), and at every
served position the normal prefill's greedy choice is compared with the token that was served.
A flip early in an answer does not make every later token disagree: each position is judged
after the same served history. For a request decoded greedily the served token is the fused
prefill's own greedy choice, so 1.0 means the fused KV led to the very answer the normal prefill
gives; at ratio 1 (exact KV) it is 1.0 up to float near-ties.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Agreement:
    """The served tokens compared, how many the normal prefill would have chosen, and whether
    the first did (the one token that depends on the fused prefill alone, not on decoding)."""

    tokens: int
    agreeing: int
    first_token: bool

    @property
    def token_agreement(self) -> float:
        return self.agreeing / self.tokens


def token_agreement(served: Sequence[int], greedy: Sequence[int]) -> Agreement:
    """`greedy[i]`: the normal prefill's greedy choice after the prompt and `served[:i]`."""
    if not served or len(served) != len(greedy):
        raise ValueError(
            f"need one greedy choice per served token, got {len(greedy)} for {len(served)}"
        )
    agreeing = sum(int(a) == int(b) for a, b in zip(served, greedy, strict=True))
    return Agreement(len(served), agreeing, int(served[0]) == int(greedy[0]))
