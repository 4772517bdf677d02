"""Checks run in the launching process before SGLang resolves its arguments.

Without them a missing model folder, a busy port or a bad settings file surfaces as a long
traceback (SGLang reads the model config while resolving arguments, and binds the port only
after starting its subprocesses). From the command line (`python -m sglang.launch_server`,
`sglang serve`) each failure is one line naming the problem and the fix, and exit status 2;
through the Python `Engine` API it is a `PreflightError` (a ValueError) to catch.
"""

from __future__ import annotations

import errno
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sglang_hicache_ext.sglang_ext.config.disk_tier_settings import (
    BACKEND_NAME,
    CLASS_NAME,
    MODULE_PATH,
    DiskTierSettings,
    loads_disk_tier,
)
from sglang_hicache_ext.sglang_ext.config.extra_config import read_extra_config
from sglang_hicache_ext.sglang_ext.config.settings import ExtensionSettings, SettingsError
from sglang_hicache_ext.sglang_ext.config.settings_sources import load_settings

_CONNECT_TIMEOUT_S = 3.0


class PreflightError(ValueError):
    """A launch that cannot succeed, with a message meant for the operator."""


def check_settings(server_args: Any) -> ExtensionSettings:
    try:
        return load_settings(server_args.hicache_storage_backend_extra_config)
    except SettingsError as err:
        raise PreflightError(f"bad hicache_ext settings: {err}") from err


def check_disk_tier(server_args: Any) -> None:
    """Our disk backend's settings, and the flags it needs, before any process starts."""
    if server_args.hicache_storage_backend != "dynamic":
        return
    try:
        extra = read_extra_config(server_args.hicache_storage_backend_extra_config)
    except SettingsError as err:
        raise PreflightError(str(err)) from err
    if not loads_disk_tier(extra):
        return
    if extra.get("class_name") != CLASS_NAME:
        # SGLang's dynamic factory would fail later, in the scheduler, with an AttributeError.
        raise PreflightError(
            f"class_name {extra.get('class_name')!r} is not in {MODULE_PATH}: use {CLASS_NAME!r}"
        )
    try:
        settings = DiskTierSettings.from_extra_config(extra)
    except SettingsError as err:
        raise PreflightError(str(err)) from err
    if server_args.radix_cache_backend != "hicache_ext":
        raise PreflightError(
            f"{BACKEND_NAME} needs --radix-cache-backend hicache_ext "
            "(the tree records page accesses and the controller passes groups and TTLs)"
        )
    # Claimed here, held by this (launching) process for its lifetime: a second server on the
    # same folder stops now, in one line, instead of in its scheduler after loading the model.
    _claim_server_dir("disk_dir", settings.disk_dir)


def _claim_server_dir(field: str, path: str | Path, *, probe_write: bool = False) -> None:
    """Claim the folder of setting `field` for this server (`hold_disk_dir`: created, held by
    this process for its lifetime, one server per folder); with `probe_write`, also write a
    temporary file in it (a read-only mount, a full disk). Raises PreflightError naming `field`:
    the folder held by another server (which process), or any OSError."""
    from sglang_hicache_ext.sglang_ext.disk_tier.dir_claim import hold_disk_dir
    from sglang_hicache_ext.tiers.dir_lock import DirectoryLockedError

    try:
        hold_disk_dir(path)
        if probe_write:
            with tempfile.TemporaryFile(dir=path):
                pass
    except DirectoryLockedError as err:
        holder = f"process {err.holder_pid}" if err.holder_pid is not None else "another process"
        raise PreflightError(
            f"{field} {err.directory} is in use by another server ({holder}); stop it or "
            f"give this server another {field}"
        ) from err
    except OSError as err:
        raise PreflightError(f"{field} {path}: cannot use it ({err.strerror or err})") from err


def check_chunk_disk(settings: ExtensionSettings) -> None:
    """The chunk disk directory: a directory this server can write, and no other server's."""
    if not settings.chunk_disk_dir:
        return
    path = Path(settings.chunk_disk_dir).expanduser()
    name = f"chunk_disk_dir {path}"
    if path.exists() and not path.is_dir():
        raise PreflightError(f"{name} is not a directory")
    _claim_server_dir("chunk_disk_dir", path, probe_write=True)  # one server each, as disk_dir


def check_chunk_mooncake(settings: ExtensionSettings) -> None:
    """The shared chunk tier: the Mooncake client installed, its master (and an HTTP metadata
    server, if named) listening. Checked before the model loads, so a typo or a stopped master
    is one line, not a scheduler traceback."""
    if not settings.chunk_mooncake_master:
        return
    from sglang_hicache_ext.tiers.chunks.mooncake_client import MooncakeUnavailable, store_class

    try:
        store_class()
    except MooncakeUnavailable as err:
        raise PreflightError(f"chunk_mooncake_master is set but {err}") from err
    targets = [("chunk_mooncake_master", settings.chunk_mooncake_master)]
    metadata = urlsplit(settings.chunk_mooncake_metadata_server)
    if metadata.scheme in ("http", "https"):
        netloc = (
            f"{metadata.hostname}:{metadata.port or (443 if metadata.scheme == 'https' else 80)}"
        )
        targets.append(("chunk_mooncake_metadata_server", netloc))
    for name, address in targets:
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=_CONNECT_TIMEOUT_S).close()
        except OSError as err:
            raise PreflightError(
                f"{name} {address} is unreachable ({err.strerror or err}); start the Mooncake "
                f"master there or unset {name}"
            ) from err


def check_ratio_table(settings: ExtensionSettings, model_path: str) -> None:
    """The tuned ratio table: readable, tuned for this model and for every chunk tier in use."""
    if not settings.fusion_ratio_table:
        return
    from sglang_hicache_ext.tuning.ratio.table import load_ratio_table

    name = f"fusion_ratio_table {settings.fusion_ratio_table}"
    try:
        table = load_ratio_table(Path(settings.fusion_ratio_table).expanduser())
    except ValueError as err:
        raise PreflightError(f"{name}: {err}") from err
    model = Path(model_path.rstrip("/")).name
    if table.model != model:
        raise PreflightError(f"{name} was tuned for model {table.model}, this server runs {model}")
    missing = [tier for tier in settings.chunk_tier_names if tier not in table.tiers]
    if missing:
        raise PreflightError(
            f"{name} has no ratio for chunk tier(s) {', '.join(missing)}; tune them "
            "(python -m sglang_hicache_ext.tuning.ratio tune --tier ...)"
        )


def check_auto_chunks(settings: ExtensionSettings, server_args: Any) -> None:
    if settings.auto_chunks and getattr(server_args, "skip_tokenizer_init", False):
        raise PreflightError(
            "auto_chunks needs the tokenizer in the scheduler (its paragraph breaks); "
            "drop --skip-tokenizer-init or set auto_chunks = false"
        )


def _looks_local(model_path: str) -> bool:
    # Hub ids are "org/name"; anything absolute, relative-dotted or home-based is a folder.
    return model_path.startswith(("/", "./", "../", "~")) or Path(model_path).expanduser().exists()


def check_model_path(model_path: str) -> None:
    if not _looks_local(model_path):
        return
    path = Path(model_path).expanduser()
    if not path.exists():
        raise PreflightError(
            f"--model-path {model_path}: no such folder (prepare it, e.g. `python scripts/prepare_models.py smollm2`)"
        )
    if path.is_dir() and not (path / "config.json").is_file() and not any(path.glob("*.gguf")):
        raise PreflightError(
            f"--model-path {model_path}: the folder has no config.json; is it a model folder?"
        )


def check_port_free(host: str, port: int) -> None:
    """Refuse a port that a live listener holds. SO_REUSEADDR as uvicorn sets it for the real
    bind: without it, the TIME-WAIT sockets a crashed server leaves behind for up to a minute
    would make a restart fail here although the server itself could bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise PreflightError(
                    f"--port {port}: {host}:{port} is already in use; stop the process holding it or choose another port"
                ) from err
            raise PreflightError(
                f"--host {host} --port {port}: cannot bind ({err.strerror})"
            ) from err


def launched_from_command_line() -> bool:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return (spec is not None and spec.name == "sglang.launch_server") or Path(
        sys.argv[0]
    ).name == "sglang"


def run_checks(server_args: Any, serving_http: bool) -> ExtensionSettings:
    """Settings are always checked; `preflight_checks = false` skips the model and port checks."""
    settings = check_settings(server_args)
    check_disk_tier(server_args)
    check_chunk_disk(settings)
    check_chunk_mooncake(settings)
    check_ratio_table(settings, str(server_args.model_path))
    check_auto_chunks(settings, server_args)
    if not settings.preflight_checks:
        return settings
    check_model_path(str(server_args.model_path))
    if serving_http:
        check_port_free(server_args.host, server_args.port)
    return settings


_checked: set[int] = set()


def before_resolve(server_args: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook on `ServerArgs.resolve_once`: runs once per ServerArgs object."""
    if id(server_args) in _checked:
        return
    _checked.add(id(server_args))
    from_cli = launched_from_command_line()
    try:
        settings = run_checks(server_args, serving_http=from_cli)
    except PreflightError as err:
        if not from_cli:
            raise
        print(f"sglang-hicache-ext: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    interval = settings.chunk_placement_interval_s
    if from_cli and interval is not None and server_args.radix_cache_backend == "hicache_ext":
        from sglang_hicache_ext.sglang_ext.server.placement_routes import start_timer

        start_timer(server_args, interval)
