"""Shared fixtures: prepared models, and the real SGLang servers that several test files use
(one per session each, stopped after the last test that uses it: tests/shared_servers.py).
Every server of the session is forked from one process that imported SGLang once
(tests/server_zygote.py: a start costs seconds instead of 20-30 s of imports on 2 cores),
except where a test asks for `spawned_servers`."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests import parallel_workers  # noqa: E402

parallel_workers.prepare_this_process()  # before anything imports torch

from scripts.prepare_models import (  # noqa: E402
    SMOLLM2,
    TINY_LLAMA,
    TINY_QWEN2,
    TINY_SMOLLM2,
    prepare,
)
from sglang_hicache_ext.sglang_ext.config.disk_tier_settings import disk_tier_extra_config  # noqa: E402
from sglang_hicache_ext.sglang_ext.server.launcher import (  # noqa: E402
    ServerConfig,
    generate,
    server_starter,
    start_subprocess,
)
from sglang_hicache_ext.sglang_ext.server.ports import free_port  # noqa: E402
from tests.server_zygote import zygote  # noqa: E402
from tests.shared_servers import SharedServers  # noqa: E402

__all__ = ["E2E_DEVICE_TOKENS", "generate"]

# Small device pool so a handful of ~1K-token prompts pushes older ones to the host tier.
E2E_DEVICE_TOKENS = 4096
# Prefill round of `chunked_prefill_server`: long prompts and chunk captures span several.
CHUNKED_PREFILL_TOKENS = 128
# Shadow checks `chunked_prefill_server` keeps waiting for spare capacity.
SHADOW_QUEUE = 8

SHARED_SERVERS = SharedServers()
SERVER_FORKS = contextlib.ExitStack()


def pytest_sessionstart(session: pytest.Session) -> None:
    if parallel_workers.is_controller(session.config):
        return  # the xdist workers run the tests, each with its own zygote
    SHARED_SERVERS.start_session()
    # Servers are forked from one process that imports SGLang once (tests/server_zygote.py);
    # it imports on the other core while the first tests run.
    # Its socket and log live in a folder removed at the session's end (one was left in /tmp
    # per worker and run before).
    socket_dir = Path(SERVER_FORKS.enter_context(tempfile.TemporaryDirectory(prefix="zygote-")))
    SERVER_FORKS.enter_context(server_starter(SERVER_FORKS.enter_context(zygote(socket_dir)).start))


def pytest_sessionfinish(session: pytest.Session) -> None:
    SHARED_SERVERS.end_session()
    SERVER_FORKS.close()


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return parallel_workers.auto_workers()


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    # `-n` alone (xdist's "load"): this suite's groups; an explicit --dist is xdist's own.
    return (
        parallel_workers.make_scheduler(config, log) if config.getvalue("dist") == "load" else None
    )


def pytest_testnodedown(node: object, error: object) -> None:
    parallel_workers.worker_down(node, error)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: object) -> bool | None:
    return parallel_workers.set_timeout_timer(item, settings)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if parallel_workers.worker_index() is not None:
        parallel_workers.group_items(items)


@pytest.fixture
def spawned_servers() -> Iterator[None]:
    """Servers started as `python -m sglang.launch_server` subprocesses, as users start them."""
    with server_starter(start_subprocess):
        yield


def pytest_collection_finish(session: pytest.Session) -> None:
    SHARED_SERVERS.plan(session.items)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    SHARED_SERVERS.release_after(item)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread for a module: the 2 cores are shared with servers, and two spinning
    threads are far slower than one there."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return prepare(SMOLLM2)


@pytest.fixture(scope="session")
def tiny_llama_path() -> Path:
    return prepare(TINY_LLAMA)


@pytest.fixture(scope="session")
def tiny_qwen2_path() -> Path:
    return prepare(TINY_QWEN2)


@pytest.fixture(scope="session")
def tiny_smollm2_path() -> Path:
    """Random weights behind SmolLM2's tokenizer (scripts/prepare_models.py): for the tests of
    HiCache's tiers, whose prompts it tokenises as SmolLM2 does at a few percent of the cost."""
    return prepare(TINY_SMOLLM2)


@pytest.fixture(scope="session")
def models(tiny_llama_path: Path, tiny_qwen2_path: Path) -> dict[str, object]:
    """The tiny Llama and Qwen2 models (fp32) behind the fusion engine's transformers adapter."""
    import torch
    from transformers import AutoModelForCausalLM

    from sglang_hicache_ext.fusion.adapters.hf import HFCausalLMAdapter

    paths = {"llama": tiny_llama_path, "qwen2": tiny_qwen2_path}
    out: dict[str, object] = {}
    for family, path in paths.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out[family] = HFCausalLMAdapter(model)
    return out


@pytest.fixture(scope="session")
def hicache_server(
    tiny_smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerConfig]:
    """`hicache_config`, shared by the fusion tests. What they assert is the server's, not the
    weights': r = 1 is the normal prefill, concurrent answers are the one-by-one ones, budgets,
    reports, status codes, stored rows equal to the model's keys. So the model is SmolLM2's
    tokenizer over random weights (`tiny_smollm2_path`): SmolLM2's prompts, tokens and chat
    template at a few percent of its prefill (measured: the suite's SmolLM2 prefills were half
    of `make test`'s CPU time). What fusion does to real answers is measured on models that can
    answer, in process (tests/test_fusion_smollm2.py, tests/test_fused_answers.py) and by the
    benchmarks."""
    workdir = tmp_path_factory.mktemp("hicache_server")
    # Their prompts are short around their documents; what they test is the fused path, so it
    # is taken whatever share of a prompt its chunks cover (the break-even fallback is tested
    # on the auto_chunks server, tests/test_server_auto_chunks.py).
    config = hicache_config(tiny_smollm2_path, workdir).with_settings(
        workdir / "settings.json", {"fusion_min_matched_share": 0.0}
    )
    with SHARED_SERVERS.serve("hicache_server", config, workdir / "server.log") as running:
        yield running


def hicache_config(model_path: Path, workdir: Path) -> ServerConfig:
    """--radix-cache-backend hicache_ext with HiCache's host tier and SGLang's file tier below
    it (in `workdir`)."""
    return ServerConfig(
        model_path=str(model_path),
        port=free_port(),
        max_total_tokens=E2E_DEVICE_TOKENS,
        hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(workdir / "hicache"),
        # Host tier large enough to keep the target while fillers push it off the device;
        # SGLang's Prometheus /metrics on, for tests/test_server_metrics.py.
        extra_args=("--hicache-ratio", "4", "--enable-metrics"),
    )


def disk_tier_config(model_path: Path, disk_dir: Path, **options: object) -> ServerConfig:
    """Our disk tier: 2 GB, group TTLs over 2 groups, plans triggered by the tests.

    `group-always` publishes the group plan at every re-plan: these tests check what groups do
    on a live server (pages carry them, TTLs follow them). The default `group` policy publishes
    groups only after its shadow disks have shown over several periods that they earn more
    hits than one TTL (tests/test_ttl_shadow_guard.py; `ttl_guard_status` below on a server).
    """
    extra = disk_tier_extra_config(
        disk_dir,
        **{
            "capacity_bytes": 2e9,
            "ttl_policy": "group-always",
            "ttl_groups": 2,
            "ttl_period_s": 3600,
            "purge_interval_s": 0.5,
            **options,
        },
    )
    return ServerConfig(
        model_path=str(model_path),
        port=free_port(),
        max_total_tokens=E2E_DEVICE_TOKENS,
        hierarchical_cache=True,
        hicache_storage_backend="dynamic",
        extra_args=(
            "--hicache-ratio",
            "4",
            "--hicache-storage-backend-extra-config",
            json.dumps(extra),
        ),
    )


@pytest.fixture(scope="session")
def disk_server(
    tiny_smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerConfig]:
    """The disk tier and SGLang's Prometheus /metrics, one per session: shared by
    tests/test_server_disk_tier.py and tests/test_server_metrics.py. What they check (pages
    written, read back unchanged, expired on time) is the tier's, not the model's: SmolLM2's
    tokenizer over random weights (`tiny_smollm2_path`)."""
    workdir = tmp_path_factory.mktemp("disk_tier")
    config = disk_tier_config(tiny_smollm2_path, workdir / "disk", initial_ttl_s=600)
    config = dataclasses.replace(config, extra_args=(*config.extra_args, "--enable-metrics"))
    with SHARED_SERVERS.serve("disk_server", config, workdir / "server.log") as running:
        yield running


@pytest.fixture(scope="session")
def chunked_prefill_server(
    tiny_smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerConfig]:
    """Prefilling in rounds of `CHUNKED_PREFILL_TOKENS`, HiCache host tier: shared by
    tests/test_server_concurrency.py, tests/test_server_long_fused_prompt.py and the chunk
    capture across rounds of tests/test_server_chunks.py. Every fused answer is shadow-checked (`fusion_shadow_rate` 1)
    into a queue of `SHADOW_QUEUE`: concurrent traffic fills it. What these tests assert is
    scheduling's, not the weights': each answer under concurrent, split traffic is its own
    one-by-one answer, r = 1 is the normal prefill, stored rows are the model's keys. So the
    model is SmolLM2's tokenizer over random weights (`tiny_smollm2_path`): SmolLM2's prompts
    and rounds, a prefill a few percent of its cost."""
    workdir = tmp_path_factory.mktemp("chunked_prefill")
    settings = {
        "fusion_shadow_rate": 1.0,
        "fusion_shadow_queue": SHADOW_QUEUE,
        "fusion_shadow_idle_s": 0.2,
        # These tests compare fused answers to the same prompts' earlier ones: rows a check
        # kept for their documents would change the later ones, by design
        # (tests/test_server_auto_chunks.py tests that).
        "fusion_shadow_refresh": False,
        # The mix's below-break-even requests hold a document in about a quarter of their
        # tokens: under this share, above none of its fused requests' (tests/test_server_concurrency.py).
        "fusion_min_matched_share": 0.3,
    }
    config = ServerConfig(
        model_path=str(tiny_smollm2_path),
        port=free_port(),
        # Room for every request at once: a retracted request is re-prefilled with its output,
        # which is legitimately a different computation than its one-by-one run.
        max_total_tokens=20_000,
        hierarchical_cache=True,
        extra_args=(
            "--chunked-prefill-size",
            str(CHUNKED_PREFILL_TOKENS),
            "--hicache-ratio",
            "2",
        ),
    ).with_settings(workdir / "settings.json", settings)
    with SHARED_SERVERS.serve("chunked_prefill_server", config, workdir / "server.log") as running:
        yield running


def tiny_qwen2_config(model_path: Path) -> ServerConfig:
    """Tiny Qwen2 with the launcher's defaults: no hierarchical cache, no settings, no keys."""
    return ServerConfig(model_path=str(model_path), port=free_port(), max_total_tokens=4096)


@pytest.fixture(scope="session")
def tiny_qwen2_launch(
    tiny_qwen2_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[ServerConfig, Path]:
    """The config and log of `tiny_qwen2_server`."""
    workdir = tmp_path_factory.mktemp("tiny_qwen2_server")
    return tiny_qwen2_config(tiny_qwen2_path), workdir / "server.log"


@pytest.fixture(scope="session", autouse=True)
def _spawned_server_started_early(request: pytest.FixtureRequest) -> None:
    """`tiny_qwen2_server` is spawned, not forked: ~30 s of imports in its three processes. They
    run from the first test on, beside the tests before its users, instead of in their setup."""
    # Not in an xdist worker: the cores are busy with the workers' tests, and this worker may
    # not be the one that runs its users.
    if SHARED_SERVERS.planned("tiny_qwen2_server") and parallel_workers.worker_index() is None:
        config, log_path = request.getfixturevalue("tiny_qwen2_launch")
        with server_starter(start_subprocess):
            SHARED_SERVERS.start_early("tiny_qwen2_server", config, log_path)


@pytest.fixture(scope="session")
def tiny_qwen2_server(tiny_qwen2_launch: tuple[ServerConfig, Path]) -> Iterator[ServerConfig]:
    """`tiny_qwen2_config`, one per session: shared by tests/test_server_plain_tree.py and the
    no-keys setup of tests/test_server_auth.py. Started as users start it, `python -m
    sglang.launch_server` (SGLang spawning its scheduler, which loads the plugin itself), where
    the other servers are forked from the test zygote; started early, at the first test."""
    config, log_path = tiny_qwen2_launch
    with contextlib.ExitStack() as stack:
        with server_starter(start_subprocess):
            running = stack.enter_context(
                SHARED_SERVERS.serve("tiny_qwen2_server", config, log_path)
            )
        yield running
