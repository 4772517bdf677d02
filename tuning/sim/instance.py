"""One serving instance: FIFO queue, continuous batching, GPU prefix cache and DRAM tier.

Scheduling follows SGLang's default: whenever requests wait and fit in the KV pool, a prefill
batch (up to `max_prefill_tokens` new tokens, at least one request) runs before decoding resumes;
otherwise the running batch decodes. Decode steps are simulated in bulk between events, with the
context growth summed in closed form, so the cost is per event rather than per token.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from sglang_hicache_ext.tuning.lru import BlockLru
from sglang_hicache_ext.tuning.sim.config import DiskConfig
from sglang_hicache_ext.tuning.sim.disk import DiskTier
from sglang_hicache_ext.tuning.sim.profile import Profile
from sglang_hicache_ext.tuning.trace import SimRequest


@dataclass
class Prefetch:
    """Disk blocks being copied to host memory for a queued request, in prefix order."""

    blocks: tuple[str, ...]
    start: float
    end: float
    per_block_s: float

    def ready(self, now: float) -> int:
        if not self.blocks or now < self.start:
            return 0
        return min(len(self.blocks), int((now - self.start) / self.per_block_s + 1e-9))


@dataclass
class Waiting:
    rid: int
    request: SimRequest
    prefetch: Prefetch | None
    hold_until: float = 0.0  # `timeout` policy: not admitted before min(this, prefetch end)


@dataclass
class Admitted:
    rid: int
    request: SimRequest
    gpu_hits: int
    dram_hits: int
    disk_hits: int


@dataclass
class Running:
    rid: int
    remaining: int
    context: int
    reserved: int


@dataclass
class Stats:
    """Per-request outcomes, filled in by the instances (indexed by request id)."""

    ttft: list[float]
    queue: list[float]
    finish: list[float]
    gpu_hits: int = 0
    dram_hits: int = 0
    disk_hits: int = 0
    blocks: int = 0


@dataclass
class Instance:
    profile: Profile
    prefix_cache: BlockLru
    dram: BlockLru
    disk: DiskTier | None
    stats: Stats
    disk_config: DiskConfig | None = None
    queue: deque[Waiting] = field(default_factory=deque)
    running: list[Running] = field(default_factory=list)
    reserved_tokens: int = 0
    busy: bool = False
    pending: list[Admitted] | None = None  # the prefill batch now running, if any

    def enqueue(self, rid: int, request: SimRequest, now: float) -> None:
        """A request arrives: start prefetching the disk part of its cached prefix (SGLang's
        storage prefetch runs while the request waits in the queue, and only then)."""
        prefetch = None
        if self.disk is not None:
            blocks: list[str] = []
            for block in request.blocks:
                if block in self.prefix_cache or block in self.dram:
                    continue
                if not self.disk.live(block, now):
                    break
                blocks.append(block)
            spec = self.disk_config or DiskConfig()
            tokens = len(blocks) * self.profile.block_tokens
            if blocks and tokens >= spec.prefetch_threshold_tokens:
                per_block = self.disk.block_bytes / self.disk.channel.bytes_per_s
                start, end = self.disk.channel.reserve(now, len(blocks) * self.disk.block_bytes)
                prefetch = Prefetch(tuple(blocks), start, end, per_block)
                if spec.prefetch_policy == "timeout":
                    deadline = now + spec.prefetch_timeout_base_s
                    deadline += spec.prefetch_timeout_per_ki_token_s * tokens / 1024
                    self.queue.append(Waiting(rid, request, prefetch, min(end, deadline)))
                    return
        self.queue.append(Waiting(rid, request, prefetch))

    def next_iteration(self, now: float, next_arrival: float) -> float | None:
        """Start the next batch at `now`; returns when it ends, or None when idle."""
        batch = self._admit(now)
        if batch:
            self.pending = batch
            return now + self._prefill_s(batch)
        self.pending = None
        if not self.running:
            held = self._held_until(now)
            if held is None or math.isinf(held):
                return None
            # Only requests held for their prefetch: wait for the first of them, or an arrival.
            return min(held, next_arrival)
        batch_size = len(self.running)
        context = sum(r.context for r in self.running)
        steps = min(r.remaining for r in self.running)
        held = self._held_until(now)
        if held is not None and next_arrival > now:
            # Stop decoding at the next arrival (or when a held request's prefetch is done) so
            # that it can be prefilled promptly.
            budget = min(next_arrival, held) - now
            steps = min(steps, self.profile.decode_steps_within(batch_size, context, budget))
        for r in self.running:
            r.remaining -= steps
            r.context += steps
        return now + self.profile.decode_steps_s(batch_size, context, steps)

    def complete_iteration(self, now: float) -> None:
        if self.pending is not None:
            for admitted in self.pending:
                self._finish_prefill(admitted, now)
            self.pending = None
            return
        still: list[Running] = []
        for r in self.running:
            if r.remaining > 0:
                still.append(r)
            else:
                self.stats.finish[r.rid] = now
                self.reserved_tokens -= r.reserved
        self.running = still

    def _held_until(self, now: float) -> float | None:
        """When every queued request is held for its prefetch: the first release time
        (inf for an empty queue); None when some request could be admitted now."""
        times = [w.hold_until for w in self.queue]
        if any(t <= now for t in times):
            return None
        return min(times, default=math.inf)

    def _admit(self, now: float) -> list[Admitted]:
        batch: list[Admitted] = []
        new_tokens = 0
        p = self.profile
        held: list[Waiting] = []
        while self.queue and len(self.running) + len(batch) < p.max_running_requests:
            waiting = self.queue[0]
            if waiting.hold_until > now:
                held.append(self.queue.popleft())  # SGLang skips it; later requests go ahead
                continue
            request = waiting.request
            need = request.input_tokens + request.output_tokens
            if self.reserved_tokens + need > p.running_kv_tokens and (self.running or batch):
                break
            admitted = self._lookup(waiting, now)
            cached = self._cached_tokens(admitted)
            if batch and new_tokens + request.input_tokens - cached > p.max_prefill_tokens:
                break
            self.queue.popleft()
            self._commit(waiting, admitted, now)
            batch.append(admitted)
            new_tokens += request.input_tokens - cached
            self.reserved_tokens += need
        self.queue.extendleft(reversed(held))
        return batch

    def _lookup(self, waiting: Waiting, now: float) -> Admitted:
        gpu = dram = disk = 0
        prefetch = waiting.prefetch
        ready = set(prefetch.blocks[: prefetch.ready(now)]) if prefetch else set()
        for block in waiting.request.blocks:
            if block in self.prefix_cache:
                gpu += 1
            elif block in self.dram:
                dram += 1
            elif block in ready:
                disk += 1
            else:
                break
        return Admitted(waiting.rid, waiting.request, gpu, dram, disk)

    def _commit(self, waiting: Waiting, admitted: Admitted, now: float) -> None:
        prefetch = waiting.prefetch
        if prefetch is not None and self.disk is not None:
            # The rest of an unfinished prefetch is cancelled when the request is scheduled.
            self.disk.channel.release(prefetch.end, max(now, prefetch.start))
        request = admitted.request
        self.stats.queue[admitted.rid] = now - request.arrival_s
        self.stats.gpu_hits += admitted.gpu_hits
        self.stats.dram_hits += admitted.dram_hits
        self.stats.disk_hits += admitted.disk_hits
        self.stats.blocks += len(request.blocks)

    def _cached_tokens(self, admitted: Admitted) -> int:
        hits = admitted.gpu_hits + admitted.dram_hits + admitted.disk_hits
        # At least the last prompt token is computed, to produce the first output token.
        return min(hits * self.profile.block_tokens, admitted.request.input_tokens - 1)

    def _prefill_s(self, batch: list[Admitted]) -> float:
        p = self.profile
        compute = p.prefill_base_s
        loaded_blocks = 0
        for admitted in batch:
            cached = self._cached_tokens(admitted)
            compute += p.prefill_compute_s(admitted.request.input_tokens - cached, cached)
            loaded_blocks += admitted.dram_hits + admitted.disk_hits
        # Host -> GPU loads overlap layer by layer with compute (HiCache's layer-wise transfer).
        return max(compute, loaded_blocks * p.block_bytes / p.host_to_gpu_bytes_s)

    def _finish_prefill(self, admitted: Admitted, now: float) -> None:
        request = admitted.request
        self.stats.ttft[admitted.rid] = now - request.arrival_s
        self.prefix_cache.insert_all(request.blocks)
        self.dram.insert_all(request.blocks)
        if self.disk is not None:
            # Write-through from host memory; blocks already stored are refreshed.
            for block in request.blocks:
                self.disk.write(block, now)
        if request.output_tokens <= 1:
            self.stats.finish[admitted.rid] = now
            self.reserved_tokens -= request.input_tokens + request.output_tokens
            return
        self.running.append(
            Running(
                admitted.rid,
                request.output_tokens - 1,
                request.input_tokens + 1,
                request.input_tokens + request.output_tokens,
            )
        )
