"""A fused request's rows handed out round by round (`fusion/fused_rows.py`), without SGLang:
each round gets exactly its positions' K/V and the hidden states of the positions it needs,
in order, and a round that asks for other positions is refused."""

from __future__ import annotations

import pytest
import torch

from sglang_hicache_ext.fusion.fused_rows import FusedRows


def _rows(start: int, end: int, hidden_start: int) -> FusedRows:
    n = end - start
    positions = torch.arange(start, end, dtype=torch.float32)
    keys = [positions.view(n, 1, 1).expand(n, 2, 4).clone() + layer for layer in range(3)]
    values = [k + 100 for k in keys]
    hidden = torch.arange(hidden_start, end, dtype=torch.float32).view(-1, 1)
    return FusedRows(start, end, keys, values, hidden, hidden_start, {})


def test_rounds_take_their_positions_in_order() -> None:
    rows = _rows(10, 30, hidden_start=25)
    first = rows.take(10, 12)  # positions 10..21: no hidden state needed
    assert first.hidden is None and first.keys[1][:, 0, 0].tolist() == [
        p + 1 for p in range(10, 22)
    ]
    second = rows.take(22, 8)  # positions 22..29: hidden states of 25..29
    assert second.values[0][:, 0, 0].tolist() == [p + 100 for p in range(22, 30)]
    assert second.hidden is not None and second.hidden[:, 0].tolist() == [25, 26, 27, 28, 29]
    assert second.hidden_offset == 3
    assert rows.done and rows.rounds == 2


def test_a_round_at_other_positions_is_refused() -> None:
    rows = _rows(0, 16, hidden_start=15)
    with pytest.raises(RuntimeError, match="cover positions 0..15"):
        rows.take(4, 4)
    with pytest.raises(RuntimeError):
        rows.take(0, 17)


def test_kept_rows_move_to_host_once() -> None:
    rows = _rows(0, 8, hidden_start=7)
    rows.take(0, 4)
    rows.keep_on_host()
    assert rows.on_host and all(k.device.type == "cpu" for k in rows.keys)
    assert rows.nbytes == (2 * 3 * 4 * 2 * 4 + 1) * 4
