"""The host tier of TieredStore: pinned host buffers, and the traffic between them and the record files.

``HostTier`` is the layer of ``TieredStore`` (store.py) that owns host memory and NVMe I/O: taking a
buffer (evicting by the policy), write-back (host -> NVMe), loading (NVMe -> host, checksum verified),
the prefetch queue, and the synchronous reads and writes of records that bypass host buffers. It is not
used alone: ``TieredStore.__init__`` sets the state declared below, ``GpuTier`` (gpu_tier.py) builds on
it, and the concurrency rules in store.py's docstring apply to every method here.

Host memory comes only from a ``PinnedBufferPool(host_budget)``: resident records, reads in flight and
buffers still being written all hold pool buffers, so the budget holds by construction. A prefetch that
does not fit now but will once write-backs in flight finish is queued (``_queue``, FIFO) and started by
the write-back that frees its room, so reads start the moment space exists.

A failed write-back (disk full, no permission, read-only, EIO) loses nothing: the record keeps its buffer,
stays dirty and remembers the error (``Record.error``). Its future fails with ``WriteBackError`` (key,
path, errno); prefetches queued on the room it was to free fail with it. A call that needs room writes
each victim at most once, takes records whose last write failed only when it must (``urgent``) and
last, and raises the failure once nothing else can free room: a broken disk fails the call that needs
it, never spins. Once the cause is fixed the same calls (or ``flush``) write the records again.
"""

from __future__ import annotations

import errno
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from io_engine import PinnedBufferPool, PooledBuffer, ShortReadError, format_size

from .checksum import Checksummer
from .policy import Policy
from .records import BudgetError, IntegrityError, Record, WriteBackError, done_future, pending_future, resolve_future

__all__ = ["HostTier"]

_WAIT_POLL_S = 0.05  # a blocked pool wait re-checks for new victims this often


class HostTier:
    """Host buffers, write-back, loading and the prefetch queue of a ``TieredStore``. Not used alone."""

    # Set by TieredStore.__init__. The counters, ``_recs`` and ``_queue`` change only under ``_lock``.
    host_budget: int
    verify: bool
    _closed: bool
    _io: Any  # IOEngine or SerialEngine: pread/pwrite/flush
    _pool: PinnedBufferPool  # every host buffer; its own lock is a leaf under ours
    _crc: Checksummer
    _mover: ThreadPoolExecutor  # finishes I/O completions off the I/O threads
    _lock: threading.Lock
    _mine: threading.local  # per thread: the records it has pinned (see _acquire)
    _recs: dict[str, Record]
    _policy: Policy
    _queue: deque[Record]  # prefetches waiting for room that write-backs will free
    _queued: int  # bytes (footprints) in _queue
    _releasing: int  # bytes that write-backs in flight will free
    _loading: int  # loads in flight
    _host_peak: int
    _evictions: int
    _io_wait: float
    _room_wait: float  # the part of _io_wait spent waiting for pool room (write-backs free it)
    _tier: dict[str, dict[str, int]]  # "gpu", "host": hits, misses and their bytes
    _nvme: dict[str, int]

    def _gpu_down(self, rec: Record) -> None:
        """GPU -> host: ``GpuTier`` provides it (a record in HBM comes down before it can load to host)."""
        raise NotImplementedError

    # -------------------------------------------------------------------- host buffers and write-back
    def _acquire(self, rec: Record, *, urgent: bool, block: bool, protect: frozenset[str] = frozenset()) -> Any:
        """A host buffer for ``rec``, evicting by the policy until enough bytes are free or on their way.

        ``block``: wait for write-backs and other threads to free room; raise BudgetError when only the
        caller's own pins could (they would never end), and (``urgent``) the first failed write-back of
        this call once no other record or move in flight can free room (see the module docstring).
        """
        size = max(rec.nbytes, 1)  # the pool hands out no empty buffers; a page serves a 0-byte record
        tried: set[Record] = set()  # written back by this call: at most once each, so a broken disk cannot loop
        started: list[Future[None]] = []
        while True:
            buf = self._pool.try_acquire(size)
            if buf is not None:
                return self._took(buf)
            writes = []
            with self._lock:
                coming = self._host_free() + self._releasing - self._queued
                cands = [k for k, r in self._recs.items() if r.evictable and r is not rec and k not in protect
                         and r not in tried and (urgent or r.error is None)]  # fmt: skip
                failed = next((f.exception() for f in started if f.done() and f.exception() is not None), None)
                hopeless = urgent and failed is not None and not cands and coming < rec.footprint and not self._loading
                order = self._policy.victims(cands, incoming=rec.key, urgent=urgent) if coming < rec.footprint else []
                for k in sorted(order, key=lambda k: self._recs[k].error is not None):  # failed ones last
                    v = self._recs[k]
                    coming += v.footprint
                    version = self._demote_locked(v)
                    if version is not None:
                        writes.append((v, version))
                        tried.add(v)
                        started.append(v.op)  # type: ignore[arg-type]
                    if coming >= rec.footprint:
                        break
                if urgent:  # hopeless only if this thread's own pins hold the room: others' pins end
                    held = {id(r): r for r in getattr(self._mine, "pins", ()) if r.buf is not None}
                    mine = sum(r.footprint for r in held.values())
                    stuck = rec.footprint > self.host_budget - mine
                else:  # a streaming put may give up as soon as nothing is moving: it then writes directly
                    stuck = self._host_free() + self._releasing < rec.footprint and not self._loading
            for v, version in writes:
                self._submit_mover(self._write_task, v, version)
            buf = self._pool.try_acquire(size)
            if buf is not None or not block:
                return buf and self._took(buf)
            if stuck:
                raise BudgetError(f"host_budget {format_size(self.host_budget)} cannot make room for record "
                                  f"{rec.key!r} ({format_size(rec.nbytes)}): {format_size(self._pool.in_use)} "
                                  "is held by pinned or moving records. Leave pin blocks sooner, or raise "
                                  "host_budget")  # fmt: skip
            if hopeless:  # the room is held by records the disk refused: say why, now
                if isinstance(failed, WriteBackError):
                    raise WriteBackError(failed.key, failed.path, failed.cause) from failed.cause
                raise failed  # type: ignore[misc]
            t0 = time.perf_counter()
            try:
                buf = self._pool.acquire(size, timeout=_WAIT_POLL_S)
            except TimeoutError:  # PoolExhaustedError: look for new victims, then wait again
                buf = None
            with self._lock:
                waited = time.perf_counter() - t0
                self._io_wait += waited
                self._room_wait += waited
            if buf is not None:
                return self._took(buf)

    def _took(self, buf: PooledBuffer) -> PooledBuffer:
        with self._lock:
            self._host_peak = max(self._host_peak, self._pool.in_use)
        return buf

    def _host_free(self) -> int:
        return self.host_budget - self._pool.in_use

    def _demote_locked(self, rec: Record) -> int | None:
        """Lock held, ``rec`` evictable. Clean: free its buffer now, no I/O (None). Dirty: start a
        releasing write-back and return the version to write (the caller submits ``_write_task``)."""
        if rec.dirty or not rec.on_disk:
            return self._write_locked(rec, release=True)
        buf, rec.buf = rec.buf, None
        self._evictions += 1
        buf.release()  # type: ignore[union-attr] # the pool's lock is a leaf: safe under ours
        return None

    def _demote(self, rec: Record) -> Future[None] | None:
        """Host -> NVMe if ``rec`` is evictable; the future resolves once the buffer is free."""
        with self._lock:
            if not rec.evictable:
                return None
            version, fut = self._demote_locked(rec), rec.op
        if version is None:
            self._drain()
            return done_future()
        self._submit_mover(self._write_task, rec, version)
        return fut

    def _write_locked(self, rec: Record, *, release: bool) -> int:
        rec.op, rec.kind, rec.keep, rec.releasing = pending_future(), "write", False, release
        rec.on_disk = False  # from now until it lands the file may be half old, half new
        self._releasing += rec.footprint if release else 0
        return rec.version

    def _write_task(self, rec: Record, version: int) -> None:
        """Mover thread: hand the buffer to the I/O threads, and checksum it (parallel segments) while the
        disk writes it: both only read the buffer, and the write-back frees it sooner this way."""
        iof = None
        try:
            data = rec.buf.tensor[: rec.nbytes]  # type: ignore[union-attr]
            iof = self._io.pwrite(data, rec.path, 0)
            crc = self._crc.compute(data)
        except BaseException as e:  # noqa: BLE001 - it belongs to the write's future
            if iof is None:
                self._write_done(rec, version, 0, e)
            else:  # the write is under way: the buffer is released only once it has finished
                iof.add_done_callback(lambda f, err=e: self._submit_mover(self._write_done, rec, version, 0, err))
            return
        iof.add_done_callback(lambda f: self._submit_mover(self._write_done, rec, version, crc, f.exception()))

    def _write_done(self, rec: Record, version: int, crc: int, exc: BaseException | None) -> None:
        """Mover thread: publish a write-back's outcome. On failure the record keeps its buffer, dirty."""
        if isinstance(exc, OSError):
            exc = WriteBackError(rec.key, rec.path, exc)
        free, starved = None, []
        with self._lock:
            self._releasing -= rec.footprint if rec.releasing else 0
            rec.error = None if exc is None else getattr(exc, "cause", exc)
            if exc is None:
                rec.on_disk, rec.checksum = True, crc
                rec.dirty = rec.version != version  # changed while being written: still dirty
                self._nvme["bytes_written"] += rec.nbytes
                self._nvme["writes"] += 1
                if rec.releasing and not (rec.keep or rec.pins or rec.dirty):
                    free, rec.buf = rec.buf, None
                    self._evictions += 1
            else:  # prefetches queued on the room this write was to free would wait for ever: fail them
                while self._queue and self._host_free() + self._releasing < self._queued:
                    starved.append(self._cancel_queued(self._queue[-1]))
            fut, rec.op, rec.kind, rec.keep, rec.releasing = rec.op, None, None, False, False
        if free is not None:
            free.release()
        self._drain()
        for f in starved:
            resolve_future(f, exc)
        resolve_future(fut, exc)

    # ---------------------------------------------------------------------------------------- loading
    def _begin_host(self, rec: Record, *, block: bool, protect: frozenset[str] = frozenset()) -> tuple[Any, bool]:
        """Start bringing ``rec`` into host memory: (future, or None when it is there already; started).

        ``block=False`` (prefetch) never waits: it queues the record when room is on its way, else
        returns (None, False). ``block=True`` waits for room (evicting urgently) and for other moves.
        """
        while True:
            with self._lock:
                self._alive(rec)
                if rec.in_host:
                    rec.keep = rec.keep or rec.kind == "write"  # wanted in host: the write-back keeps the buffer
                    return rec.op, True
                if rec.gpu is not None and rec.kind is None and not block:
                    return None, True  # already above host
                busy = (
                    rec.op if rec.kind in ("load", "acquiring", "move") or rec.kind == "queued" and not block else None
                )
                if busy is not None and not block:
                    return busy, True
                if busy is None and rec.gpu is None:
                    if rec.footprint > self.host_budget:
                        if not block:
                            return None, False
                        raise ValueError(f"record {rec.key!r} ({format_size(rec.nbytes)}) is larger than "
                                         f"host_budget {format_size(self.host_budget)}: read it with get(), "
                                         "or raise host_budget")  # fmt: skip
                    if rec.kind == "queued":
                        self._unqueue(rec)
                    rec.op, rec.kind = rec.op or pending_future(), "acquiring"
                    fut, jump = rec.op, block or not self._queue  # a prefetch waits behind earlier queued ones
                    break
            if busy is not None:
                self._wait(busy, swallow=True)  # a failed load is retried (and reported) below
            else:
                self._gpu_down(rec)
        try:
            buf = self._acquire(rec, urgent=block, block=block, protect=protect) if jump else None
        except BaseException as e:
            with self._lock:
                rec.op = rec.kind = None
            fut.set_exception(e)
            raise
        if buf is None:
            with self._lock:
                if self._host_free() + self._releasing - self._queued >= rec.footprint:
                    rec.kind = "queued"  # a write-back in flight will free room: _drain starts the read then
                    self._queue.append(rec)
                    self._queued += rec.footprint
                    return fut, True
                rec.op = rec.kind = None
            fut.set_result(None)
            return None, False
        self._start_load(rec, buf)
        return fut, True

    def _start_load(self, rec: Record, buf: PooledBuffer) -> None:
        with self._lock:
            rec.buf, rec.kind = buf, "load"
            self._loading += 1
        try:
            iof = self._io.pread(buf.tensor[: rec.nbytes], rec.path, 0)
        except BaseException as e:  # noqa: BLE001 - it belongs to the load's future
            self._load_done(rec, e)
            return
        iof.add_done_callback(lambda f: self._submit_mover(self._load_done, rec, f.exception()))

    def _load_done(self, rec: Record, exc: BaseException | None) -> None:
        """Mover thread: verify the checksum, then publish the buffer (or free it on error)."""
        if exc is not None:
            exc = self._read_error(rec, exc)
        elif self.verify and rec.checksum is not None:
            got = self._crc.compute(rec.buf.tensor[: rec.nbytes])  # type: ignore[union-attr]
            exc = self._mismatch(rec, got) if got != rec.checksum else None
        free = None
        with self._lock:
            self._loading -= 1
            if exc is None:
                rec.dirty = False
                self._nvme["bytes_read"] += rec.nbytes
                self._nvme["reads"] += 1
            else:
                free, rec.buf = rec.buf, None
            fut, rec.op, rec.kind = rec.op, None, None
        if free is not None:
            free.release()
            self._drain()
        resolve_future(fut, exc)

    def _drain(self) -> None:
        """Start queued prefetches, head first, while the pool has room for them."""
        while True:
            with self._lock:
                if self._closed or not self._queue:
                    return
                rec = self._queue[0]
            buf = self._pool.try_acquire(max(rec.nbytes, 1))
            if buf is None:
                return
            with self._lock:
                ok = bool(self._queue) and self._queue[0] is rec and rec.kind == "queued"
                if ok:
                    self._unqueue(rec)
                    rec.kind = "acquiring"
            if ok:
                self._start_load(rec, self._took(buf))
            else:
                buf.release()

    def _unqueue(self, rec: Record) -> None:  # lock held
        self._queue.remove(rec)
        self._queued -= rec.footprint

    def _cancel_queued(self, rec: Record) -> Future[None] | None:
        """Lock held: drop ``rec``'s queued prefetch; the caller resolves the returned future (unlocked)."""
        if rec.kind != "queued":
            return None
        self._unqueue(rec)
        fut, rec.op, rec.kind = rec.op, None, None
        return fut

    # ------------------------------------------------------------------------------ synchronous I/O
    def _write_now(self, rec: Record, tensor: torch.Tensor) -> None:
        """Write ``tensor`` as ``rec``'s file in the caller's thread (a record no host buffer can hold)."""
        src = tensor.detach()
        src = src.cpu() if src.device.type != "cpu" else src.contiguous()  # pageable staging, not the budget
        crc = self._crc.compute(src)
        self._io.pwrite(src, rec.path, 0).result()
        with self._lock:
            rec.on_disk, rec.checksum, rec.dirty, rec.error = True, crc, False, None
            self._nvme["bytes_written"] += rec.nbytes
            self._nvme["writes"] += 1

    def _read_now(self, rec: Record, out: torch.Tensor) -> None:
        """Read ``rec``'s file into ``out`` (uint8, nbytes) in the caller's thread, and verify it."""
        t0 = time.perf_counter()
        try:
            self._io.pread(out, rec.path, 0).result()
        except BaseException as e:
            raise self._read_error(rec, e) from e
        finally:
            with self._lock:
                self._io_wait += time.perf_counter() - t0
        got = self._crc.compute(out) if self.verify and rec.checksum is not None else rec.checksum
        if got != rec.checksum:
            raise self._mismatch(rec, got)  # type: ignore[arg-type]
        with self._lock:
            self._nvme["bytes_read"] += rec.nbytes
            self._nvme["reads"] += 1

    def _mismatch(self, rec: Record, got: int) -> IntegrityError:
        what = f"does not match its checksum (crc32 {got:#010x} read, {rec.checksum:#010x} written): it is corrupted"
        return IntegrityError(rec.key, rec.path, what)

    def _read_error(self, rec: Record, exc: BaseException) -> BaseException:
        if isinstance(exc, ShortReadError):
            what = f"is truncated: it holds {exc.found} of the record's {exc.expected} bytes"
            return IntegrityError(rec.key, rec.path, what)
        if isinstance(exc, OSError) and exc.errno == errno.ENOENT:
            return IntegrityError(rec.key, rec.path, "is missing")
        return exc

    # ---------------------------------------------------------------------------- movement primitives
    def _alive(self, rec: Record) -> None:  # lock held
        if rec.deleted:
            raise KeyError(f"record {rec.key!r} was deleted (or replaced) while this call waited for it")

    def _count(self, tier: str, rec: Record, hit: bool) -> None:  # lock held
        d = self._tier[tier]
        d["hits" if hit else "misses"] += 1
        d["hit_bytes" if hit else "miss_bytes"] += rec.nbytes

    def _wait(self, fut: Future[None], *, swallow: bool = False) -> None:
        t0 = time.perf_counter()
        try:
            fut.result()
        except BaseException:
            if not swallow:
                raise
        finally:
            with self._lock:
                self._io_wait += time.perf_counter() - t0

    def _finish(self, rec: Record) -> None:
        """End a synchronous move ("move") and wake those waiting on it."""
        with self._lock:
            fut, rec.op, rec.kind = rec.op, None, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _submit_mover(self, fn: Any, *args: Any) -> None:
        try:
            self._mover.submit(fn, *args)
        except RuntimeError:  # shut down (interpreter exit): finish inline rather than lose a completion
            fn(*args)
