"""OwnedFinalizer: a ``weakref.finalize`` that releases only in the process that made it, never in a forked child.

Why: ``os.fork()`` copies every object, finalizers included, and a child that ends the usual Python way
(``sys.exit``, the end of its script) runs the finalizers it was handed at its exit; collection or ``close()``
in the child runs them too. Run there, what a parent's object holds is released under the parent: an
optimizer's or a KV cache's finalizer deleted the parent's live private folder (its next step or forward found
its records missing), and a ``FolderLock``'s dropped the parent's folder lock, since an flock belongs to the open
file description, which parent and child share: another process could then take the live folder for a dead
run's and delete it. (``multiprocessing``'s fork workers, DataLoader's and ProcessPoolExecutor's leave through
``os._exit``, which runs no finalizer.) io_engine keeps its exit registry out of a child for the same reason
(io_engine/shutdown.py: a forked child starts with an empty registry).

So the release runs only in the process that made the finalizer. In any other process, calling the finalizer
(collection, exit, an explicit ``close()``) runs ``elsewhere`` instead, with the same arguments: only what is
the child's own to let go of, such as its copy of a descriptor; never an unlock, a deletion or a thread join
(the parent's threads do not exist in the child). Either way the finalizer is dead afterwards, so the child's
copy reads closed, and the parent's stays open.

Call order: ``fin = OwnedFinalizer(obj, release, *args, elsewhere=...)`` where ``weakref.finalize`` would be;
``fin()`` to release (idempotent); ``fin.here``: whether this process made it (a ``close()`` that would take a
lock first skips it in a child: a thread of the parent may have held it at the fork).

``OwnedLock`` is the same rule for an object's lock: a child forked while one of the parent's threads held it (a
training thread inside a step or a save, a forward on a serving thread) would wait for ever for a holder that
does not exist there, and one forked while it was free would run part of a call before the first piece that
checks the process (the store) refused, leaving the copy half-changed. So in any process but the one that made
it the lock raises instead of being taken: every call that takes it refuses at once, before it does anything.
``check()`` raises the same way, for a call that takes no lock; ``here`` says whether this is the process that made
it (a loop over every live object of a kind, as an optimizer's global step hook, skips the others' copies).
"""

from __future__ import annotations

import os
import weakref
from _thread import RLock as _RLock
from collections.abc import Callable
from typing import Any

__all__ = ["OwnedFinalizer", "OwnedLock"]


class OwnedFinalizer(weakref.finalize):
    """``weakref.finalize(obj, release, *args)`` whose ``release`` runs only in the process that made it; in any
    other (a forked child) ``elsewhere(*args)`` runs instead, or nothing. See the module docstring."""

    def __init__(self, obj: Any, release: Callable[..., Any], /, *args: Any,
                 elsewhere: Callable[..., Any] | None = None) -> None:  # fmt: skip
        self.pid = os.getpid()
        super().__init__(obj, _release_in, self.pid, release, elsewhere, args)

    @property
    def here(self) -> bool:
        """This process made the finalizer: its release is this process's to run."""
        return os.getpid() == self.pid


def _release_in(pid: int, release: Callable[..., Any], elsewhere: Callable[..., Any] | None,
                args: tuple[Any, ...]) -> None:  # fmt: skip
    if os.getpid() == pid:
        release(*args)
    elif elsewhere is not None:
        elsewhere(*args)


class OwnedLock(_RLock):  # type: ignore[misc]  # final in typeshed only: CPython takes subclasses
    """A ``threading.RLock`` that only the process that made it takes; in any other (a forked child) ``acquire``
    (and ``with``) raises ``RuntimeError`` at once, as ``check()`` does. ``what`` names the owner in that error
    ("TieredOptimizer"). See the module docstring.

    Safe against a signal handler's exception (a Ctrl-C's ``KeyboardInterrupt``), which Python raises as a Python
    function begins and right after a C function returns: the lock is never left held by a take or a release that it
    cut short (another thread's call, a background save's or a monitor's, would wait for it for ever). So a subclass
    of the C lock: ``release`` and ``__exit__`` are the C lock's own, with no Python frame before the release where
    such an exception could come first; ``acquire`` gives back a take that one cut short as the C acquire returned.
    Limit: a second signal arriving in the instant between that exception and the give-back still skips it."""

    def __init__(self, what: str) -> None:
        self.pid, self.what = os.getpid(), what

    @property
    def here(self) -> bool:
        """This process made the lock: the owner's threads live here."""
        return os.getpid() == self.pid

    def check(self) -> None:
        """Raise in a process forked after the lock was made: the owner's threads did not survive the fork."""
        if os.getpid() != self.pid:
            raise RuntimeError(f"this {self.what} was made in process {self.pid}, before a fork: its threads did not "
                               f"survive the fork, so its copy here is closed. Make the {self.what} in the child, "
                               "after the fork, or start workers with the 'spawn' method")  # fmt: skip

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        self.check()
        before = _takes(self)
        try:
            return _RLock.acquire(self, blocking, timeout)
        except BaseException as e:
            # Raised as the C acquire returned, the lock taken (or in its wait, or for its arguments: not taken)
            if _took(self, before, e):
                _RLock.release(self)
            raise

    def __enter__(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self.acquire(blocking, timeout)


def _takes(lock: _RLock) -> int:
    """How many times this thread holds ``lock`` (Python 3.10's RLock tells only whether it does: 1 or 0)."""
    count = getattr(lock, "_recursion_count", None)
    return int(count()) if count is not None else int(lock._is_owned())  # type: ignore[attr-defined]


def _took(lock: _RLock, before: int, error: BaseException) -> bool:
    """The acquire that ``error`` stopped had taken ``lock``, which this thread held ``before`` times."""
    if hasattr(lock, "_recursion_count"):
        return _takes(lock) > before
    # Python 3.10: a take re-entering the lock never waits, so it is taken by the time anything can interrupt it,
    # but for its arguments' errors, raised first
    return bool(before) and not isinstance(error, (TypeError, ValueError, OverflowError)) or _takes(lock) > before
