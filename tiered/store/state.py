"""What the parts of a TieredStore share: ``StoreState``, its one lock, its records, resources and counters.

``TieredStore`` (store.py) builds one ``StoreState`` and hands it, explicitly, to the ``HostTier`` and the
``GpuTier`` it composes; nothing here knows about either tier. The records, the counters and every
``Record`` change only under ``lock``, which is held only for those few assignments: never across I/O,
checksums, copies or pool allocation (store.py, "Concurrency"). The pool's own lock is a leaf under it.

The few primitives the parts share live here too (``get``, ``alive``, ``count``, ``wait``, ``finish``, ``submit``),
and how the state is made: ``check_arguments`` (the constructor's checks, in its order) and ``StoreState.open``.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Any

import torch

from io_engine import IOConfig, IOEngine, PinnedBufferPool, format_size, parse_size
from io_engine.condition import Condition
from io_engine.threadpool import ThreadPool

from ..arguments import folder_path
from ..policy import Policy
from .checksum import Checksummer
from .records import Record, check_key

__all__ = ["StoreState", "check_arguments"]


def check_arguments(nvme_path: Any, gpu_budget: Any, host_budget: Any, io: Any, verify: Any, stream_reserve: Any,
                    mover_threads: Any) -> tuple[str, int, int, int]:  # fmt: skip
    """``TieredStore``'s arguments checked (``TypeError``/``ValueError``): (folder, host, gpu, reserve bytes).

    ``gpu_budget`` without CUDA is a ``RuntimeWarning`` (on the line that made the store) and becomes 0.
    """
    path = folder_path(nvme_path, "nvme_path", "/mnt/nvme")  # "" refused, not taken for the current folder
    host_bytes = parse_size(host_budget, name="host_budget")
    gpu_bytes = parse_size(gpu_budget, name="gpu_budget")
    if gpu_bytes and not torch.cuda.is_available():
        msg = f"gpu_budget={gpu_budget!r} ignored: CUDA is not available, so there is no HBM tier"
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        gpu_bytes = 0
    reserve = host_bytes // 4 if stream_reserve is None else parse_size(stream_reserve, name="stream_reserve")
    if reserve > host_bytes:
        raise ValueError(f"stream_reserve {format_size(reserve)} exceeds host_budget "
                         f"{format_size(host_bytes)}: lower it or raise host_budget")  # fmt: skip
    if not isinstance(verify, bool):
        raise TypeError(f"verify must be True or False, got {verify!r}")
    if isinstance(mover_threads, bool) or not isinstance(mover_threads, int) or mover_threads < 1:
        raise ValueError(f"mover_threads must be an int >= 1, got {mover_threads!r}")
    if not (io is None or isinstance(io, IOConfig) or all(hasattr(io, a) for a in ("pread", "pwrite", "flush"))):
        raise TypeError(f"io must be an IOConfig, an IOEngine/SerialEngine or None, got {type(io).__name__}")
    return path, host_bytes, gpu_bytes, reserve


def _tier_counters() -> dict[str, dict[str, int]]:
    return {t: dict(hits=0, misses=0, hit_bytes=0, miss_bytes=0) for t in ("gpu", "host")}


@dataclass(eq=False)
class StoreState:
    """The state a store's parts share. ``recs``, ``closed`` and the counters change only under ``lock``."""

    path: str  # the store's folder
    host_budget: int
    verify: bool  # check every read against the record's checksum
    io: Any  # IOEngine or SerialEngine: pread/pwrite/flush
    own_io: bool  # the store made ``io``, so it closes it
    pool: PinnedBufferPool  # every host buffer
    crc: Checksummer
    mover: ThreadPool  # finishes I/O completions off the I/O threads
    policy: Policy
    # An RLock: a Ctrl-C cannot interrupt a wait's re-take of it, which would leave the waiter outside it (condition.py)
    lock: threading.RLock = field(default_factory=threading.RLock)
    unpinned: Condition = field(init=False)  # on ``lock``: notified as a record's last pin ends
    # Held around a flush's index save (taken before ``lock``, never under it): two flushes at once would
    # share index.json.tmp, and the later snapshot must be the one that lands.
    index_lock: threading.Lock = field(default_factory=threading.Lock)
    mine: threading.local = field(default_factory=threading.local)  # per thread: the records it pinned ("pins")
    recs: dict[str, Record] = field(default_factory=dict)
    # The records a put took aside (replace.py), by file: each is in ``Move.MOVE`` until its file is unlinked or it
    # is put back, and until then no new record may take that file name (the unlink would take the new file).
    aside: dict[str, Record] = field(default_factory=dict)
    closed: bool = True  # until the store is built, and once it is closed
    closing: bool = False  # close() has begun: no new call, pin or get() copy starts (lifecycle.py)
    pid: int = field(default_factory=os.getpid)  # the process whose threads serve the store (a fork has none)
    host_peak: int = 0
    evictions: int = 0
    io_wait: float = 0.0
    room_wait: float = 0.0  # the part of io_wait spent waiting for pool room (write-backs free it)
    tier: dict[str, dict[str, int]] = field(default_factory=_tier_counters)  # "gpu", "host": hits, misses, bytes
    # bytes_written counts a write once it has landed; write_started_bytes once it is begun (a step's writes, some
    # still in flight when it returns: optim/step_stats.py counts them by this one).
    nvme: dict[str, int] = field(default_factory=lambda: dict(bytes_read=0, bytes_written=0, reads=0, writes=0,
                                                               write_started_bytes=0))  # fmt: skip

    def __post_init__(self) -> None:
        self.unpinned = Condition(self.lock)

    @classmethod
    def open(cls, path: str, host_budget: int, verify: bool, io: Any, mover_threads: int, policy: Policy) -> StoreState:
        """The engine (``io``: an IOConfig or None makes the store's own), pool, checksummer and movers; closed
        until the store is built."""
        own_io = io is None or isinstance(io, IOConfig)
        engine = IOEngine(io or IOConfig.from_env(), follow_symlinks=False) if own_io else io
        pool = PinnedBufferPool(host_budget)
        crc = Checksummer()
        mover = ThreadPool(mover_threads, thread_name_prefix="tiered-mover")
        return cls(path, host_budget, verify, engine, own_io, pool, crc, mover, policy)

    def stats(self, gpu: dict[str, int]) -> dict[str, Any]:  # lock held
        """The counters, as ``TieredStore.stats()`` returns them; ``gpu``: the GPU tier's in_use, peak, budget."""
        host = dict(in_use=self.pool.in_use, peak=self.host_peak, budget=self.host_budget,
                    made_bytes=self.pool.made_bytes, made_s=self.pool.made_s)  # fmt: skip
        return {"gpu": {**self.tier["gpu"], **gpu}, "host": {**self.tier["host"], **host},
                "nvme": dict(self.nvme), "evictions": self.evictions, "io_wait_s": self.io_wait,
                "room_wait_s": self.room_wait, "checksum_bytes": self.crc.bytes, "checksum_s": self.crc.seconds,
                "records": len(self.recs), "policy": self.policy.stats()}  # fmt: skip

    def check_open(self) -> None:
        """Raise unless the store may take a new call: it belongs to this process and is not closing or closed."""
        self.check_process()
        if self.closed or self.closing:
            raise RuntimeError(f"this TieredStore ({self.path}) is closed; open a new one on the folder")

    @property
    def here(self) -> bool:
        """This is the process that made the store (not a forked child of it)."""
        return os.getpid() == self.pid

    def check_process(self) -> None:
        """Raise in a forked child: the store's threads (movers, I/O) live only in the process that made it."""
        if not self.here:  # first: a lock some thread held at the fork is never released in the child
            raise RuntimeError(f"this TieredStore ({self.path}) was made in process {self.pid}, before a fork: "
                               "its threads did not survive the fork. Make the store in the child, after the "
                               "fork, or start workers with the 'spawn' method")  # fmt: skip

    def get(self, key: str) -> Record:  # lock held
        rec = self.recs.get(check_key(key))
        if rec is None:
            raise KeyError(f"no record {key!r} in the store at {self.path} ({len(self.recs)} records): put() it first")
        return rec

    def alive(self, rec: Record) -> None:  # lock held
        if rec.deleted:
            raise KeyError(f"record {rec.key!r} was deleted (or replaced) while this call waited for it")

    def count(self, tier: str, rec: Record, hit: bool) -> None:  # lock held
        d = self.tier[tier]
        d["hits" if hit else "misses"] += 1
        d["hit_bytes" if hit else "miss_bytes"] += rec.nbytes

    def unpin(self, rec: Record, *, reading: bool = False) -> None:  # lock held
        """End one pin of ``rec`` (``reading``: a get()'s copy), waking a delete or replace that waits for it."""
        rec.pins -= 1
        rec.reading -= reading
        if not rec.pins:
            self.unpinned.notify_all()
            self.evictable_now(rec)

    def end_file_read(self, rec: Record) -> None:
        """End a get()'s direct read of ``rec``'s file: its pin, and its hold on a flush's write of the file."""
        with self.lock:
            rec.file_reads -= 1
            self.unpin(rec, reading=True)

    def evictable_now(self, rec: Record) -> None:  # lock held
        """If ``rec`` can be evicted now, wake the threads waiting for pool room: one of them may evict it
        (HostTier.acquire reads ``pool.nudges`` under this lock, so no wake is lost)."""
        if rec.evictable:
            self.pool.nudge()

    def wait(self, fut: Future[None], *, swallow: bool = False) -> None:
        """Wait for a movement's future (lock not held), counted in ``io_wait``; ``swallow``: ignore its error (the
        movement's owner reports it), never one raised in this thread while it waits: a Ctrl-C is the caller's."""
        t0 = time.perf_counter()
        try:
            fut.result()
        except BaseException as e:
            if not swallow or not _outcome(fut, e):
                raise
        finally:
            with self.lock:
                self.io_wait += time.perf_counter() - t0

    def finish(self, rec: Record) -> None:
        """End a synchronous move (``Move.MOVE``) and wake those waiting on it."""
        with self.lock:
            fut = rec.end()
            self.evictable_now(rec)  # a put into host memory, a move down from HBM: a waiter may evict it
        if fut is not None and not fut.done():
            fut.set_result(None)

    def submit(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` on a mover thread; inline once they are shut down (a completion that arrives as the
        store closes), rather than lose it."""
        try:
            self.mover.submit(fn, *args)
        except RuntimeError:
            fn(*args)

    def settle(self) -> None:
        """Wait (lock not held) until no record has a movement in flight; their owners report the errors."""
        while True:
            with self.lock:
                ops = [r.op for r in self.recs.values() if r.op is not None]
            if not ops:
                return
            for f in ops:
                self.wait(f, swallow=True)

    def close(self) -> None:
        """Stop the mover threads, then free the checksummer, the pool and (when it is the store's) the engine."""
        self.mover.shutdown(wait=True)
        self.crc.close()
        self.pool.close()
        if self.own_io:
            self.io.close()


def _outcome(fut: Future[None], e: BaseException) -> bool:
    """Whether ``e``, raised by ``fut.result()``, is the future's own failure (or cancellation), not an exception
    raised in the waiting thread meanwhile (a ``KeyboardInterrupt``: Python raises it in the main thread's wait)."""
    if not fut.done():
        return False
    if fut.cancelled():
        return isinstance(e, CancelledError)
    return fut.exception() is e
