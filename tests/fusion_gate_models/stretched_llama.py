"""`StretchedLlamaForCausalLM`: SGLang's Llama rotating every token at twice its position.

Fusion finds the Llama adapter through the class's MRO, but the adapter rotates at the plain
positions: its fused prefill at ratio 1 is not this model's, which the live gate must catch."""

from __future__ import annotations

from typing import Any

from sglang.srt.models.llama import LlamaForCausalLM


class StretchedLlamaForCausalLM(LlamaForCausalLM):
    def forward(
        self, input_ids: Any, positions: Any, forward_batch: Any, *args: Any, **kwargs: Any
    ) -> Any:
        return super().forward(input_ids, positions * 2, forward_batch, *args, **kwargs)


EntryClass = StretchedLlamaForCausalLM
