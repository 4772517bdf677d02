"""Bad launches give one clear line and exit status 2, not a traceback wall."""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings, SettingsError
from sglang_hicache_ext.sglang_ext.config.settings_sources import CONFIG_ENV_VAR, EXTRA_CONFIG_KEY
from sglang_hicache_ext.sglang_ext.server.launcher import (
    ServerConfig,
    start_server,
    stop_process_group,
)
from sglang_hicache_ext.sglang_ext.server.ports import free_port
from sglang_hicache_ext.sglang_ext.server.preflight import (
    PreflightError,
    check_chunk_disk,
    check_chunk_mooncake,
    check_disk_tier,
    check_model_path,
    check_port_free,
    check_ratio_table,
)
from sglang_hicache_ext.tuning.ratio.table import RatioTable, TunedRatio
from tests.server_processes import TCP_TIME_WAIT, tcp_states_on_port


def test_missing_model_folder(tmp_path: Path) -> None:
    with pytest.raises(PreflightError, match="no such folder"):
        check_model_path(str(tmp_path / "missing-model"))


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(PreflightError, match="no config.json"):
        check_model_path(str(tmp_path))


def test_hub_ids_are_left_to_sglang() -> None:
    check_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_port_in_use() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(PreflightError, match="already in use"):
            check_port_free("127.0.0.1", port)


def test_time_wait_sockets_do_not_hold_the_port() -> None:
    """What a crashed server leaves: its side of a connection it closed first, in TIME-WAIT."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            accepted.close()  # the server side closes first
            client.recv(1)  # its FIN has arrived
    assert TCP_TIME_WAIT in tcp_states_on_port(port)
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # what the check did before: a false "in use"
    check_port_free("127.0.0.1", port)
    with socket.socket() as holder:  # and a live listener on that port is still refused
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", port))
        holder.listen()
        with pytest.raises(PreflightError, match="already in use"):
            check_port_free("127.0.0.1", port)


def _launch(
    config: ServerConfig, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    environment = config.environment()
    environment.update(env or {})
    return subprocess.run(
        config.command(), env=environment, capture_output=True, text=True, timeout=180
    )


def refused_launch(config: ServerConfig, log_path: Path) -> subprocess.CompletedProcess[str]:
    """A launch expected to end at once, started as the session starts servers (forked from the
    test zygote, `tests/server_zygote.py`: the same launch code without 12 s of imports); its
    exit status, and its output as stderr. The launches of this module stay real subprocesses."""
    process = start_server(config, log_path)
    try:
        code = process.wait(timeout=180)
    except subprocess.TimeoutExpired:
        stop_process_group(process)
        raise
    return subprocess.CompletedProcess(config.command(), code, "", log_path.read_text())


def _assert_clear_error(result: subprocess.CompletedProcess[str], needle: str) -> None:
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    lines = [
        line for line in result.stderr.splitlines() if line.startswith("sglang-hicache-ext: error:")
    ]
    assert len(lines) == 1 and needle in lines[0], result.stderr[-2000:]


@dataclasses.dataclass(frozen=True)
class RefusedLaunch:
    result: subprocess.CompletedProcess[str]
    seconds: float


def _timed_launch(
    fields: dict[str, Any], env: dict[str, str] | None, forked_log: Path | None
) -> RefusedLaunch:
    started = time.monotonic()
    config = ServerConfig(**{"port": free_port(), **fields})
    if forked_log is None:
        result = _launch(config, env)
    else:
        result = refused_launch(dataclasses.replace(config, env=env or {}), forked_log)
    return RefusedLaunch(result, time.monotonic() - started)


@pytest.fixture(scope="module")
def refused_launches(
    request: pytest.FixtureRequest,
    smollm2_path: Path,
    tiny_llama_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Future[RefusedLaunch]]]:
    """The launches this module expects refused, keyed by their test's name, run two at a time
    from the first test that asks (the selected tests' launches only). One is a real
    `python -m sglang.launch_server` subprocess (the plain path, ~12 s of single-threaded
    imports before the one line; a second one cost as much again for the same path); the others
    are forked from the test zygote, which runs the same launch module as `__main__` without the
    imports (`refused_launch`)."""
    folder = tmp_path_factory.mktemp("refused_launches")
    disks = [tmp_path_factory.mktemp("chunk_disk") for _ in range(2)]  # one per launch
    files = {
        "ext.toml": 'cpu_compat = "maybe"\n',
        "extra.json": json.dumps({EXTRA_CONFIG_KEY: {"chunk_max_tokens": 0}}),
        "tier.json": json.dumps({"chunk_tiers": ["host", "nvme"], "chunk_disk_dir": str(disks[0])}),
        "codec.json": json.dumps({"chunk_codec": "int3", "chunk_disk_dir": str(disks[1])}),
    }
    for name, text in files.items():
        (folder / name).write_text(text)
    smollm2, tiny = {"model_path": str(smollm2_path)}, {"model_path": str(tiny_llama_path)}
    with socket.socket() as holder, ThreadPoolExecutor(max_workers=2) as pool:
        holder.bind(("127.0.0.1", 0))  # the busy port, held until every launch has ended
        holder.listen()
        launches: dict[str, tuple[dict[str, Any], dict[str, str] | None]] = {
            "test_launch_with_bad_setting": (smollm2, {CONFIG_ENV_VAR: str(folder / "ext.toml")}),
            "test_launch_with_bad_setting_in_extra_config_file": (
                {
                    **tiny,
                    "extra_args": (
                        "--hicache-storage-backend-extra-config",
                        f"@{folder / 'extra.json'}",
                    ),
                },
                None,
            ),
            "test_launch_with_missing_model": ({"model_path": str(folder / "no-model")}, None),
            "test_launch_on_busy_port": ({**smollm2, "port": holder.getsockname()[1]}, None),
            "test_launch_with_unknown_chunk_tier": (
                tiny,
                {CONFIG_ENV_VAR: str(folder / "tier.json")},
            ),
            "test_launch_with_unknown_chunk_codec": (
                tiny,
                {CONFIG_ENV_VAR: str(folder / "codec.json")},
            ),
        }
        real = {"test_launch_with_bad_setting"}
        selected = {item.name for item in request.session.items}
        yield {
            name: pool.submit(
                _timed_launch, fields, env, None if name in real else folder / f"{name}.log"
            )
            for name, (fields, env) in launches.items()
            if name in selected
        }


@pytest.mark.server
def test_launch_with_bad_setting(refused_launches: dict[str, Future[RefusedLaunch]]) -> None:
    launch = refused_launches["test_launch_with_bad_setting"].result()
    _assert_clear_error(launch.result, "cpu_compat = 'maybe' is not allowed")


@pytest.mark.server
def test_launch_with_bad_setting_in_extra_config_file(
    refused_launches: dict[str, Future[RefusedLaunch]],
) -> None:
    """`--hicache-storage-backend-extra-config @file`: the settings inside the file count."""
    launch = refused_launches["test_launch_with_bad_setting_in_extra_config_file"].result()
    _assert_clear_error(launch.result, "chunk_max_tokens = 0 must be positive")
    assert launch.seconds < 60


@pytest.mark.server
def test_launch_with_missing_model(refused_launches: dict[str, Future[RefusedLaunch]]) -> None:
    launch = refused_launches["test_launch_with_missing_model"].result()
    _assert_clear_error(launch.result, "no such folder")


@pytest.mark.server
def test_launch_on_busy_port(refused_launches: dict[str, Future[RefusedLaunch]]) -> None:
    launch = refused_launches["test_launch_on_busy_port"].result()
    _assert_clear_error(launch.result, "already in use")


def _disk_tier_args(extra: dict[str, object], radix: str = "hicache_ext") -> SimpleNamespace:
    return SimpleNamespace(
        hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=json.dumps(extra),
        radix_cache_backend=radix,
    )


DISK_TIER = {
    "backend_name": "hicache_ext_disk",
    "module_path": "sglang_hicache_ext.sglang_ext.disk_tier.storage_backend",
    "class_name": "GroupTTLDiskStorage",
    "interface_v1": 1,
    "prefetch_threshold": 64,  # SGLang's own keys are accepted
}


@pytest.mark.parametrize(
    ("extra", "radix", "message"),
    [
        (
            {**DISK_TIER, "ttl_polcy": "group"},
            "hicache_ext",
            "hicache_ext_disk: unknown setting(s) 'ttl_polcy'; known settings: disk_dir,",
        ),
        ({**DISK_TIER, "interface_v1": 0}, "hicache_ext", '"interface_v1": 1'),
        (
            {**DISK_TIER, "ttl_policy": "lru"},
            "hicache_ext",
            "hicache_ext_disk: ttl_policy = 'lru' is not allowed; "
            "choose one of 'group', 'group-always', 'fixed', 'static'",
        ),
        (
            {**DISK_TIER, "capacity_bytes": 0},
            "hicache_ext",
            "hicache_ext_disk: capacity_bytes = 0 must be positive",
        ),
        (DISK_TIER, None, "needs --radix-cache-backend hicache_ext"),
        (
            {**DISK_TIER, "class_name": "KaretoDiskStorage"},  # the class's name before 0.1.0
            "hicache_ext",
            "class_name 'KaretoDiskStorage' is not in "
            "sglang_hicache_ext.sglang_ext.disk_tier.storage_backend: use 'GroupTTLDiskStorage'",
        ),
    ],
)
def test_disk_tier_options_are_checked_before_launch(
    extra: dict[str, object], radix: str | None, message: str
) -> None:
    with pytest.raises(PreflightError, match=re.escape(message)):
        check_disk_tier(_disk_tier_args(extra, radix))


def test_disk_tier_good_options_and_other_backends_pass(tmp_path: Path) -> None:
    check_disk_tier(_disk_tier_args({**DISK_TIER, "disk_dir": str(tmp_path), "ttl_groups": 4}))
    other = {"backend_name": "x", "module_path": "elsewhere", "class_name": "X", "any": 1}
    check_disk_tier(_disk_tier_args(other, radix=None))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"chunk_tiers": ["host", "ssd"]},
            "chunk_tiers: 'ssd' is unknown; choose from 'host', 'disk' or 'mooncake'",
        ),
        ({"chunk_tiers": ["disk"]}, "must start with 'host'"),
        (
            {"chunk_tiers": ["host", "disk"]},
            "chunk_tiers names 'disk' but chunk_disk_dir is not set",
        ),
        ({"chunk_tiers": ["host"], "chunk_disk_dir": "/tmp/c"}, "chunk_tiers leaves out 'disk'"),
        ({"chunk_disk_bytes": -1}, "chunk_disk_bytes = -1 must be positive"),
        (
            {"chunk_tiers": ["host", "mooncake"]},
            "chunk_tiers names 'mooncake' but chunk_mooncake_master is not set",
        ),
        (
            {"chunk_tiers": ["host"], "chunk_mooncake_master": "127.0.0.1:50051"},
            "chunk_mooncake_master is set but chunk_tiers leaves out 'mooncake'",
        ),
        ({"chunk_mooncake_master": "localhost"}, "'localhost' must be host:port"),
        ({"chunk_mooncake_master": "127.0.0.1:0"}, "'127.0.0.1:0' must be host:port"),
        ({"chunk_mooncake_segment_bytes": -1}, "chunk_mooncake_segment_bytes = -1 must be >= 0"),
        ({"chunk_mooncake_metadata_server": ""}, "chunk_mooncake_metadata_server"),
        ({"chunk_codec": "zstd"}, "chunk_codec = 'zstd' unknown codec 'zstd'; stored chunks take"),
        ({"chunk_codec": "knorm:1.5"}, "'knorm:1.5': the drop ratio must be in (0, 1), got 1.5"),
        ({"chunk_codec": "keydiff:-0.2"}, "the drop ratio must be in (0, 1), got -0.2"),
        ({"chunk_codec": "snapkv:0.5"}, "'snapkv:0.5' drops tokens; stored chunks take int8 or"),
    ],
)
def test_bad_chunk_tier_settings_are_one_line(values: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(message)):
        ExtensionSettings(**values)


def test_chunk_disk_dir_must_be_a_usable_directory(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(
        PreflightError, match=re.escape(f"chunk_disk_dir {a_file} is not a directory")
    ):
        check_chunk_disk(ExtensionSettings(chunk_disk_dir=str(a_file)))
    under_a_file = a_file / "chunks"
    with pytest.raises(
        PreflightError, match=re.escape(f"chunk_disk_dir {under_a_file}: cannot use it")
    ):
        check_chunk_disk(ExtensionSettings(chunk_disk_dir=str(under_a_file)))
    check_chunk_disk(ExtensionSettings(chunk_disk_dir=str(tmp_path / "new")))  # created
    assert (tmp_path / "new").is_dir()
    assert ExtensionSettings(chunk_disk_dir=str(tmp_path)).chunk_tier_names == ("host", "disk")
    assert ExtensionSettings().chunk_tier_names == ("host",)


def test_mooncake_tier_needs_a_listening_master() -> None:
    closed = f"127.0.0.1:{free_port()}"
    settings = ExtensionSettings(chunk_mooncake_master=closed)
    assert settings.chunk_tier_names == ("host", "mooncake")
    with pytest.raises(
        PreflightError, match=re.escape(f"chunk_mooncake_master {closed} is unreachable")
    ):
        check_chunk_mooncake(settings)
    metadata = f"http://127.0.0.1:{free_port()}/metadata"
    with socket.create_server(("127.0.0.1", 0)) as master:
        listening = f"127.0.0.1:{master.getsockname()[1]}"
        check_chunk_mooncake(ExtensionSettings(chunk_mooncake_master=listening))
        with pytest.raises(PreflightError, match="chunk_mooncake_metadata_server 127.0.0.1:"):
            check_chunk_mooncake(
                ExtensionSettings(
                    chunk_mooncake_master=listening, chunk_mooncake_metadata_server=metadata
                )
            )


def test_ratio_table_must_fit_the_model_and_tiers(tmp_path: Path) -> None:
    table_path = tmp_path / "ratios.json"
    settings = ExtensionSettings(
        fusion_recompute_ratio="auto",
        fusion_ratio_table=str(table_path),
        chunk_disk_dir=str(tmp_path / "chunks"),
    )
    with pytest.raises(PreflightError, match="is not a ratio table"):
        check_ratio_table(settings, "/models/tiny")
    tuned = TunedRatio(0.2, 0.2, 0.15, 1.0, "test")
    RatioTable("tiny", {"host": tuned}).save(table_path)
    with pytest.raises(PreflightError, match="was tuned for model tiny, this server runs other"):
        check_ratio_table(settings, "/models/other")
    with pytest.raises(PreflightError, match=r"has no ratio for chunk tier\(s\) disk; tune them"):
        check_ratio_table(settings, "/models/tiny/")
    RatioTable("tiny", {"host": tuned, "disk": tuned}).save(table_path)
    check_ratio_table(settings, "/models/tiny/")


@pytest.mark.server
def test_launch_with_unknown_chunk_tier(
    refused_launches: dict[str, Future[RefusedLaunch]],
) -> None:
    launch = refused_launches["test_launch_with_unknown_chunk_tier"].result()
    _assert_clear_error(
        launch.result, "chunk_tiers: 'nvme' is unknown; choose from 'host', 'disk' or 'mooncake'"
    )


@pytest.mark.server
def test_launch_with_unknown_chunk_codec(
    refused_launches: dict[str, Future[RefusedLaunch]],
) -> None:
    launch = refused_launches["test_launch_with_unknown_chunk_codec"].result()
    _assert_clear_error(
        launch.result, "chunk_codec = 'int3' unknown codec 'int3'; stored chunks take int8 or int4"
    )
