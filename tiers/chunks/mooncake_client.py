"""The Mooncake Store client the remote chunk tier uses: put, get, exists, remove, errors raised.

Mooncake's Python client answers with integer codes and, for a missing or unreachable object,
an empty `bytes`; this adapter turns those into `RemoteStoreError` and `None` so the chunk tier
above can count failures and never mistake one for data. Its native library needs
`libibverbs.so.1` even over TCP: when the system has none, a copy extracted from Debian's package
(`make env` puts it in `<venv>/lib/mooncake-deps`, or `HICACHE_EXT_MOONCAKE_LIBS` names a folder)
is loaded first.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

INSTALL_HINT = (
    "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 and Debian's libibverbs1 "
    "(or run make env)"
)
_LIBS_ENV = "HICACHE_EXT_MOONCAKE_LIBS"
# Loaded in this order: libibverbs needs both libnl libraries.
_NATIVE_DEPS = ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1")
_MISSING = 0  # `is_exist` for an absent key; negative codes are errors


class RemoteStoreError(Exception):
    """The remote store refused or could not be reached."""


class MooncakeUnavailable(ImportError):
    """The Mooncake client library is not installed (or its native dependencies are missing)."""


class ObjectStoreClient(Protocol):
    """What a remote chunk tier needs of a client of a key-value store shared by servers."""

    def put(self, key: str, data: bytes) -> None: ...
    def get(self, key: str) -> bytes | None: ...  # None: no such object
    def get_many(self, keys: list[str]) -> list[bytes | None]: ...  # one round trip
    def exists(self, key: str) -> bool: ...
    def remove(self, key: str) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class MooncakeConfig:
    master: str  # host:port of mooncake_master's RPC service
    metadata_server: str = "P2PHANDSHAKE"  # or http://host:port/metadata
    local_hostname: str = "127.0.0.1"  # the address other clients reach this one at
    segment_bytes: int = 512 << 20  # memory this process lends to the store
    local_buffer_bytes: int = 64 << 20
    protocol: str = "tcp"


def store_class() -> Any:
    """`mooncake.store.MooncakeDistributedStore`; MooncakeUnavailable with the fix if missing."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as error:
        if "libibverbs" not in str(error) or not _preload_native_deps():
            raise MooncakeUnavailable(
                f"the Mooncake client cannot be loaded ({error}): {INSTALL_HINT}"
            ) from None
        from mooncake.store import MooncakeDistributedStore
    return MooncakeDistributedStore


def _preload_native_deps() -> bool:
    folders = [os.environ.get(_LIBS_ENV, ""), str(Path(sys.prefix) / "lib" / "mooncake-deps")]
    for folder in filter(None, folders):
        paths = [Path(folder) / name for name in _NATIVE_DEPS]
        if all(path.exists() for path in paths):
            for path in paths:
                ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            return True
    return False


class MooncakeClient:
    """`ObjectStoreClient` over one Mooncake Store client (thread-safe: used under a lock)."""

    def __init__(self, config: MooncakeConfig) -> None:
        # Mooncake binds the external interface unless told, and retries a missing master for
        # 90 s; both are read when the client starts.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", config.local_hostname)
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        self.config = config
        self._client = store_class()()
        self._lock = threading.Lock()
        code = self._client.setup(
            config.local_hostname,
            config.metadata_server,
            config.segment_bytes,
            config.local_buffer_bytes,
            config.protocol,
            "",
            config.master,
        )
        if code != 0:
            raise RemoteStoreError(
                f"mooncake master {config.master}: client setup failed (code {code})"
            )

    def put(self, key: str, data: bytes) -> None:
        with self._lock:
            code = self._client.put(key, data)
        if code != 0:
            raise RemoteStoreError(f"mooncake put {key}: code {code}")

    def get(self, key: str) -> bytes | None:
        with self._lock:
            data = self._client.get(key)
        if data:
            return bytes(data)
        # Empty: absent, or the store could not be asked; only `is_exist` tells which.
        if self.exists(key):
            raise RemoteStoreError(f"mooncake get {key}: object listed but not readable")
        return None

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        """Small objects in one round trip; None for each absent one (a failure reads as absent:
        callers that must tell use `get`)."""
        with self._lock:
            found = self._client.get_batch(keys)
        if len(found) != len(keys):
            raise RemoteStoreError(f"mooncake get_batch: {len(found)} answers for {len(keys)}")
        return [bytes(data) if data else None for data in found]

    def exists(self, key: str) -> bool:
        with self._lock:
            code = self._client.is_exist(key)
        if code < _MISSING:
            raise RemoteStoreError(f"mooncake is_exist {key}: code {code}")
        return code > _MISSING

    def remove(self, key: str) -> None:
        with self._lock:
            code = self._client.remove(key, True)  # force: readers' 10 s leases do not block it
        if code not in (0, -704):  # -704: OBJECT_NOT_FOUND, already gone
            raise RemoteStoreError(f"mooncake remove {key}: code {code}")

    def close(self) -> None:
        with self._lock:
            self._client.close()
