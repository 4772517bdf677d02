"""`AutoCapture` in process, over a stand-in for SGLang's KV pool: pieces prepared on the
background thread are the pieces prepared inline, a prompt waits only for its own pieces, and
under memory pressure one-offs do not take a popular document's place."""

from __future__ import annotations

import threading

import pytest
import torch

from sglang_hicache_ext.fusion.chunk import chunk_hash
from sglang_hicache_ext.fusion.frequency import layer_frequency_scores
from sglang_hicache_ext.fusion.rope import RopeSpec, apply_rope
from sglang_hicache_ext.radix.segments import SegmentRule
from sglang_hicache_ext.sglang_ext.chunk_fusion.auto_capture import AutoCapture
from sglang_hicache_ext.sglang_ext.chunk_fusion.registry import ChunkRegistry
from sglang_hicache_ext.tiers.chunks.admission import FrequencyAdmission
from sglang_hicache_ext.tiers.short_lived_worker import ShortLivedWorker

LAYERS, HEADS, DIM = 3, 2, 16
BREAK = 0
SPEC = RopeSpec(inv_freq=1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM)))


class _Pool:
    """The part of SGLang's KV pool a capture reads: per-layer buffers of rotated keys."""

    def __init__(self, slots: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.start_layer, self.layer_num = 0, LAYERS
        self.raw = [torch.randn(slots, HEADS, DIM, generator=generator) for _ in range(LAYERS)]
        self.values = [torch.randn(slots, HEADS, DIM, generator=generator) for _ in range(LAYERS)]
        self.keys: list[torch.Tensor] = []

    def place(self, slots: torch.Tensor) -> None:
        """Rotate the raw keys at `slots` to the prompt positions 0..n-1 they sit at."""
        self.keys = [k.clone() for k in self.raw]
        for layer in range(LAYERS):
            self.keys[layer][slots] = apply_rope(
                self.raw[layer][slots], torch.arange(len(slots)), SPEC
            )

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.keys[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.values[layer]


def _prompt(docs: list[list[int]]) -> list[int]:
    tokens: list[int] = []
    for doc in docs:
        tokens += [*doc, BREAK]
    return tokens


def _docs(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 1000, (40,), generator=generator).tolist() for _ in range(count)]


def _capture(background: bool) -> AutoCapture:
    registry = ChunkRegistry(64 << 20, SPEC)
    return AutoCapture(
        registry, frozenset({BREAK}), SegmentRule(32, 512, 256), 600, None, background=background
    )


def _run(capture: AutoCapture, pool: _Pool, rid: str, tokens: list[int]) -> int:
    slots = torch.randperm(pool.values[0].shape[0], generator=torch.Generator().manual_seed(7))
    slots = slots[: len(tokens)]
    pool.place(slots)
    return capture.capture(rid, tokens, pool, slots)


@pytest.mark.parametrize("background", [True, False])
def test_pieces_are_the_rows_the_prompt_computed_rotated_back(background: bool) -> None:
    pool, capture = _Pool(400, seed=1), _capture(background)
    docs = _docs(3, seed=2)
    tokens = _prompt(docs)
    slots = torch.randperm(400, generator=torch.Generator().manual_seed(7))[: len(tokens)]
    assert _run(capture, pool, "a", tokens) == 3
    capture.settle(wait=True)
    store = capture.registry.store
    for number, doc in enumerate(docs):
        start = number * (len(doc) + 1)
        chunk = store.peek(chunk_hash(doc))
        assert chunk is not None
        rows = slots[start : start + len(doc)]
        for layer in range(LAYERS):
            torch.testing.assert_close(
                chunk.keys[layer], pool.raw[layer][rows], atol=1e-5, rtol=1e-5
            )
            assert torch.equal(chunk.values[layer], pool.values[layer][rows])
        torch.testing.assert_close(
            chunk.freq_scores, layer_frequency_scores(chunk.keys, chunk.values)
        )
        assert capture.registry.prefix_of(chunk_hash(doc))[1] == start
    assert capture.stats()["captured"] == 3 and capture.stats()["tokens_captured"] == 120


def test_a_prompt_waits_only_for_its_own_pending_pieces() -> None:
    pool, capture = _Pool(400, seed=3), _capture(background=True)
    gate = threading.Event()
    assert capture._worker is not None
    capture._worker.submit(gate.wait)  # the worker is busy until the gate opens
    first, other = _docs(2, seed=4), _docs(2, seed=5)
    assert _run(capture, pool, "first", _prompt(first)) == 2
    capture.settle(_prompt(other))  # holds none of the pending pieces: returns at once
    assert chunk_hash(first[0]) not in capture.registry.store
    # The same documents again while pending: counted covered, not prepared twice.
    assert _run(capture, pool, "again", _prompt(first)) == 0
    assert capture.counts["covered"] == 2
    threading.Timer(0.2, gate.set).start()
    # Behind a label of its own (another paragraph, another hash), matched like a stored chunk:
    # waits for the job holding it.
    capture.settle(_prompt([[7, 8, 9, *first[1]]]))
    assert chunk_hash(first[1]) in capture.registry.store
    assert capture.registry.index.find(_prompt(other + [first[1]]))
    assert capture.stats()["captured"] == 2


def test_background_jobs_run_in_order_each_on_a_thread_that_ends() -> None:
    worker = ShortLivedWorker("test-capture")
    gate, order, threads = threading.Event(), [], []

    def job(name: str, wait: bool) -> str:
        if wait:
            gate.wait()
        order.append(name)
        threads.append(threading.current_thread())
        return name

    first, second = worker.submit(job, "first", True), worker.submit(job, "second", False)
    assert not second.done()  # waits for the first job, which waits for the gate
    gate.set()
    assert (first.result(timeout=5), second.result(timeout=5)) == ("first", "second")
    assert order == ["first", "second"] and threads[0] is not threads[1]
    for thread in threads:  # no thread outlives its job (it would keep its OpenMP team)
        thread.join(timeout=5)
        assert not thread.is_alive()

    def broken() -> None:
        raise RuntimeError("bug in a job")

    with pytest.raises(RuntimeError, match="bug in a job"):
        worker.submit(broken).result(timeout=5)
    assert worker.submit(job, "after", False).result(timeout=5) == "after"


def test_a_cpu_forward_starts_after_every_pending_piece_is_stored() -> None:
    # On CPU the forward's OpenMP team and the preparation would share the cores.
    pool, capture = _Pool(400, seed=6), _capture(background=True)
    gate = threading.Event()
    assert capture._worker is not None
    capture._worker.submit(gate.wait)
    docs = _docs(2, seed=8)
    assert _run(capture, pool, "a", _prompt(docs)) == 2
    threading.Timer(0.2, gate.set).start()
    capture.before_forward()
    assert all(chunk_hash(doc) in capture.registry.store for doc in docs)
    assert not capture._jobs and capture.counts["captured"] == 2


def test_a_forward_off_the_cpu_does_not_wait_for_pending_pieces() -> None:
    pool, capture = _Pool(400, seed=6), _capture(background=True)
    pool.raw = [k.to("meta") for k in pool.raw]  # a device that is not the CPU's cores
    pool.values = [v.to("meta") for v in pool.values]
    pool.keys = pool.raw
    gate = threading.Event()
    assert capture._worker is not None
    capture._worker.submit(gate.wait)
    tokens = _prompt(_docs(2, seed=8))
    assert capture.capture("a", tokens, pool, torch.arange(len(tokens), device="meta")) == 2
    capture.before_forward()  # the gate is shut: returns at once
    assert len(capture._jobs) == 1 and not capture._jobs[0][0].done()
    gate.set()


@pytest.mark.parametrize("admission", ["frequency", "adaptive", None], ids=str)
def test_a_one_off_does_not_push_a_popular_document_out(admission: str | None) -> None:
    """Host memory with room for two pieces; a popular document beside a new one-off in every
    prompt. By frequency the one-offs are refused before their rows are copied (nothing
    prepared); by recency each evicts the popular document, which is computed again."""
    per_piece = 40 * LAYERS * 2 * HEADS * DIM * 4  # dense fp32 rows of a 40-token piece
    capacity = 2 * per_piece + 4096
    gate = (
        FrequencyAdmission.for_entries(64, capacity if admission == "adaptive" else None)
        if admission
        else None
    )
    registry = ChunkRegistry(capacity, SPEC, admission=gate)
    capture = AutoCapture(
        registry, frozenset({BREAK}), SegmentRule(32, 512, 256), 600, None, admission=gate
    )
    pool = _Pool(400, seed=8)
    popular, *one_offs = _docs(5, seed=9)
    for number, once in enumerate(one_offs):
        _run(capture, pool, f"r{number}", _prompt([popular, once]))
        capture.settle(wait=True)
    kept = chunk_hash(popular) in registry.store
    counts = capture.stats()
    if admission:
        assert kept and chunk_hash(one_offs[0]) in registry.store  # the free bytes: anyone's
        assert counts["refused"] == 3 and counts["captured"] == 2
        assert registry.stats()["refused_by_frequency"] == 0  # refused before any copy
        admission = registry.stats()["admission"]  # what /server_info reports
        assert admission["mode"] == "frequency"
        if gate is not None and gate.shadows:  # adaptive: the shadows saw what the rule serves
            assert admission["shadow_hit_bytes"]["frequency"] > 0
    else:
        assert not kept and counts["refused"] == 0
        assert registry.stats()["admission"] is None
        assert counts["captured"] >= 4  # the popular document computed and kept again


def test_a_document_under_another_label_in_each_prompt_is_counted_as_one() -> None:
    """Host memory full of two pieces seen twice each; a document then arrives under another
    label each time ("Document 3. ", "[12] ": other tokens, another length, inside its
    paragraph), so each sight is another piece id. Its sights are counted by its content: its
    third sight outnumbers the pieces it would evict and it is kept; no label is kept twice."""
    per_piece = 42 * LAYERS * 2 * HEADS * DIM * 4  # dense fp32 rows, a labelled 40-token doc
    capacity = 2 * per_piece + 4096
    gate = FrequencyAdmission.for_entries(64)
    registry = ChunkRegistry(capacity, SPEC, admission=gate)
    capture = AutoCapture(
        registry, frozenset({BREAK}), SegmentRule(32, 512, 256), 600, None, admission=gate
    )
    pool = _Pool(400, seed=8)
    old_a, old_b, doc = _docs(3, seed=10)
    for number in range(2):
        _run(capture, pool, f"old{number}", _prompt([[7, 7, *old_a], [7, 7, *old_b]]))
        capture.settle(wait=True)
    assert capture.stats()["captured"] == 2
    labels = [[1001], [1002, 1003], [1004, 1005, 1006]]
    for number, label in enumerate(labels):
        _run(capture, pool, f"doc{number}", _prompt([[*label, *doc]]))
        capture.settle(wait=True)
        held = [key for key, _ in registry.store.host.items()]
        kept = [key for key in held if registry.index.tokens(key)[-40:] == tuple(doc)]
        assert len(kept) == (1 if number == 2 else 0), number
    counts = capture.stats()
    assert (counts["refused"], counts["captured"]) == (2, 3)


@pytest.mark.parametrize("admission", ["frequency", None], ids=str)
def test_host_memorys_decisions_are_exported_as_they_grow(admission: str | None) -> None:
    """`sglang:hicache_ext_chunk_host_decisions_total{decision}` follows host memory's own
    counts after every store: the evictions LRU made, or the admissions by frequency."""
    from prometheus_client import CollectorRegistry

    from sglang_hicache_ext.sglang_ext.metrics.prometheus_metrics import (
        HOST_DECISIONS,
        ExtensionMetrics,
    )

    prometheus = CollectorRegistry()
    metrics = ExtensionMetrics({"model_name": "m", "tp_rank": "0"}, registry=prometheus)
    capacity = 2 * 40 * LAYERS * 2 * HEADS * DIM * 4 + 4096
    gate = FrequencyAdmission.for_entries(64) if admission else None
    registry = ChunkRegistry(capacity, SPEC, admission=gate, metrics=metrics)
    capture = AutoCapture(
        registry, frozenset({BREAK}), SegmentRule(32, 512, 256), 600, None, admission=gate
    )
    pool = _Pool(400, seed=8)
    popular, *others = _docs(6, seed=11)
    for number, other in enumerate(others):
        _run(capture, pool, f"r{number}", _prompt([popular, other, popular[::-1]]))
        capture.settle(wait=True)
    host = registry.store.stats().host
    exported = {
        decision: prometheus.get_sample_value(
            "sglang:hicache_ext_chunk_host_decisions_total",
            {"model_name": "m", "tp_rank": "0", "decision": decision},
        )
        or 0
        for decision in HOST_DECISIONS
    }
    assert exported == {decision: getattr(host, decision) for decision in HOST_DECISIONS}
    assert sum(exported.values()) > 0


def test_a_deferred_capture_takes_the_rows_at_the_slots_it_was_given() -> None:
    """`defer` captures nothing until `run_deferred` (the scheduler runs it once the batch's
    first tokens are sent); then it keeps what `capture` keeps, from the slots as they were at
    `defer` (the request's slot table may be handed on meanwhile)."""
    pool, capture = _Pool(400, seed=1), _capture(background=False)
    docs = _docs(2, seed=4)
    tokens = _prompt(docs)
    slots = torch.randperm(400, generator=torch.Generator().manual_seed(7))[: len(tokens)]
    pool.place(slots)
    table = slots.clone()
    capture.defer("a", tokens, pool, table)
    table.fill_(0)  # the request's row of the slot table, reused
    assert capture.stats()["captured"] == 0
    assert all(capture.registry.store.peek(chunk_hash(doc)) is None for doc in docs)
    capture.run_deferred()
    capture.settle(wait=True)
    assert capture.stats()["captured"] == 2
    for number, doc in enumerate(docs):
        chunk = capture.registry.store.peek(chunk_hash(doc))
        assert chunk is not None
        rows = slots[number * (len(doc) + 1) :][: len(doc)]
        assert torch.equal(chunk.values[0], pool.values[0][rows])
    capture.run_deferred()  # nothing left: no second capture
    assert capture.stats()["captured"] == 2
