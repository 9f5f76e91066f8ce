"""``Condition``: a ``threading.Condition`` whose waits end with its lock held, however they end.

A wait lets its lock go, and takes it back before it returns or raises; the caller's ``with lock:`` then releases
it. On a ``threading.Lock`` the taking back is a plain ``acquire()``, which a signal handler's exception (a Ctrl-C's
``KeyboardInterrupt``, a SIGTERM handler's ``SystemExit``) interrupts when it comes while another thread holds the
lock: it leaves the wait with the lock not taken, and the caller's ``with`` releases the lock the other thread holds,
so two threads run inside it and the other's own release raises "release unlocked lock". On an ``RLock`` the taking
back (its ``_acquire_restore``, in C) cannot be interrupted; a handler's exception raises once the lock is back. So
a ``Condition`` is on an RLock (a ``Lock`` is refused). One gap is left: an exception raised as the wait has just let
the lock go, before the ``try`` whose ``finally`` takes it back; ``wait`` then takes the lock back itself, and
``wait_for`` waits through ``wait``.

Every condition of io_engine and tiered is one of these (tests/unit/io_engine/test_condition.py checks): the store's,
the engine's, the pool's, the optimizer's update under backward.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["Condition", "lock_of"]


class Condition(threading.Condition):
    def __init__(self, lock: Any = None) -> None:
        """``lock``: an RLock (None: a new one)."""
        lock = threading.RLock() if lock is None else lock
        if not hasattr(lock, "_acquire_restore"):  # a Lock: a Ctrl-C interrupts its re-take (the module docstring)
            raise TypeError(f"a Condition waits on an RLock (a Ctrl-C cannot interrupt its re-take), not {lock!r}")
        super().__init__(lock)
        self._rlock = lock
        self._count = getattr(lock, "_recursion_count", None)  # how often the caller holds it; not in every Python

    def wait(self, timeout: float | None = None) -> bool:
        held = 1 if self._count is None else self._count()  # without it: once, as every caller here
        try:
            return super().wait(timeout)
        except BaseException:
            if not self._rlock._is_owned():  # raised just after the wait let the lock go: back to the caller's
                self._rlock._acquire_restore((held, threading.get_ident()))  # uninterruptible, as the wait's own
            raise


def lock_of(cond: threading.Condition) -> Any:
    """``cond``'s lock itself, for a ``with`` that a Ctrl-C cannot leave held: a Condition's ``__enter__`` and
    ``__exit__`` are Python functions, where a signal's handler runs (between taking the lock and the ``with``, or
    before letting it go); an RLock's are C. Read from ``cond`` each time, so a condition put in its place (as tests
    do) is the one locked."""
    return cond._lock  # type: ignore[attr-defined]
