"""IOEngine: threaded positional reads and writes between host buffers and files, O_DIRECT when it can.

Call order: ``eng = IOEngine(cfg)``; any number of ``pread``/``pwrite`` from any thread (each returns an
``IOFuture``); ``flush()`` to wait for all of them and make written files durable; ``close()``.

Why threads and not aiofiles or libaio: a synchronous ``os.preadv`` releases the GIL for the whole
syscall, so N threads keep N requests in the kernel's queue; with O_DIRECT into reused aligned buffers
that reached fio's bandwidth on both machines we measured (bench/RESULTS.md). aiofiles adds a thread hop
and a bytes object plus a copy per call. But each thread takes the GIL back after every call, which costs
while other Python runs (workers.py: small blocks over many threads slow most). ``IOConfig(submit="aio")``
offers libaio's model instead: one thread and kernel AIO (workers.py says why and how).

A request is split into tasks of ``block_size`` bytes. O_DIRECT needs the file offset, the length and the
memory address aligned; the aligned middle of a request goes direct (through a per-thread aligned bounce
buffer when only the memory address is off), and an unaligned head or tail goes through the page cache
with a second, buffered file descriptor. Linux writes back and invalidates cached pages around direct
I/O, so the two paths stay coherent for the non-overlapping ranges one request touches.

A direct write that would extend its file first allocates the range it extends into (fallocate, in the
caller's thread, before any task is queued; posix.allocate says why): a fresh file, a record written anew
and a checkpoint's files then write at the rate of allocated blocks. Where the filesystem cannot allocate,
the engine stops asking for that filesystem and writes as before; a full disk fails the request before any
byte lands. The serial twin does not allocate: the bytes and the size of the file are the same either way.

Links: ``IOEngine(cfg, follow_symlinks=False)`` opens every file with O_NOFOLLOW, so a request whose path
ends in a symbolic link fails (ELOOP) instead of reading, writing or creating the link's target. Use it
on folders others could plant links in (a shared scratch disk); links in the folders above are followed.

Interrupts: a caller from another thread than the engine's waits for queue room while ``queue_depth`` tasks are
queued, before its request is counted; a ``KeyboardInterrupt`` raised in that wait leaves nothing queued. A caller
that holds SIGINT around a submit (so that no interrupt lands once the request is queued, its future not yet
returned) asks ``waiting_for_room()`` in its handler, and lets a Ctrl-C raise there: a stalled disk must not make
the wait deaf to it. Anywhere else in a submit a Ctrl-C leaves the request queued whole (it lands; its future is
lost with the return) or nothing behind: its file is opened and its tasks planned before it is counted, and the
count and the queueing of every task are one step with no place for a signal's handler to run (``_start``), so
``close()`` never waits for a request no worker will finish. The engine's lock is taken as the RLock itself
(``lock_of``), whose enter and exit run no Python code: no press leaves it held. ``close()`` waits for the requests
in flight likewise: a Ctrl-C there raises at once and leaves the engine closing (no new requests), its threads
stopped by the next ``close()``, the exit's included.

Lifetime: the workers hold no reference to the engine while idle (a queued task holds it), so an engine
dropped without ``close()`` is collected and its finalizer stops them; one still open when the main
thread ends is closed then (shutdown.py), so queued writes land and no worker runs during finalization.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, cast

from . import workers
from .buffers import HostBuffer, aligned_empty
from .condition import Condition, lock_of
from .config import IOConfig
from .errors import (
    EngineClosedError,
    EngineForkedError,
    IOEngineError,
    KernelAIOUnavailableError,
    ShortReadError,
    open_error,
)
from .future import IOFuture
from .handles import Handle, OpenFiles
from .interface import EngineInterface
from .kernel_aio import AioContext
from .posix import (
    check_follow_symlinks,
    fsync_path,
    pread_all,
    pwrite_all,
    validate_request,
)
from .shutdown import close_at_exit, forget

# ``waiting``: this thread is in an engine's wait for queue room, its request not counted (waiting_for_room).
_room = threading.local()


def waiting_for_room() -> bool:
    """Whether the calling thread waits in ``IOEngine.pread``/``pwrite`` for queue room, before its request is
    counted: an interrupt raised now leaves nothing queued. For a SIGINT handler (Python runs it in the main thread,
    inside that wait) that holds Ctrl-C around a submit but must let it stop this wait, which a stalled disk can make
    last for ever."""
    return getattr(_room, "waiting", False)


@dataclass(eq=False)
class _Request:
    write: bool
    path: str
    offset: int
    nbytes: int
    buf: HostBuffer | None
    future: IOFuture
    engine: IOEngine | None = None  # held by the request's tasks, so the engine lives while they run
    handle: Handle | None = None  # set and cleared by OpenFiles.acquire and release only
    tasks_left: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    queued: bool = False  # counted and its tasks queued (one step, _start): the workers give its file back


@dataclass(eq=False)
class _Task:
    req: _Request
    start: int  # offset into the request (bytes)
    length: int
    direct: bool
    bounce: bool  # direct, but the memory address is misaligned: go through the thread's aligned buffer


class IOEngine(EngineInterface):
    """Threaded file I/O into host buffers. See the module docstring for the call order.

    ``follow_symlinks=False``: refuse (ELOOP) any path that ends in a symbolic link; see the module docstring.
    """

    def __init__(self, config: IOConfig | None = None, *, follow_symlinks: bool = True):
        self.config = config if config is not None else IOConfig.from_env()
        if not isinstance(self.config, IOConfig):
            raise TypeError(f"config must be an IOConfig, got {type(self.config).__name__}")
        self.follow_symlinks = check_follow_symlinks(follow_symlinks)
        # Unbounded, so that a worker (running a done-callback) can always submit; callers from other
        # threads wait while more than queue_depth tasks are queued (see _submit).
        self._queue: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        # submit="aio": the tasks kernel AIO cannot take (buffered: an unaligned head or tail, a filesystem without
        # O_DIRECT; bounced) go to threads of their own, so that a disk without O_DIRECT is not served by one
        # thread. None with submit="threads": every task goes to _queue.
        self._sync_queue: queue.SimpleQueue[_Task | None] | None = None
        self._queued = 0
        self._closed = False
        self._pid = os.getpid()  # the workers live only in this process: a forked child has none (_check_open)
        self._pending = 0  # requests submitted and not finished
        self._idle = Condition()
        self._files = OpenFiles(self.config, self.follow_symlinks)
        self._worker_idents: set[int] = set()
        self._written: set[str] = set()
        self._stats = dict(bytes_read=0, bytes_written=0, requests=0, direct_bytes=0, buffered_bytes=0,
                           allocated_bytes=0)  # fmt: skip
        self._stats_lock = threading.Lock()
        self._local = threading.local()
        if self.config.submit == "aio":
            try:  # here, not in the engine's thread: a refusal raises to the caller instead of stranding requests
                ctx = AioContext(self.config.threads)
            except OSError as e:
                why = f"IOConfig(submit='aio'): kernel AIO refused ({e}); use submit='threads'"
                raise KernelAIOUnavailableError(errno.ENOSYS, why) from e
            args = (self._queue, self._worker_idents, ctx)
            self._workers = [threading.Thread(target=workers.drive, args=args, name="io_engine-aio", daemon=True)]
            self._sync_queue = queue.SimpleQueue()
            self._workers += self._threads(self._sync_queue, "io_engine-sync")
            stops = [(self._queue, 1), (self._sync_queue, self.config.threads)]
        else:
            self._workers = self._threads(self._queue, "io_engine")
            stops = [(self._queue, self.config.threads)]
        # Holds the queues, not the engine: sends the stops when a dropped engine is collected, unless close() has.
        self._stops = stops
        self._stop_workers = weakref.finalize(self, workers.send_stops, stops)
        self._shut = False  # close() has stopped the workers (``_closed`` alone: it has begun, no new requests)
        for t in self._workers:
            t.start()
        close_at_exit(self)

    def _threads(self, tasks: queue.SimpleQueue[_Task | None], name: str) -> list[threading.Thread]:
        """``threads`` synchronous workers on ``tasks`` (workers.work), not started."""
        return [
            threading.Thread(target=workers.work, args=(tasks, self._worker_idents), name=f"{name}-{i}", daemon=True)
            for i in range(self.config.threads)
        ]

    # ----------------------------------------------------------------------------------------- public
    def pread(self, buffer: Any, path: str | os.PathLike, offset: int = 0, *, nbytes: int | None = None) -> IOFuture:
        """Read ``nbytes`` (default: the buffer's size) from ``path`` at ``offset`` into ``buffer``."""
        return self._submit(False, buffer, path, offset, nbytes)

    def pwrite(self, buffer: Any, path: str | os.PathLike, offset: int = 0, *, nbytes: int | None = None) -> IOFuture:
        """Write the first ``nbytes`` of ``buffer`` to ``path`` at ``offset`` (created if missing)."""
        return self._submit(True, buffer, path, offset, nbytes)

    def flush(self, path: str | os.PathLike | None = None) -> None:
        """Wait for every request in flight, then fsync the files written (or only ``path``)."""
        self._check_open()
        with lock_of(self._idle):
            self._idle.wait_for(lambda: self._pending == 0)
            if path is None:
                targets, self._written = self._written, set()
            else:
                p = os.fspath(path)
                self._written.discard(p)
                targets = {p}
        for p in sorted(targets):
            fsync_path(p, follow_symlinks=self.follow_symlinks)

    def hold(self, path: str | os.PathLike, fd: int) -> None:
        """Serve every later read of ``path`` from the open file ``fd`` until ``close()``, whatever ``path`` names
        meanwhile: files opened together (a checkpoint's manifest and its data) stay one consistent set while another
        process renames new files into their place. The engine keeps a duplicate of ``fd``; the caller closes its
        own whenever it likes."""
        self._check_open()
        self._files.hold(os.fspath(path), fd)

    def stats(self) -> dict[str, int]:
        with self._stats_lock:
            return dict(self._stats)

    def close(self) -> None:
        """Finish what was submitted, stop the threads. Idempotent. In a forked child: only marks it closed (its
        threads, and what they had in flight, are the parent's).

        A Ctrl-C (any exception) while it waits for the requests in flight, which a stalled disk can make last for
        ever, or for the threads, raises at once, with the engine closing: new requests refused, and the next
        ``close()`` (the one at exit too, as the engine stays registered) waits again and stops the threads."""
        if self._shut:
            return
        if os.getpid() != self._pid:
            self._closed = self._shut = True
            return
        with lock_of(self._idle):
            self._closed = True  # no new requests from here on; those counted in _pending finish
            self._idle.notify_all()  # a submit waiting for queue room now raises EngineClosedError
            self._idle.wait_for(lambda: self._pending == 0)
        # Sent again by a close() after one that was interrupted, which may have sent only some: a stop too many is
        # never read (nothing is queued once _pending is 0), one too few would leave a worker running for good.
        # Not through the finalizer, which sends once: a dropped engine whose close() was cut short still sends them.
        workers.send_stops(self._stops)
        me = threading.current_thread()
        for t in self._workers:
            if t is not me:  # close() from a done-callback: this worker ends when the callback returns
                t.join()
        self._stop_workers.detach()  # every worker has its stop
        self._files.drop_held()
        forget(self)
        self._shut = True

    # --------------------------------------------------------------------------------------- submit
    def _check_open(self) -> None:
        if os.getpid() != self._pid:  # a request queued here would wait for ever: no worker survived the fork
            raise EngineForkedError(f"this IOEngine was made in process {self._pid}, before a fork; its threads do "
                                    "not exist in this process. Make the engine in the child, after the fork, or "
                                    "start workers with the 'spawn' method")  # fmt: skip
        if self._closed:
            raise EngineClosedError("this IOEngine is closed; create a new one")

    def _submit(self, write: bool, buffer: Any, path: str | os.PathLike, offset: int, nbytes: int | None) -> IOFuture:
        self._check_open()  # first: in a forked child, before the locks some thread may have held at the fork
        hb, n = validate_request(buffer, offset, nbytes, write=write)
        path = os.fspath(path)
        req = _Request(write, path, offset, n, hb, IOFuture.completed(n), engine=self)
        self._wait_for_room()
        try:
            return self._start(req)
        except BaseException:  # a Ctrl-C, or close() begun meanwhile: queued whole, or nothing counted
            if not req.queued:
                self._files.release(req)  # its file, if an open had got that far (once, however far release got)
            raise

    def _wait_for_room(self) -> None:
        """Wait while ``queue_depth`` tasks are queued (callers outside the workers), before the request is counted:
        this wait is where a Ctrl-C lands, and a KeyboardInterrupt raised here leaves nothing for close() to wait
        for."""
        with lock_of(self._idle):
            room = lambda: self._closed or self._queued < self.config.queue_depth  # noqa: E731
            if threading.get_ident() not in self._worker_idents and not room():
                _room.waiting = True
                try:
                    self._idle.wait_for(room)
                finally:
                    _room.waiting = False
                self._check_open()

    def _start(self, req: _Request) -> IOFuture:
        """Open ``req``'s file, plan its tasks, then count it and queue them in one step (``req.queued``)."""
        path, write, offset, n = req.path, req.write, req.offset, req.nbytes
        try:
            self._files.acquire(req, path, write, offset)
        except OSError as e:
            return IOFuture.failed(open_error(e, path, offset, follow_symlinks=self.follow_symlinks))
        try:
            tasks = self._plan(req)
            if write and any(t.direct for t in tasks):
                allocated = self._files.allocate(cast(Handle, req.handle), offset, n)
                if allocated:
                    with self._stats_lock:
                        self._stats["allocated_bytes"] += allocated
        except OSError as e:  # fallocate's real failure (ENOSPC): the write would fail the same way
            self._files.release(req)
            return IOFuture.failed(IOEngineError.from_oserror(e, path, offset, "write"))
        if not tasks:
            self._files.release(req)
            return req.future
        req.tasks_left = len(tasks)
        req.future = fut = IOFuture(parts=len(tasks), nbytes=n)
        # With submit="aio", what kernel AIO cannot take goes to the synchronous workers.
        queues = [self._queue if self._sync_queue is None or (t.direct and not t.bounce) else self._sync_queue
                  for t in tasks]  # fmt: skip
        puts = map(queue.SimpleQueue.put, queues, tasks)  # run by list() below, in C: no Python code between puts
        with lock_of(self._idle):
            self._check_open()  # checked and counted under one lock: close() waits for this request, never strands it
            if write:
                self._written.add(path)  # before the count: if a press lands here, flush() fsyncs one file more
            # A signal's handler runs as a Python function starts and as a builtin returns: none runs from the count
            # to the last put, so a Ctrl-C leaves the request either not counted or counted with every task queued.
            self._pending += 1
            self._queued += req.tasks_left
            req.queued = True
            list(puts)
        with self._stats_lock:
            self._stats["requests"] += 1
        return fut

    def _request_done(self) -> None:
        with lock_of(self._idle):
            self._pending -= 1
            self._idle.notify_all()

    def _plan(self, req: _Request) -> list[_Task]:
        bs, a = self.config.block_size, self.config.alignment
        n, off = req.nbytes, req.offset
        tasks: list[_Task] = []

        def add(start: int, end: int, direct: bool) -> None:
            for s in range(start, end, bs):
                e = min(s + bs, end)
                bounce = direct and (cast(HostBuffer, req.buf).address + s) % a != 0  # set until the request ends
                tasks.append(_Task(req, s, e - s, direct, bounce))

        if req.handle is None or req.handle.fd_direct < 0:
            add(0, n, False)
            return tasks
        # Request-relative bounds of the aligned middle of the file range.
        mid_start = min(n, (-off) % a)
        mid_end = max(mid_start, ((off + n) // a) * a - off)
        add(0, mid_start, False)
        add(mid_start, mid_end, True)
        add(mid_end, n, False)
        return tasks

    # --------------------------------------------------------------------------------------- worker
    def _scratch(self) -> memoryview:
        s = getattr(self._local, "scratch", None)
        if s is None:
            s, owner = aligned_empty(self.config.block_size, self.config.alignment)
            self._local.scratch, self._local.owner = s, owner
        return s

    def _process(self, task: _Task) -> None:
        """Worker thread: run one task and complete its part of the request."""
        self._dequeued()
        self._run_and_finish(task)

    def _dequeued(self) -> None:
        with lock_of(self._idle):
            self._queued -= 1
            self._idle.notify_all()

    def _run_and_finish(self, task: _Task) -> None:
        error: BaseException | None = None
        try:
            self._run(task)
        except BaseException as e:  # noqa: BLE001 - every failure must reach the future
            error = e
        self._finish(task, error)

    def _aio_done(self, t: _Task, result: int) -> None:
        """A kernel AIO completion: ``result`` bytes moved, or -errno. Anything but the whole task runs the task
        again through the synchronous path, whose errors and short reads are the ones callers know."""
        if result == t.length:
            self._count(t)
            self._finish(t, None)
        else:
            self._run_and_finish(t)

    def _run(self, t: _Task) -> None:
        req = t.req
        h, buf = req.handle, req.buf
        assert h is not None and buf is not None  # set by _submit before any task is queued
        fd = h.fd_direct if t.direct else h.fd_buffered
        pos = req.offset + t.start
        view = buf.view[t.start : t.start + t.length]
        if t.bounce:
            scratch = self._scratch()[: t.length]
            if req.write:
                scratch[:] = view
                pwrite_all(fd, scratch, pos, req.path)
            else:
                got = pread_all(fd, scratch, pos, req.path)
                view[:got] = scratch[:got]
                if got < t.length:
                    raise _short(req, t, got)
        elif req.write:
            pwrite_all(fd, view, pos, req.path)
        else:
            got = pread_all(fd, view, pos, req.path)
            if got < t.length:
                raise _short(req, t, got)
        self._count(t)

    def _count(self, t: _Task) -> None:
        with self._stats_lock:
            self._stats["bytes_written" if t.req.write else "bytes_read"] += t.length
            self._stats["direct_bytes" if t.direct else "buffered_bytes"] += t.length

    def _finish(self, t: _Task, error: BaseException | None) -> None:
        req = t.req
        with req.lock:
            req.tasks_left -= 1
            last = req.tasks_left == 0
        if last:
            # Before the future fires: the caller may then reuse or free its buffer, delete the file,
            # or flush() from a done-callback.
            req.buf = req.engine = None
            self._files.release(req)
            self._request_done()
        req.future._part_done(error)


def _short(req: _Request, t: _Task, got: int) -> ShortReadError:
    try:
        size = os.path.getsize(req.path)
    except OSError:
        size = req.offset + t.start + got
    found = max(0, min(req.nbytes, size - req.offset))
    return ShortReadError(req.path, req.offset, req.nbytes, found)
