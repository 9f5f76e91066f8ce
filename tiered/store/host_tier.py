"""The host tier of TieredStore: pinned host buffers, and the traffic between them and the record files.

``HostTier`` owns host memory and NVMe I/O: taking a buffer (evicting by the policy), write-back (host ->
NVMe), loading (NVMe -> host, checksum verified), the prefetch queue, and the synchronous reads and writes of
records that bypass host buffers. ``TieredStore`` (store.py) makes one and hands it the ``StoreState``
(store/state.py) it shares with the ``GpuTier``; it knows nothing of the tiers above it: a blocking load of a
record in HBM is handed the GPU tier's ``down`` by its caller. The concurrency rules in store.py's
docstring apply to every method here; the moves a record makes are record_state.py's table.

Host memory comes only from a ``PinnedBufferPool(host_budget)``: resident records, reads in flight and
buffers still being written all hold pool buffers, so the budget holds by construction. A prefetch that
does not fit now but will once write-backs in flight finish is queued (``queue``, FIFO) and started by
the write-back that frees its room, so reads start the moment space exists. One whose buffer the pool fails to
make then (mmap ENOMEM, a bad $TIERED_HUGE_PAGES) fails with that error; those behind it still start.

Room on its way (``coming``): free bytes, plus those write-backs in flight will free, less those promised to
queued prefetches. A record read ahead and not yet used is evicted only when this falls short, so it must
never dip below the truth, even for an instant: a prefetch or pin that looked then would evict a chunk
about to be used, to be read again (once a CI flake: a step that read one chunk twice). So a buffer that
leaves the counters is handed back to the pool under the lock, in the same step (the pool's lock is a
leaf), and ``drain``, which takes a queued record's buffer outside the lock, counts it in ``taking`` while it
does: the sum may then overstate the room for that instant, which at worst queues a prefetch or makes a
pin wait, never evicts.

A failed write-back (disk full, no permission, read-only, EIO) loses nothing: the record keeps its buffer,
stays dirty and remembers the error (``Record.error``). Its future fails with ``WriteBackError`` (key,
path, errno); prefetches queued on the room it was to free fail with it. A call that needs room writes
each victim at most once, takes records whose last write failed only when it must (``urgent``) and
last, and raises the failure once nothing else can free room: a broken disk fails the call that needs
it, never spins. Once the cause is fixed the same calls (or ``flush``) write the records again. (A victim
written once that another thread kept in host memory meanwhile, clean now, is dropped with no write.)

A call waiting for room sleeps in the pool until a buffer comes back or a record turns evictable (an unpin, a
load or a write-back that keeps its buffer, a synchronous put: ``StoreState.evictable_now`` nudges the pool),
then looks for victims again; ``_WAIT_POLL_S`` is only a backstop.

A buffer goes from the pool to its record with Ctrl-C held (``deferred_sigint``): one landing as the pool hands it
over, before a record holds it, lost it for good (counted in use, the budget short by it). The waits on the way let
a press through at once (``in_room_wait``): nothing is taken there, and others' pins or a stalled disk can make
them last for ever.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, cast

from io_engine import PooledBuffer, format_size, waiting_for_buffer, waiting_for_room

from ..interrupts import deferred_sigint, flagged
from .record_state import Move
from .records import BudgetError, Record, WriteBackError, done_future, resolve_future
from .state import StoreState
from .sync_io import SyncIO

__all__ = ["HostTier"]

# A blocked pool wait ends when a buffer comes back, or when a record turns evictable (StoreState.evictable_now
# nudges the pool); this is only the backstop of a wake nobody sends.
_WAIT_POLL_S = 0.5


def in_room_wait() -> bool:
    """Whether this thread waits for host room (a pool buffer to come back) or I/O queue room, nothing taken yet: a
    call that holds Ctrl-C lets one through there (``deferred_sigint(lands=...)``; the module docstring)."""
    return waiting_for_buffer() or waiting_for_room()


class HostTier(SyncIO):
    """Host buffers, write-back, loading and the prefetch queue of a ``TieredStore``, over its ``StoreState``."""

    def __init__(self, state: StoreState) -> None:
        self.state = state
        # Changed only under state.lock, like the state's own counters.
        self.queue: deque[Record] = deque()  # prefetches waiting for room that write-backs will free
        self.queued = 0  # bytes (footprints) in queue
        self.releasing = 0  # bytes that write-backs in flight will free
        self.loading = 0  # loads in flight
        self.taking = 0  # bytes (footprints) of queued records whose buffer drain is taking now (see coming)

    # -------------------------------------------------------------------- host buffers and write-back
    def acquire(self, rec: Record, *, urgent: bool, block: bool, protect: frozenset[str] = frozenset()) -> Any:
        """A host buffer for ``rec``, evicting by the policy until enough bytes are free or on their way.

        ``block``: wait for write-backs and other threads to free room; raise BudgetError when only the
        caller's own pins could (they would never end), and (``urgent``) the first failed write-back of
        this call once no other record or move in flight can free room (see the module docstring).
        """
        s = self.state
        size = max(rec.nbytes, 1)  # the pool hands out no empty buffers; a page serves a 0-byte record
        tried: set[Record] = set()  # written back by this call: at most once each, so a broken disk cannot loop
        started: list[Future[None]] = []
        while True:
            buf = s.pool.try_acquire(size)
            if buf is not None:
                return self._took(buf)
            writes = []
            # A Ctrl-C between marking victims' write-backs and handing them to the movers would strand them in
            # WRITE for ever (every later flush, close or call on them would wait): it comes after the hand-over.
            with deferred_sigint():
                with s.lock:
                    looked = s.pool.nudges  # a record that turns evictable after this scan wakes the wait below
                    coming = self.coming()
                    # A record this call wrote back once is passed over (a broken disk must not loop), unless it is
                    # clean now: written, kept because another thread used it meanwhile, and free to drop with no I/O.
                    cands = [k for k, r in s.recs.items() if r.evictable and r is not rec and k not in protect
                             and (r not in tried or not (r.dirty or not r.on_disk))
                             and (urgent or r.error is None)]  # fmt: skip
                    failed = next((f.exception() for f in started if f.done() and f.exception() is not None), None)
                    hopeless = urgent and failed is not None and not cands
                    hopeless = hopeless and coming < rec.footprint and not self.loading
                    order = s.policy.victims(cands, incoming=rec.key, urgent=urgent) if coming < rec.footprint else []
                    for k in sorted(order, key=lambda k: s.recs[k].error is not None):  # failed ones last
                        v = s.recs[k]
                        coming += v.footprint
                        version = self.demote_locked(v)
                        if version is not None:
                            writes.append((v, version))
                            tried.add(v)
                            started.append(v.op)  # type: ignore[arg-type]
                        if coming >= rec.footprint:
                            break
                    if urgent:  # hopeless only if this thread's own pins hold the room: others' pins end
                        held = {id(r): r for r in getattr(s.mine, "pins", ()) if r.buf is not None}
                        mine = sum(r.footprint for r in held.values())
                        stuck = rec.footprint > s.host_budget - mine
                    else:  # a streaming put may give up as soon as nothing is moving: it then writes directly
                        stuck = self.free() + self.releasing < rec.footprint and not self.loading
                for v, version in writes:
                    self.start_write(v, version)
            buf = s.pool.try_acquire(size)
            if buf is not None or not block:
                return buf and self._took(buf)
            if stuck:
                raise BudgetError(f"host_budget {format_size(s.host_budget)} cannot make room for record "
                                  f"{rec.key!r} ({format_size(rec.nbytes)}): {format_size(s.pool.in_use)} "
                                  "is held by pinned or moving records. Leave pin blocks sooner, or raise "
                                  "host_budget")  # fmt: skip
            if hopeless:  # the room is held by records the disk refused: say why, now
                if isinstance(failed, WriteBackError):  # whose path is always set (IOEngineError's may be None)
                    raise WriteBackError(failed.key, cast(str, failed.path), failed.cause) from failed.cause
                raise failed  # type: ignore[misc]
            t0 = time.perf_counter()
            try:
                buf = s.pool.acquire(size, timeout=_WAIT_POLL_S, since=looked)
            except TimeoutError:  # PoolExhaustedError: look for new victims, then wait again
                buf = None
            with s.lock:
                waited = time.perf_counter() - t0
                s.io_wait += waited
                s.room_wait += waited
            if buf is not None:
                return self._took(buf)

    def spare(self, nbytes: int) -> PooledBuffer | None:
        """A pool buffer of ``nbytes`` if the budget has room now, for a caller's own use (store.spare)."""
        buf = self.state.pool.try_acquire(max(nbytes, 1))
        return None if buf is None else self._took(buf)

    def _took(self, buf: PooledBuffer) -> PooledBuffer:
        with self.state.lock:
            self.state.host_peak = max(self.state.host_peak, self.state.pool.in_use)
        self.cancel_starved()  # a blocking call may have taken the room a queued prefetch counted on
        return buf

    def cancel_starved(self) -> None:
        """Drop the queued prefetches, last first, that the room on its way can no longer serve: a blocking
        call took free room they counted on, or a write-back kept its buffer (pinned or changed meanwhile).
        Nothing would start them then, and a caller waiting on one would wait for ever; a dropped prefetch's
        future resolves and its record stays on NVMe, to be read when it is used."""
        if not self.queue:  # the common case, on every buffer taken: no lock
            return
        with self.state.lock:
            starved = []
            while self.queue and self.coming() < 0:
                starved.append(self.cancel_queued(self.queue[-1]))
        for f in starved:
            resolve_future(f, None)

    def free(self) -> int:
        """Host budget bytes no buffer holds."""
        return self.state.host_budget - self.state.pool.in_use

    def coming(self) -> int:  # lock held
        """Host budget bytes free or on their way, less those promised to queued prefetches (module docstring)."""
        return self.free() + self.releasing - self.queued + self.taking

    def demote_locked(self, rec: Record) -> int | None:
        """Lock held, ``rec`` evictable. Clean: free its buffer now, no I/O (None). Dirty: start a
        releasing write-back and return the version to write (the caller calls ``start_write``)."""
        if rec.dirty or not rec.on_disk:
            return self.write_locked(rec, release=True)
        buf, rec.buf = rec.buf, None
        self.state.evictions += 1
        buf.release()  # type: ignore[union-attr] # the pool's lock is a leaf: safe under ours
        return None

    def demote(self, rec: Record) -> Future[None] | None:
        """Host -> NVMe if ``rec`` is evictable; the future resolves once the buffer is free."""
        # A Ctrl-C between beginning the write-back and handing it to the movers would leave the record in WRITE for
        # ever (the put that streams it waited for it in its own clean-up, as would every later call on the key).
        with deferred_sigint():
            with self.state.lock:
                if not rec.evictable:
                    return None
                version, fut = self.demote_locked(rec), rec.op
            if version is not None:
                self.start_write(rec, version)
        if version is None:
            self.drain()
            return done_future()
        return fut

    def write_locked(self, rec: Record, *, release: bool) -> int:
        """Lock held, ``rec`` idle with a buffer: begin its write-back; returns the version to write."""
        rec.begin_write(release=release)
        self.releasing += rec.footprint if release else 0
        self.state.nvme["write_started_bytes"] += rec.nbytes
        return rec.version

    def start_write(self, rec: Record, version: int) -> None:
        """Run a write-back begun by ``write_locked``: on a mover thread, then the I/O threads."""
        self.state.submit(self._write_task, rec, version)

    def adopt_write(self, rec: Record, iof: Future[Any], version: int, crc: int) -> None:
        """A put's write of ``rec`` (in its move) from its buffer, under way, is left to finish on its own (a Ctrl-C
        in the put's wait: store/replace.py): it becomes ``rec``'s write-back, freeing the buffer once written. The
        put counted the buffer in ``releasing`` already (``write_placed``): that count is now the write-back's."""
        with self.state.lock:
            moved = rec.end()
            rec.begin_write(release=True)
        moved.set_result(None)  # type: ignore[union-attr]
        iof.add_done_callback(lambda f: self.state.submit(self._write_done, rec, version, crc, f.exception()))

    def _write_task(self, rec: Record, version: int) -> None:
        """Mover thread: hand the buffer to the I/O threads, and checksum it (parallel segments) while the
        disk writes it: both only read the buffer, and the write-back frees it sooner this way."""
        iof = None
        try:
            data = rec.buf.tensor[: rec.nbytes]  # type: ignore[union-attr]
            iof = self.state.io.pwrite(data, rec.path, 0)
            crc = self.state.crc.compute(data)
        except BaseException as e:  # noqa: BLE001 - it belongs to the write's future
            if iof is None:
                self._write_done(rec, version, 0, e)
            else:  # the write is under way: the buffer is released only once it has finished
                iof.add_done_callback(lambda f, err=e: self.state.submit(self._write_done, rec, version, 0, err))
            return
        iof.add_done_callback(lambda f: self.state.submit(self._write_done, rec, version, crc, f.exception()))

    def _write_done(self, rec: Record, version: int, crc: int, exc: BaseException | None) -> None:
        """Mover thread: publish a write-back's outcome. On failure the record keeps its buffer, dirty."""
        if isinstance(exc, OSError):
            exc = WriteBackError(rec.key, rec.path, exc)
        s, starved = self.state, []
        with s.lock:
            self.releasing -= rec.footprint if rec.releasing else 0
            rec.error = None if exc is None else getattr(exc, "cause", exc)
            if exc is None:
                rec.on_disk, rec.checksum = True, crc
                rec.dirty = rec.version != version  # changed while being written: still dirty
                s.nvme["bytes_written"] += rec.nbytes
                s.nvme["writes"] += 1
                if rec.releasing and not (rec.keep or rec.pins or rec.dirty):
                    # Back to the pool here, under the lock, as ``releasing`` drops: not after (``coming``).
                    rec.buf.release()  # type: ignore[union-attr]
                    rec.buf = None
                    s.evictions += 1
            else:  # prefetches queued on the room this write was to free would wait for ever: fail them
                while self.queue and self.free() + self.releasing < self.queued:
                    starved.append(self.cancel_queued(self.queue[-1]))
            fut = rec.end()
            s.evictable_now(rec)  # written and kept: a waiter may evict it now without a write
        try:
            self.drain()
        finally:  # on a mover thread an error here would be lost: the futures resolve whatever drain does
            for f in starved:
                resolve_future(f, exc)
            resolve_future(fut, exc)

    # ---------------------------------------------------------------------------------------- loading
    def begin(self, rec: Record, *, block: bool, protect: frozenset[str] = frozenset(),
              gpu_down: Callable[[Record], None] | None = None) -> tuple[Any, bool]:  # fmt: skip
        """Start bringing ``rec`` into host memory: (future, or None when it is there already; started).

        ``block=False`` (prefetch) never waits: it queues the record when room is on its way, else
        returns (None, False). ``block=True`` waits for room (evicting urgently) and for other moves, and
        brings a record in HBM down first with ``gpu_down`` (the GPU tier's ``down``, which it needs then).
        """
        # Held from taking the record's move to handing its read over (a Ctrl-C between left it in ACQUIRING for
        # good, or lost the buffer taken for it), but for the waits on the way: for another call, or for room.
        waiting = [False]
        with deferred_sigint(lands=lambda: waiting[0] or in_room_wait()):
            return self._begin(rec, block, protect, gpu_down, waiting)

    def _begin(self, rec: Record, block: bool, protect: frozenset[str],
               gpu_down: Callable[[Record], None] | None, waiting: list[bool]) -> tuple[Any, bool]:  # fmt: skip
        s = self.state
        while True:
            with s.lock:
                s.alive(rec)
                if rec.in_host:
                    rec.want_in_host()  # a write-back in flight keeps the buffer
                    return rec.op, True
                if rec.gpu is not None and rec.idle and not block:
                    return None, True  # already above host
                moving = rec.kind in (Move.LOAD, Move.ACQUIRING, Move.MOVE)
                busy = rec.op if moving or rec.kind is Move.QUEUED and not block else None
                if busy is not None and not block:
                    return busy, True
                if busy is None and rec.gpu is None:
                    if rec.footprint > s.host_budget:
                        if not block:
                            return None, False
                        raise ValueError(f"record {rec.key!r} takes {format_size(rec.footprint)} ({rec.footprint} B) "
                                         f"of host memory (its {rec.nbytes} B in whole 4 KiB pages), larger than "
                                         f"host_budget {format_size(s.host_budget)} ({s.host_budget} B): read it "
                                         "with get(), or raise host_budget")  # fmt: skip
                    if rec.kind is Move.QUEUED:  # a blocking call takes the queued prefetch over
                        self._unqueue(rec)
                        rec.advance(Move.ACQUIRING)
                    else:
                        rec.begin(Move.ACQUIRING)
                    # begin()/advance() just set rec.op; a prefetch waits behind earlier queued ones
                    fut, jump = cast("Future[None]", rec.op), block or not self.queue
                    break
            if busy is not None:
                with flagged(waiting):
                    s.wait(busy, swallow=True)  # a failed load is retried (and reported) below
            else:
                gpu_down(rec)  # type: ignore[misc] # only a blocking call gets here: it passed gpu_down
        try:
            buf = self.acquire(rec, urgent=block, block=block, protect=protect) if jump else None
        except BaseException as e:
            with s.lock:
                rec.end()
            fut.set_exception(e)
            raise
        if buf is None:
            with s.lock:
                if self.coming() >= rec.footprint:
                    rec.advance(Move.QUEUED)  # a write-back in flight will free room: drain starts the read then
                    self.queue.append(rec)
                    self.queued += rec.footprint
                    return fut, True
                rec.end()
            fut.set_result(None)
            return None, False
        self._start_load(rec, buf)
        return fut, True

    def _start_load(self, rec: Record, buf: PooledBuffer, *, own: bool = True) -> None:
        # A Ctrl-C is held until the read is handed over, then raised from here, the load under way: one landing
        # once the engine counted the request would leave it unknown whether the read was queued (the buffer must
        # not go back while it may be), and one taken for the load's failure was retried, never reaching the caller.
        # Only the engine's wait for queue room lets one through (lands): nothing is queued then, and a disk that
        # stalls would keep that wait, and the press, for ever.
        with deferred_sigint(lands=waiting_for_room):
            with self.state.lock:
                rec.buf = buf
                rec.advance(Move.LOAD)
                self.loading += 1
            try:
                iof = self.state.io.pread(buf.tensor[: rec.nbytes], rec.path, 0)
            except BaseException as e:  # noqa: BLE001 - it belongs to the load's future
                stop = not isinstance(e, Exception)  # an interrupt (the read was never queued): the caller's too
                # One in a queued prefetch drain() started (``own`` False) is the caller's alone: that prefetch's
                # future resolves and its record stays on NVMe, read when it is used (as cancel_starved drops one).
                self._load_done(rec, e, drain=not stop, tell=own or not stop)  # no read started on its way out
                if stop:
                    raise
                return
            iof.add_done_callback(lambda f: self.state.submit(self._load_done, rec, f.exception()))

    def _load_done(self, rec: Record, exc: BaseException | None, *, drain: bool = True, tell: bool = True) -> None:
        """Mover thread: verify the checksum, then publish the buffer (or free it on error, then ``drain``); the
        future carries the error unless ``tell`` is False."""
        s = self.state
        exc = self._load_outcome(rec, exc)
        with s.lock:
            self.loading -= 1
            if exc is None:
                rec.dirty = False
                s.nvme["bytes_read"] += rec.nbytes
                s.nvme["reads"] += 1
            else:
                rec.buf.release()  # type: ignore[union-attr] # under the lock (``coming``)
                rec.buf = None
            fut = rec.end()
            s.evictable_now(rec)  # loaded and not yet pinned
        try:
            if exc is not None and drain:
                self.drain()
        finally:  # as in _write_done
            resolve_future(fut, exc if tell else None)

    def drain(self) -> None:
        """Start queued prefetches, head first, while the pool has room for them. A Ctrl-C comes after it (one
        stopping it would leave queued prefetches for which room is free waiting for the next), except in the one
        wait it may meet, for I/O queue room, which a stalled disk can make last for ever (``_start_load``): it
        stops there, the prefetch whose read waited dropped (its future resolves; read when used), not failed."""
        with deferred_sigint(lands=waiting_for_room):
            self._drain()

    def _drain(self) -> None:
        s, held = self.state, None  # held: an interrupt from a block's making, raised once the queue had its turn
        while True:
            with s.lock:
                if s.closed or not self.queue:
                    break
                rec = self.queue[0]
                self.taking += rec.footprint  # the buffer leaves the pool before rec leaves the queue
            try:
                buf = s.pool.try_acquire(max(rec.nbytes, 1))
            except BaseException as e:  # noqa: BLE001 - no block (ENOMEM, a bad $TIERED_HUGE_PAGES): rec's alone
                with s.lock:
                    self.taking -= rec.footprint
                    failed = self.cancel_queued(rec)  # None if a blocking call took it over meanwhile
                resolve_future(failed, e if isinstance(e, Exception) else None)  # an interrupt drops it, as in pread
                held = held or (None if isinstance(e, Exception) else e)
                continue  # the next queued record tries its own buffer: none is left waiting on this failure
            with s.lock:
                self.taking -= rec.footprint
                ok = buf is not None and bool(self.queue) and self.queue[0] is rec and rec.kind is Move.QUEUED
                if ok:
                    self._unqueue(rec)
                    rec.advance(Move.ACQUIRING)
                elif buf is not None:
                    buf.release()  # under the lock (``coming``): a blocking call took the read over meanwhile
            if buf is None:
                self.cancel_starved()
                break
            if ok:
                self._start_load(rec, self._took(buf), own=False)
        if held is not None:
            raise held

    def _unqueue(self, rec: Record) -> None:  # lock held
        self.queue.remove(rec)
        self.queued -= rec.footprint

    def cancel_queued(self, rec: Record) -> Future[None] | None:
        """Lock held: drop ``rec``'s queued prefetch; the caller resolves the returned future (unlocked)."""
        if rec.kind is not Move.QUEUED:
            return None
        self._unqueue(rec)
        return rec.end()
