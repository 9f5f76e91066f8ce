"""The loops of an IOEngine's threads: ``work`` (one blocking call a thread, ``submit="threads"``) and ``drive``
(kernel AIO from one thread, ``submit="aio"``), and ``send_stops``, which ends them.

Why ``drive``: on the GPU machine's virtio disk the threads ran at 0.83x (read) and 0.85x (write) DeepSpeed's
libaio handle, the two interleaved in one call (bench/RESULTS.md, fifteenth session). ``drive`` follows libaio's
model: one thread keeps up to ``threads`` direct tasks in the kernel's queue through kernel AIO (kernel_aio.py,
the system calls by ctypes) and reaps them as they complete. The tasks kernel AIO cannot take (an unaligned head
or tail, a bounced address, a filesystem without O_DIRECT) go to ``threads`` synchronous workers of their own
(``work``, engine.py routes them), and a direct task that comes back short or failed runs again through the
synchronous path on the AIO thread, so the errors and short reads callers see are the same. Done-callbacks of
direct requests run on the AIO thread: one must not wait for another request of the same engine.

The GIL: a thread returning from a call that released it waits for it while another thread runs Python (up to
the interpreter's switch interval, 5 ms), as a training loop's forward and backward do while a step's reads run
ahead. Beside a Python loop, 32 threads of 1 MiB reads fell to a quarter of their rate on the development VM,
8 threads of 8 MiB hardly (bench/gil_busy.py; bench/RESULTS.md, sixteenth session). So ``drive`` releases the GIL
only to wait: io_submit and a look at what is done keep it (kernel_aio.py), and with every slot busy it waits for
half of them, taking the GIL back once for many completions.

Idle, a thread holds only the engine's task queue; a task holds its engine while it runs or is in flight, so an
engine dropped without ``close()`` is collected and its finalizer sends the stops (engine.py's docstring).
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Protocol, cast

from .kernel_aio import AioContext

# A task is engine.py's _Task (its request ``req``, ``start``, ``length``, ``direct``, ``bounce``); it is named here
# by what the loops use, as engine.py imports this module.
_Task = Any


class _Runner(Protocol):
    """What the loops call on a task's engine (engine.py's IOEngine)."""

    def _process(self, task: _Task) -> None: ...
    def _dequeued(self) -> None: ...
    def _run_and_finish(self, task: _Task) -> None: ...
    def _aio_done(self, task: _Task, result: int) -> None: ...
    def _finish(self, task: _Task, error: BaseException | None) -> None: ...


def work(tasks: queue.SimpleQueue[_Task | None], idents: set[int]) -> None:
    """A worker thread's loop. Idle, it holds only the queue; a task holds its engine while it runs."""
    idents.add(threading.get_ident())
    while True:
        task = tasks.get()
        if task is None:
            return
        engine = task.req.engine
        assert engine is not None  # set by _submit; cleared only after the request's last task
        engine._process(task)
        del task, engine  # hold no user buffer, and no engine, while idle


def drive(tasks: queue.SimpleQueue[_Task | None], idents: set[int], ctx: AioContext) -> None:
    """The one thread of ``submit="aio"``: keeps up to ``ctx.depth`` direct tasks in the kernel's queue (the
    engine made the context, so that a refusal reached its caller) and completes each as the kernel reports it.
    Idle (nothing in flight), it holds only the queue."""
    idents.add(threading.get_ident())
    depth = ctx.depth
    running: dict[int, _Task] = {}
    failed = False
    try:
        _aio_loop(tasks, ctx, running, depth)
    except BaseException as e:  # noqa: BLE001 - an engine bug or a kernel refusal must not strand a request
        ctx.close()  # the kernel ends (cancels or completes) what it still had in flight before this returns
        _fail(running, e)
        failed = True
    finally:
        ctx.close()
    if failed:  # outside the handler, so that no traceback keeps an engine alive while this thread idles
        work(tasks, idents)  # the rest of the engine's life through the synchronous path, one task at a time


def _aio_loop(tasks: queue.SimpleQueue[_Task | None], ctx: AioContext, running: dict[int, _Task], depth: int) -> None:
    """drive's loop, until a stop arrives and nothing is in flight."""
    stopping = False
    while not stopping or running:
        batch: list[_Task] = []
        while not stopping and len(running) + len(batch) < depth:
            try:  # wait for work only when nothing is in flight
                task = tasks.get(block=not running and not batch)
            except queue.Empty:
                break
            if task is None:
                stopping = True
                break
            engine = task.req.engine
            assert engine is not None  # set by _submit; cleared only after the request's last task
            assert task.direct and not task.bounce  # the others engine.py queues for the synchronous workers
            engine._dequeued()
            batch.append(task)
            del task, engine
        if batch:
            _start(ctx, batch, running)
            batch = []
        if running:
            _reap(ctx, running, full=len(running) >= depth or stopping)


def _start(ctx: AioContext, batch: list[_Task], running: dict[int, _Task]) -> None:
    """Hand ``batch`` to the kernel; what it does not take runs here through the synchronous path."""
    try:
        taken = ctx.submit([_request_of(t) for t in batch])
    except Exception:  # noqa: BLE001 - the kernel took none (EAGAIN: its queue is full); each task then fails or
        taken = 0  # succeeds on the synchronous path, never strands
    for t in batch[:taken]:
        running[id(t)] = t
    for t in batch[taken:]:
        cast(_Runner, t.req.engine)._run_and_finish(t)


def _request_of(t: _Task) -> tuple[int, int, bool, int, int, int]:
    """A direct, aligned task as kernel AIO's (tag, fd, write, address, nbytes, offset)."""
    req = t.req
    assert req.handle is not None and req.buf is not None
    return id(t), req.handle.fd_direct, req.write, req.buf.address + t.start, t.length, req.offset + t.start


def _reap(ctx: AioContext, running: dict[int, _Task], full: bool) -> None:
    """Complete what the kernel reports done: first what is done already (the GIL kept), else wait. ``full`` (no
    slot free, or stopping: no new task to look for): until half of ``running`` is done, so that the thread takes
    the GIL back once for many completions (beside a thread running Python, each return waits up to the switch
    interval for it; the kernel still holds the other half, so the disk's queue never empties); else until one
    is, or a millisecond, to look for new tasks."""
    done = ctx.events(0, 0)
    if not done:
        done = ctx.events(max(1, len(running) // 2), None) if full else ctx.events(1, 0.001)
    for tag, result in done:
        t = running.pop(tag)
        cast(_Runner, t.req.engine)._aio_done(t, result)


def _fail(running: dict[int, _Task], error: BaseException) -> None:
    """Complete every task in ``running`` with ``error`` (the kernel has let go of their buffers)."""
    for t in running.values():
        cast(_Runner, t.req.engine)._finish(t, error)
    running.clear()


def send_stops(queues: list[tuple[queue.SimpleQueue[_Task | None], int]]) -> None:
    """One stop for each thread on each queue: ``[(queue, threads), ...]``."""
    for tasks, threads in queues:
        for _ in range(threads):
            tasks.put(None)
