"""A chunk held in pinned host memory and read to the GPU layer by layer, ahead of the compute.

On a GPU server the chunks that do not fit the GPU live in host memory. Reading a layer's rows
at the point of use stalls the compute for the whole PCIe transfer; this chunk reports itself
as not in memory, so the executor's layer loader (`fusion.layer_loader`) reads layer l+1 on its
reader thread while layer l computes (CacheTune §4.2, Eq. 9). The reader thread gathers the
planned rows and copies them on a stream of its own, so the copy runs beside the compute
kernels instead of behind them; it waits for its own stream only, and the executor gets rows
that are already on the GPU.

Only the rows a request reuses are moved when they are a minority of the chunk (a sparse load:
gathered on the CPU into a pinned staging buffer, then copied). When most rows are reused, as
at a low recompute ratio, the whole layer is copied and the rows are picked on the GPU: a CPU
gather of most of a layer costs more than the few extra bytes on the bus.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from sglang_hicache_ext.fusion.chunk import ModelShape, PrecomputedChunk

# Share of a chunk's rows above which the whole layer is copied and indexed on the GPU.
DENSE_ABOVE = 0.5


@functools.cache
def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """One copy stream per GPU, shared by every chunk (the loader has one reader thread)."""
    return torch.cuda.Stream(device=device)


@dataclass(frozen=True, eq=False)
class HostChunk:
    """`chunk`'s K/V pinned in host memory, read to `device` on demand (see the module doc).

    `device` may be the CPU (no pinning, no stream): the same reads, for machines without a GPU
    and for tests. `dense_above`: the share of rows above which a layer is copied whole.
    `side_stream`: False copies on the caller's stream, behind its compute, at the point of use
    (the serial baseline the overlap is measured against; such a chunk is never read ahead).
    """

    chunk: PrecomputedChunk
    device: torch.device
    dense_above: float = DENSE_ABOVE
    side_stream: bool = True

    @classmethod
    def hold(
        cls,
        chunk: PrecomputedChunk,
        device: torch.device | str,
        dense_above: float = DENSE_ABOVE,
        side_stream: bool = True,
    ) -> HostChunk:
        """Move `chunk`'s K/V to host memory (pinned when `device` is a GPU)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            # The reader thread's current GPU is GPU 0 whatever the caller's is: name it.
            device = torch.device("cuda", torch.cuda.current_device())
        if not 0.0 <= dense_above <= 1.0:
            raise ValueError(f"dense_above must be in [0, 1], got {dense_above}")
        host = chunk.to("cpu")
        if device.type == "cuda":
            host = PrecomputedChunk(
                token_ids=host.token_ids,
                keys=tuple(k.pin_memory() for k in host.keys),
                values=tuple(v.pin_memory() for v in host.values),
                freq_scores=host.freq_scores,
                alpha=host.alpha,
            )
        return cls(host, device, dense_above, side_stream)

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.chunk.token_ids

    @property
    def freq_scores(self) -> torch.Tensor:
        return self.chunk.freq_scores

    @property
    def alpha(self) -> float:
        return self.chunk.alpha

    @property
    def num_tokens(self) -> int:
        return self.chunk.num_tokens

    @property
    def num_layers(self) -> int:
        return self.chunk.num_layers

    @property
    def nbytes(self) -> int:
        return self.chunk.nbytes

    @property
    def in_memory(self) -> bool:
        # A read crosses the bus: worth starting a layer ahead, on the copy stream. Without it
        # the copy must run on the compute thread's stream, so the loader must not read ahead.
        return not self.side_stream

    @property
    def index_device(self) -> torch.device:
        return torch.device("cpu")  # rows are gathered or picked by host-side indices

    def check_compatible(self, shape: ModelShape) -> None:
        self.chunk.check_compatible(shape)

    def slice(self, start: int, end: int) -> HostChunk:
        # Row ranges of a contiguous [n, H, D] tensor stay contiguous views of pinned storage.
        return HostChunk(
            self.chunk.slice(start, end), self.device, self.dense_above, self.side_stream
        )

    def rows(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `rows` at `layer`, on `device`; returns once the copy has landed."""
        keys, values = self.chunk.keys[layer], self.chunk.values[layer]
        rows = rows.cpu()
        if self.device.type != "cuda":
            return keys[rows], values[rows]
        stream = (
            _copy_stream(self.device)
            if self.side_stream
            else torch.cuda.current_stream(self.device)
        )
        dense = rows.numel() > self.dense_above * self.num_tokens
        with torch.cuda.stream(stream):
            if dense:
                on_gpu = rows.to(self.device, non_blocking=True)
                k = keys.to(self.device, non_blocking=True)[on_gpu]
                v = values.to(self.device, non_blocking=True)[on_gpu]
            else:
                k = _gather_pinned(keys, rows).to(self.device, non_blocking=True)
                v = _gather_pinned(values, rows).to(self.device, non_blocking=True)
        # The reader thread waits, not the compute: the executor then uses rows that are there.
        stream.synchronize()
        return k, v


def _gather_pinned(source: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    staging = torch.empty((rows.numel(), *source.shape[1:]), dtype=source.dtype, pin_memory=True)
    return torch.index_select(source, 0, rows, out=staging)


__all__ = ["DENSE_ABOVE", "HostChunk"]
