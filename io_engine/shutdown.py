"""close_at_exit: objects a program leaves open are closed when its main thread ends, before finalization.

Why: an engine's workers are daemon threads. At interpreter finalization Python freezes them wherever they
are, so requests still queued are lost (a file half written), and a thread that wakes up to run a torch op
or free a tensor then can abort the whole process ("terminate called without an active exception"). So
every live ``IOEngine`` (and every object a library built on io_engine registers, such as a
``TieredStore``) is closed in the main thread first: its I/O drained, its threads joined.

When: like ``concurrent.futures``, at the end of the main thread, before non-daemon threads are joined and
before ``atexit`` handlers (``threading._register_atexit``; plain ``atexit`` where that is missing). Our
hook is registered after ``concurrent.futures``' own, so it runs first (they run last in, first out):
closing may still hand work to thread pools. Objects registered ``early`` (those that need an engine to
close, such as a store that flushes through one) close first, then the rest, each group newest first.

What: the registry holds weak references only: an object collected before exit is not kept alive by it,
and its own finalizers release what it held. A ``close()`` that raises is reported on stderr and the next
object is closed; the exit status stays the program's own. A forked child starts with an empty registry:
its parent's objects (whose threads did not survive the fork) are the parent's to close.

Call order: ``close_at_exit(obj)`` once, when ``obj`` is ready; ``forget(obj)`` from its ``close()``
(optional: closing twice must be harmless anyway).
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - registers its exit hook first, so that ours runs before it
import itertools
import os
import sys
import threading
import weakref
from typing import Any

__all__ = ["close_at_exit", "forget"]

_lock = threading.Lock()
_counter = itertools.count()
_early: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()  # insertion order: oldest first
_late: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def close_at_exit(obj: Any, *, early: bool = False) -> None:
    """Close ``obj`` (call its ``close()``) when the main thread ends, unless it is gone by then.

    ``early``: close it before the others (it needs them to close, as a store needs its engine).
    """
    with _lock:
        (_early if early else _late)[next(_counter)] = obj


def forget(obj: Any) -> None:
    """``obj`` was closed: nothing to do for it at exit."""
    with _lock:
        for group in (_early, _late):
            for k, v in list(group.items()):
                if v is obj:
                    del group[k]


def _close_all() -> None:
    for group in (_early, _late):
        with _lock:
            objs = list(group.values())[::-1]  # newest first
            group.clear()
        for obj in objs:
            try:
                obj.close()
            except BaseException as e:  # noqa: BLE001 - report, and close the others
                print(f"io_engine: closing {obj!r} at exit failed: {type(e).__name__}: {e}", file=sys.stderr)
            del obj


def _forget_all() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    _early.clear()
    _late.clear()


def _register() -> None:
    hook = getattr(threading, "_register_atexit", None)
    try:
        (hook or atexit.register)(_close_all)
    except RuntimeError:  # imported while the interpreter is already shutting down
        pass
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_forget_all)


_register()
