"""close_at_exit: objects a program leaves open are closed when its main thread ends, before finalization.

Why: an engine's workers are daemon threads. At interpreter finalization Python freezes them wherever they
are, so requests still queued are lost (a file half written), and a thread that wakes up to run a torch op
or free a tensor then can abort the whole process ("terminate called without an active exception"). So
every live ``IOEngine`` (and every object a library built on io_engine registers, such as a
``TieredStore``) is closed in the main thread first: its I/O drained, its threads joined.

When: like ``concurrent.futures``, at the end of the main thread, before ``atexit`` handlers
(``threading._register_atexit``; plain ``atexit`` where that is missing). Our hook is registered after
``concurrent.futures``' own, so it runs first (they run last in, first out): closing may still hand work to
thread pools. Objects registered ``early`` (those that need an engine to close, such as a store that flushes
through one) close first, then the rest, each group newest first.

Late: an object registered once the hook has taken its last look (nothing was open as the main thread ended, so it
returned at once, and a thread that outlives the main thread opened the object afterwards; or io_engine was first
imported after the main thread ended, too late to hook its end) is closed by a plain ``atexit`` handler, which
the first such registration adds: that runs after Python has joined the non-daemon threads, before finalization.

Other threads first: the hook runs before Python joins the non-daemon threads, and one of them may still be
using an object (a training thread that outlives the main thread, which fell off the script or took a
Ctrl-C): closing it then would fail that thread's next call, where Python itself waits for the thread. So while
any object is registered, the hook first waits for the live non-daemon threads to end, as Python would next,
and only then closes. Not waited for: the current thread, the main thread, and the workers of
``concurrent.futures`` pools (thread pools' workers, process pools' manager threads), which end only in their
own exit hooks, after ours (waiting for them would wait for ever); those pools stay usable meanwhile.
io_engine's and tiered's own threads are daemon threads (their executors are ``threadpool.ThreadPool``s, which
``concurrent.futures``' exit hook leaves working for the threads that outlive the main thread). A thread a pool
starts is known as the pool's only just after it starts, so the wait looks again every ``_JOIN_POLL_S``. An
exception in the wait (a second Ctrl-C, a SIGTERM handler's ``SystemExit``) stops it as it stops Python's own join:
the objects are closed, the exit hooks registered before ours run (threading runs none after one that raises, and
``concurrent.futures``' ends a process pool's workers, which multiprocessing's exit would wait for for ever), then
it propagates. Cost: nothing beyond Python's own wait, but for a non-daemon thread that
itself waits for the main thread to end (``main_thread().join()``, or polling ``is_alive()``) or for an exit hook
registered before this module was imported (those run after ours): while an object is still open, it and so the exit
wait for ever. Close the objects before the main thread ends there (with nothing registered, nothing is waited for).

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

_JOIN_POLL_S = 0.1  # how often the wait for other threads looks again (a pool's thread registered meanwhile)
# (module, name): the weak dicts whose keys are a pool's threads (thread pools' workers, process pools' managers)
_POOL_REGISTRIES = [
    ("concurrent.futures.thread", "_threads_queues"),
    ("concurrent.futures.process", "_threads_wakeups"),
]

_lock = threading.Lock()
_counter = itertools.count()
_early: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()  # insertion order: oldest first
_late: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_hook_done = False  # the hook has taken the registry (or cannot run): what comes next is closed by ``atexit``
_armed = False  # that ``atexit`` handler is registered and has not run yet


def close_at_exit(obj: Any, *, early: bool = False) -> None:
    """Close ``obj`` (call its ``close()``) when the main thread ends, unless it is gone by then.

    ``early``: close it before the others (it needs them to close, as a store needs its engine).
    """
    global _armed
    with _lock:
        (_early if early else _late)[next(_counter)] = obj
        arm = _hook_done and not _armed
        _armed = _armed or arm
    if arm:
        atexit.register(_close_late)


def forget(obj: Any) -> None:
    """``obj`` was closed: nothing to do for it at exit."""
    with _lock:
        for group in (_early, _late):
            for k, v in list(group.items()):
                if v is obj:
                    del group[k]


def _close_all() -> None:
    try:
        objs = _wait_for_other_threads()
    except BaseException:  # a second Ctrl-C while waiting: stop waiting, as in Python's own join, closed first
        _close(_take())
        _run_hooks_before_ours()
        raise
    _close(objs)


def _run_hooks_before_ours() -> None:
    """The exit hooks registered before ours, newest first, as threading would have run them after ours: it runs
    none once one raises, and ours is about to. ``concurrent.futures``' is among them: a process pool's workers are
    told to end there, and multiprocessing's own exit would wait for them for ever. An exception in one (another
    Ctrl-C) stops the rest, as it would in threading's loop."""
    hooks = getattr(threading, "_threading_atexits", None)
    ours = [i for i, h in enumerate(hooks or ()) if getattr(h, "func", h) is _close_all]  # functools.partials
    if not isinstance(hooks, list) or not ours:
        return
    earlier = hooks[: ours[0]]
    del hooks[: len(earlier)]  # each runs once, whoever gets to it
    for hook in reversed(earlier):
        hook()


def _wait_for_other_threads() -> list[Any]:
    """Wait for the non-daemon threads that may still use a registered object (see the module doc), then take
    the registered objects: in one step with the last look, so that one registered later is closed by ``atexit``
    (``_close_late``), never under the thread that opened it."""
    while True:
        pending = _threads_to_wait_for()
        with _lock:
            if not pending or not (_early or _late):  # with nothing registered: no wait beyond Python's own
                return _take_locked()
        pending[0].join(_JOIN_POLL_S)


def _threads_to_wait_for() -> list[threading.Thread]:
    skip = {threading.current_thread(), threading.main_thread()} | _pool_threads()
    return [t for t in threading.enumerate() if not t.daemon and t not in skip and t.is_alive()]


def _pool_threads() -> set[threading.Thread]:
    """The live ``concurrent.futures`` pools' own threads: they end in their exit hooks, after ours."""
    found: set[threading.Thread] = set()
    for module, registry in _POOL_REGISTRIES:
        threads = getattr(sys.modules.get(module), registry, None)
        if threads is None:
            continue
        try:
            found.update(threads)
        except RuntimeError:  # a pool added a thread meanwhile: the next look (``_JOIN_POLL_S``) sees it
            pass
    return found


def _take() -> list[Any]:
    with _lock:
        return _take_locked()


def _take_locked() -> list[Any]:
    """The registered objects in closing order (``early`` first, each group newest first), the registry emptied;
    from now on a registration arms the ``atexit`` close."""
    global _hook_done, _armed
    objs = [*list(_early.values())[::-1], *list(_late.values())[::-1]]
    _early.clear()
    _late.clear()
    _hook_done, _armed = True, False
    return objs


def _close_late() -> None:
    """The ``atexit`` close of the objects registered after the hook's last look."""
    _close(_take())


def _close(objs: list[Any]) -> None:
    while objs:
        obj = objs.pop(0)  # none held once closed: its finalizers may run as it goes
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
    global _hook_done
    hook = getattr(threading, "_register_atexit", None)
    try:
        (hook or atexit.register)(_close_all)
    except RuntimeError:  # imported after the main thread ended (by a thread that outlives it): never runs
        _hook_done = True
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_forget_all)


_register()
