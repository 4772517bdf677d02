"""Faults never reach SGLang's threads: an entry point that raises answers a miss instead.

`never_raises(fallback)` wraps a backend method: an unexpected exception is logged (the
traceback once per entry point, then one line each) and counted in the backend's
`EntryPointFaults`, and `fallback(*args)` (a miss, False, 0) is returned.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

logger = logging.getLogger(__name__)

# Entry points SGLang may call; each has its own count of unexpected exceptions.
ENTRY_POINTS = (
    "batch_set_v1",
    "batch_get_v1",
    "batch_exists",
    "exists",
    "touch",
    "get",
    "batch_get",
    "set",
    "batch_set",
    "clear",
    "close",
)


class EntryPointFaults:
    """Unexpected exceptions per entry point (thread-safe)."""

    def __init__(self, backend_name: str) -> None:
        self._backend_name = backend_name
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(ENTRY_POINTS, 0)

    def record(self, entry_point: str) -> None:
        """Count and log the exception being handled (call from an `except` block)."""
        with self._lock:
            self._counts[entry_point] += 1
            first = self._counts[entry_point] == 1
        if first:  # the traceback once; then one line each, not a flood of them
            logger.exception("%s.%s failed; answered as a miss", self._backend_name, entry_point)
        else:
            logger.error("%s.%s failed again; answered as a miss", self._backend_name, entry_point)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class GuardedBackend(Protocol):
    faults: EntryPointFaults


Method = TypeVar("Method", bound=Callable[..., Any])


def never_raises(fallback: Callable[..., Any]) -> Callable[[Method], Method]:
    """An unexpected exception in the method is logged and counted, and `fallback(*args)` (a
    miss, False, 0) returned instead: nothing may raise into SGLang's controller threads."""

    def decorate(method: Method) -> Method:
        name = method.__name__

        @functools.wraps(method)
        def guarded(self: GuardedBackend, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except Exception:
                self.faults.record(name)
                return fallback(*args, **kwargs)

        return guarded  # type: ignore[return-value]

    return decorate


def _length(keys: Any) -> int:
    try:
        return len(keys)
    except Exception:
        return 0


def all_false(keys: Any, *args: Any, **kwargs: Any) -> list[bool]:
    return [False] * _length(keys)


def all_none(keys: Any, *args: Any, **kwargs: Any) -> list[None]:
    return [None] * _length(keys)


def zero(*args: Any, **kwargs: Any) -> int:
    return 0


def false(*args: Any, **kwargs: Any) -> bool:
    return False


def none(*args: Any, **kwargs: Any) -> None:
    return None
