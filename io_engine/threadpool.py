"""ThreadPool: a ``concurrent.futures`` executor whose threads keep working once the interpreter's exit has begun.

Why not ``ThreadPoolExecutor``: when the main thread ends, ``concurrent.futures``' exit hook stops every thread
pool of the process, and from then on each ``submit`` raises "cannot schedule new futures after interpreter
shutdown", also in a pool made afterwards. Python still waits for the program's non-daemon threads then, and they
may go on working (a training or serving thread that outlives the main thread, which fell off the script): plain
torch code does. An object such a thread opens then (a store, a KV cache) would fail at its first call. This pool
is only stopped by its owner's ``shutdown()`` (or its collection), so it works as long as its owner is open.

Its threads are daemon threads, as io_engine's own, started as work needs them (up to ``max_workers``) and
reused while idle, as ``ThreadPoolExecutor``'s. Daemon: the exit never waits for them (io_engine.shutdown's wait
skips them; their owners, registered with ``close_at_exit``, shut them down there). A pool collected without
``shutdown()`` ends its threads once they are idle. The same interface (``submit``, ``map``, ``shutdown``, a
``with`` block) and the same cost: one queue put and get per task.
"""

from __future__ import annotations

import itertools
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

__all__ = ["ThreadPool"]

T = TypeVar("T")
_Task = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]
_pool_numbers = itertools.count()


class ThreadPool(Executor):
    def __init__(self, max_workers: int, thread_name_prefix: str = "") -> None:
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers must be an int >= 1, got {max_workers!r}")
        self._max_workers = max_workers
        self._prefix = thread_name_prefix or f"ThreadPool-{next(_pool_numbers)}"
        self._queue: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # released by a thread as it finishes a task: it takes the next one
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._shutdown = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            fut: Future[T] = Future()
            try:
                self._add_thread()
            except RuntimeError:  # Python refuses new threads (3.12 at exit): the error says so, unless one runs
                if not self._threads:
                    raise
            self._queue.put((fut, fn, args, kwargs))
            return fut

    def _add_thread(self) -> None:  # lock held
        if self._idle.acquire(blocking=False) or len(self._threads) >= self._max_workers:
            return  # an idle thread takes the task, or every thread will in turn

        def wake(_: Any, q: queue.SimpleQueue[_Task | None] = self._queue) -> None:  # collected: end the threads
            q.put(None)

        t = threading.Thread(target=_work, args=(weakref.ref(self, wake), self._queue),
                             name=f"{self._prefix}_{len(self._threads)}", daemon=True)  # fmt: skip
        t.start()
        self._threads.append(t)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new task; the queued ones still run (``cancel_futures``: cancelled instead); ``wait``: until they have
        run and the threads have ended."""
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                while True:
                    try:
                        task = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if task is not None:
                        task[0].cancel()
            self._queue.put(None)  # wakes one idle thread; each passes it on as it ends
            threads = list(self._threads)
        if wait:
            me = threading.current_thread()
            for t in threads:
                if t is not me:
                    t.join()


def _work(pool_ref: weakref.ref[ThreadPool], tasks: queue.SimpleQueue[_Task | None]) -> None:
    """A pool thread: run tasks until the pool is shut down (or collected) and the queue drained up to that."""
    while True:
        task = tasks.get()
        if task is not None:
            _run(*task)
            del task  # no reference to its arguments or result while idle
            pool = pool_ref()
            if pool is not None:
                pool._idle.release()
            del pool
            continue
        pool = pool_ref()
        if pool is None or pool._shutdown:
            tasks.put(None)  # the next thread ends too
            return
        del pool


def _run(fut: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if not fut.set_running_or_notify_cancel():
        return  # cancelled while queued
    try:
        result = fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - the future's to raise, in its waiter, as ThreadPoolExecutor's
        fut.set_exception(e)
        del e  # no cycle through the traceback's frame
    else:
        fut.set_result(result)
