"""The cache's lock: one forward's layer updates, a scheduler thread's swaps and frees, and ``close`` take turns, so
a swap or close from another thread waits for the layer update under way (whose copies may read the pages it would
release)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

__all__ = ["CLOSE_WAIT_S", "locked"]

F = TypeVar("F", bound=Callable[..., Any])
CLOSE_WAIT_S = 30.0  # close() waits at most this long for a layer update under way in another thread


def locked(fn: F) -> F:
    """The method, under its object's ``_lock`` (an ``OwnedLock``: it raises in a forked child)."""

    @functools.wraps(fn)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return fn(self, *args, **kwargs)

    return cast(F, run)
