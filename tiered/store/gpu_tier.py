"""The HBM tier of TieredStore: GPU copies of records, counted against ``gpu_budget``.

``GpuTier`` sits on a ``HostTier`` (host_tier.py), which ``TieredStore`` (store.py) hands it along with the
``StoreState`` both share: a record moving down from HBM takes a host buffer, or is written straight to its
file when it is larger than ``host_budget``; one moving up comes from its host buffer or, likewise, straight
from its file. These moves are synchronous (``Move.MOVE``) and run in the caller's thread. Without CUDA the
budget is 0 and none of this runs (tests fake the tier with CPU tensors by setting the store's
``gpu_budget`` and ``_device``, which are this tier's ``budget`` and ``device``).

As the top tier it is also the one place that moves records through either tier: ``pinned`` and
``materialize`` (``pin``'s engine: a pinned record into the tier the caller asked for), ``copy_in`` (``put``'s:
a new record into its tier), ``drop`` (delete's: a record out of every tier and its file) and ``write_dirty``
(``flush``'s: every dirty record written, from HBM or a host buffer). The host
tier never calls up: a blocking load is handed ``down`` for a record it finds in HBM.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from types import TracebackType
from typing import Any

import torch

from io_engine import format_size

from ..interrupts import deferred_sigint, undo_whole
from .host_tier import HostTier, in_room_wait
from .record_state import Move
from .records import BudgetError, Record, Tier
from .state import StoreState

__all__ = ["GpuTier", "PinBlock"]


class GpuTier:
    """HBM records of a ``TieredStore``: moves up and down, the budget, and pinning into a tier."""

    def __init__(self, state: StoreState, host: HostTier, *, budget: int, device: torch.device | None) -> None:
        self.state, self.host = state, host
        self.budget = budget  # 0: no HBM tier
        self.device = device  # where HBM records live
        self.side: torch.cuda.Stream | None = None  # the CUDA side stream for copies, made on first use
        self.used = self.peak = 0  # changed only under state.lock

    # ---------------------------------------------------------------------------------------- pinning
    def materialize(self, rec: Record, tier: Tier | None) -> torch.Tensor | None:
        """Pinned ``rec`` -> its tensor in ``tier`` (None: where it is, else host), moving it there. None: ``rec``
        was a put's new record, dropped by its undo (replace.py) while this waited for its move: pin the key again."""
        s, counted = self.state, False
        while True:
            with s.lock:
                if rec.deleted:  # nothing else removes a pinned record: drop and detach wait for pins, or refuse
                    return None
                target = tier or ("gpu" if rec.gpu is not None else "host")
                if not counted:
                    inbound = rec.in_host or rec.kind in (Move.LOAD, Move.QUEUED)
                    s.count(target, rec, rec.gpu is not None if target == "gpu" else inbound)
                    counted = True
                if rec.idle and target == "gpu" and rec.gpu is not None:
                    return rec.gpu
                if rec.idle and target == "host" and rec.in_host:
                    return rec.view()
                rec.want_in_host()
                busy = rec.op if rec.kind in (Move.WRITE, Move.MOVE) else None
            if busy is not None:
                s.wait(busy, swallow=True)  # someone else's write or move: its owner reports errors
            elif target == "gpu" and rec.gpu is None and (rec.in_host or rec.footprint > s.host_budget):
                self.up(rec)
            else:
                fut, _ = self.host.begin(rec, block=True, gpu_down=self.down)
                if fut is not None:
                    s.wait(fut)  # our read: a corrupt or missing file raises here

    def pinned(self, key: str, tier: Tier | None, *, reading: bool) -> PinBlock:
        """``TieredStore.pin``'s block: ``key`` pinned and materialized in ``tier``; ``reading``: get()'s own
        copy, a pin that a delete, put or evict of the key waits for rather than refuses."""
        return PinBlock(self, key, tier, reading)

    def _unpin(self, rec: Record, reading: bool, mine: list[Record]) -> None:
        """With Ctrl-C held, as the count went up (pinned). ``mine``: the pinning thread's list of its pins, which a
        block closed on another thread (the update under backward pins on a worker, its commit releases on the
        caller's thread) takes ``rec`` out of."""
        st = self.state
        mine.remove(rec)
        # A forked child collecting a pin one of its parent's threads held at the fork: the lock may be held by a
        # thread the child does not have, and the store is the parent's (state.py's check_open).
        if st.here:
            with st.lock:
                st.unpin(rec, reading=reading)

    def drop(self, key: str, *, missing_ok: bool, only: Record | None = None) -> None:
        """Remove ``key`` from every tier, the policy and disk, once no move of it is in flight (delete, and
        put's replace); ``only``: just that record, not one another thread put in its place meanwhile."""
        st = self.state
        while True:
            with st.lock:
                rec = st.recs.get(key)
                if rec is None and missing_ok or only is not None and rec is not only:
                    return
                rec = st.get(key)
                if rec.pins > rec.reading:
                    raise ValueError(f"record {key!r} is pinned: delete or replace it after its pin block")
                if rec.pins:  # get()'s copies end by themselves: wait for them, then look again
                    st.unpinned.wait()
                    continue
                cancelled, busy = self.host.cancel_queued(rec), rec.op
                if busy is None:
                    # Busy while its file goes, still in ``recs``: a put of this key waits for it, so this
                    # unlink never takes the file of the record that replaces it.
                    rec.begin(Move.MOVE)
            if cancelled is not None:
                cancelled.set_result(None)
            if busy is None:
                break
            st.wait(busy, swallow=True)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(rec.path)
        finally:
            with st.lock:
                del st.recs[key]
                st.policy.remove(key)
                rec.deleted, free, rec.buf = True, rec.buf, None
                if free is not None:  # back to the pool under the lock, so room never looks short (host_tier.py)
                    free.release()
                self.forget(rec)
                fut = rec.end()
            fut.set_result(None)  # type: ignore[union-attr]
            if free is not None:
                self.host.drain()

    def copy_in(self, rec: Record, tensor: torch.Tensor, tier: Tier, *, zeros: bool = False) -> None:
        """Fill the new record ``rec`` (in ``Move.MOVE``) from ``tensor``: into HBM for "gpu", else into a host
        buffer when one can be had ("nvme" streams: it evicts no resident), else straight into its file.
        ``zeros`` (``tensor`` is all zero bytes, as put checked) with "nvme": its file allocated, not written."""
        if zeros and tier == "nvme":  # the caller checked that the bytes are zeros
            self.host.write_zeros_now(rec)
            return
        if tier == "gpu":
            rec.gpu = self.allocate(rec)  # from here on the store's _drop gives the reservation back
            self.copy(rec.gpu, tensor)
        elif rec.footprint <= self.state.host_budget:
            # From the pool to the record with Ctrl-C held, but for the wait for room (host_tier.py's docstring)
            with deferred_sigint(lands=in_room_wait):
                try:
                    rec.buf = self.host.acquire(rec, urgent=tier == "host", block=True)
                except BudgetError:
                    if tier == "host":
                        raise
            if rec.buf is not None:
                self.copy(rec.view(), tensor)
        if rec.gpu is None and rec.buf is None:
            self.host.write_now(rec, tensor)
        rec.dirty = rec.gpu is not None or rec.buf is not None

    def write_dirty(self) -> None:
        """Write every dirty record (or one without a file) and wait, until none is left: records in HBM in
        this thread, the others by write-backs that keep their buffers. The first failure is raised once the
        other writes are done; that record stays dirty."""
        s = self.state
        while True:
            waits, gpu, read = [], [], False
            errors: list[BaseException] = []
            # Marking a write begun and handing it to the movers are one step for a Ctrl-C: one landing between them
            # would leave the record in WRITE for ever, and every later flush, close or call on it waiting. It comes
            # through during the HBM records' writes (a disk may stall), and is held again from the ``finally`` on.
            with deferred_sigint(lets_through=True) as sigint:
                try:
                    writes = []
                    with s.lock:
                        for r in s.recs.values():
                            if r.file_reads and r.idle and (r.dirty or not r.on_disk):
                                read = True  # a get() is reading its file (a bounded read): write it once that is done
                            elif r.idle and (r.dirty or not r.on_disk) and r.gpu is not None:
                                r.begin(Move.MOVE)
                                gpu.append(r)
                            elif r.idle and (r.dirty or not r.on_disk) and r.buf is not None:
                                writes.append((r, self.host.write_locked(r, release=False)))
                            if r.kind in (Move.WRITE, Move.MOVE):
                                waits.append(r.op)
                    for r, version in writes:
                        self.host.start_write(r, version)
                    sigint.through = True
                    for r in gpu:
                        try:
                            self.host.write_now(r, r.gpu)  # type: ignore[arg-type]
                        except BaseException as e:  # noqa: BLE001 - raised after the other writes finished
                            errors.append(e)
                finally:  # also on a Ctrl-C: each HBM record's move ends, written or not
                    sigint.through = False
                    for r in gpu:
                        s.finish(r)
            if not waits and not read:
                return
            if not waits:
                time.sleep(0.001)
            for f in waits:
                try:
                    s.wait(f)  # type: ignore[arg-type]
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)
            if errors:
                raise errors[0]

    # -------------------------------------------------------------------------------------- GPU moves
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not (dst.is_cuda or src.is_cuda):
            dst.copy_(src)
            return
        dev = dst.device if dst.is_cuda else src.device
        self.side = self.side or torch.cuda.Stream(device=dev)
        # The side stream first waits for the user's pending kernels on the tensor; we wait for the copy.
        self.side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(self.side):
            dst.copy_(src, non_blocking=True)
        self.side.synchronize()

    def has_room(self, nbytes: int) -> bool:  # lock held
        return bool(self.budget) and self.used + nbytes <= self.budget

    def allocate(self, rec: Record) -> torch.Tensor:
        """An empty HBM tensor for ``rec``, counted against the budget (``reserve``); ``unreserve`` gives
        the bytes back. A CUDA OOM gives them back here."""
        self.reserve(rec)
        try:
            return torch.empty(rec.shape, dtype=rec.dtype, device=self.device)
        except BaseException:
            self.unreserve(rec)
            raise

    def reserve(self, rec: Record) -> None:
        """Count ``rec`` against gpu_budget, moving unpinned GPU records down (policy order) for room."""
        s = self.state
        while True:
            with s.lock:
                if self.used + rec.nbytes <= self.budget:
                    self.used += rec.nbytes
                    self.peak = max(self.peak, self.used)
                    return
                cands = [k for k, r in s.recs.items() if r.gpu is not None and r.idle and not r.pins]
                victims = s.policy.victims(cands, incoming=rec.key, urgent=True)
                if not victims:
                    raise BudgetError(f"gpu_budget {format_size(self.budget)} cannot make room for record "
                                      f"{rec.key!r} ({format_size(rec.nbytes)}): the GPU tier holds only pinned "
                                      "or moving records. Leave pin blocks sooner, or raise gpu_budget")  # fmt: skip
            self.down(s.recs[victims[0]])

    def unreserve(self, rec: Record) -> None:
        with self.state.lock:
            self.used -= rec.nbytes

    def forget(self, rec: Record) -> None:  # lock held
        """Drop ``rec``'s HBM tensor, if any, and its bytes from the budget (delete, close)."""
        self.used -= rec.nbytes if rec.gpu is not None else 0
        rec.gpu = None

    def down(self, rec: Record) -> None:
        """GPU -> host (-> NVMe when the host budget cannot hold it), synchronously."""
        s = self.state
        # Whole, with Ctrl-C held but for the waits for room (host_tier.py's docstring): one landing as the pool
        # handed the buffer over lost it, and one at the move's end left the record in MOVE (its key's calls waiting).
        with deferred_sigint(lands=in_room_wait):
            with s.lock:
                if rec.gpu is None or not rec.idle:
                    return
                rec.begin(Move.MOVE)
            buf = None
            try:
                if rec.footprint <= s.host_budget:
                    buf = self.host.acquire(rec, urgent=True, block=True, protect=frozenset([rec.key]))
                    self.copy(buf.tensor[: rec.nbytes].view(rec.dtype).view(rec.shape), rec.gpu)  # type: ignore[arg-type]
                elif rec.dirty or not rec.on_disk:
                    self.host.write_now(rec, rec.gpu)  # type: ignore[arg-type]
                with s.lock:
                    rec.buf, rec.gpu, self.used = buf, None, self.used - rec.nbytes
            finally:
                if buf is not None and rec.buf is not buf:  # taken, never the record's (the copy failed): give it back
                    with s.lock:  # under the lock: room never looks short (host_tier.py)
                        buf.release()
                s.finish(rec)

    def up(self, rec: Record) -> None:
        """Host (or NVMe, for records the host budget cannot hold) -> GPU, synchronously."""
        s = self.state
        # Whole, as ``down``: a Ctrl-C at the move's end left the record in MOVE, its key's calls waiting for ever.
        with deferred_sigint(lands=in_room_wait):
            with s.lock:
                if rec.gpu is not None or not rec.idle:
                    return
                rec.begin(Move.MOVE)
            reserved = False
            try:
                gpu = self.allocate(rec)
                reserved = True
                if rec.buf is None:
                    staging = torch.empty(rec.nbytes, dtype=torch.uint8)
                    self.host.read_now(rec, staging)
                self.copy(gpu, rec.view() if rec.buf is not None else staging.view(rec.dtype).view(rec.shape))
                with s.lock:
                    rec.gpu, free, rec.buf, reserved = gpu, rec.buf, None, False
                    if free is not None:  # back to the pool under the lock: room never looks short (host_tier.py)
                        free.release()
                if free is not None:
                    self.host.drain()
            finally:
                if reserved:
                    self.unreserve(rec)
                s.finish(rec)


class PinBlock:
    """``GpuTier.pinned``'s context manager. Ctrl-C is held from the count to the release, and let through between
    them (the moves' waits, the block's body): a press pending as the block ends, or one more after the body's
    KeyboardInterrupt, raised before a hold opened in the release was in place, and the record stayed pinned for good
    (every later evict, put or delete of the key refused or waiting, close() timing out). A class, not a
    ``@contextmanager``: Python raises a press pending as a function begins, and contextlib's ``__exit__`` raised it
    before it resumed the generator, whose release then waited for the traceback to be freed (the pin counted in the
    caller's ``except``; when uncaught, through the close at exit, which refused and lost the unflushed puts). This
    ``__exit__`` is the block's ``exit_of``, whose handler holds a press there (interrupts.py)."""

    def __init__(self, gpu: GpuTier, key: str, tier: Tier | None, reading: bool) -> None:
        self.gpu, self.key, self.tier, self.reading = gpu, key, tier, reading
        self.counted: list[Record] = []  # the record, from its count to its release
        self.hold = deferred_sigint(lets_through=True)

    def __enter__(self) -> torch.Tensor:
        gpu, st = self.gpu, self.gpu.state
        # the host tier's acquire (and reserve) read this thread's pins; a release on another thread takes from it
        self.mine: list[Record] = st.mine.__dict__.setdefault("pins", [])
        self.sigint = sigint = self.hold.__enter__()
        sigint.exit_of = weakref.ref(self)  # weakly: a block whose __exit__ is never called is dropped
        # ... and then released: a Ctrl-C inside ExitStack.enter_context after the count, or as the stack's own
        # __exit__ began, calls no __exit__ of the block (the generator it replaced had its finally run at collection).
        # A finalizer, detached by __exit__, not __del__: a press as a __del__ begins is lost, after every block.
        self.dropped = weakref.finalize(self, _release_dropped, gpu, self.hold, self.counted, self.reading, self.mine)
        try:
            while True:
                with st.lock:
                    st.check_open()  # under the lock: a close that began sees this pin and waits (lifecycle.py)
                    found = st.get(self.key)
                    st.policy.access(self.key)
                    found.pins += 1
                    found.reading += self.reading
                    self.counted.append(found)
                self.mine.append(found)
                sigint.through = True
                t = gpu.materialize(found, self.tier)
                sigint.through = False
                if t is not None:
                    break
                gpu._unpin(found, self.reading, self.mine)  # a put's record, taken back: its key's record now
                self.counted.clear()
            sigint.through = True
            return t  # no signal is taken from here to the caller's ``with``, which calls ``__exit__`` on any error
        except BaseException as e:
            sigint.through = False  # first, as in ``__exit__``: no call before it, where a press would be raised
            self.__exit__(type(e), e, e.__traceback__)
            raise

    def __exit__(self, typ: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.sigint.through = False  # first: a press from here on is held, one at this method's start too (exit_of)
        self.dropped.detach()
        rec = self.counted.pop() if self.counted else None
        try:
            if rec is not None:  # a block closed on another thread than its own: held there (undo_whole)
                undo_whole(self.gpu._unpin, rec, self.reading, self.mine)
        except BaseException as e:
            self.hold.__exit__(type(e), e, e.__traceback__)
            raise
        self.hold.__exit__(typ, value, tb)


def _release_dropped(gpu: GpuTier, hold: Any, counted: list[Record], reading: bool, mine: list[Record]) -> None:
    """What a pin block's ``__exit__`` does, for a block dropped without it (``PinBlock.dropped``)."""
    try:
        if counted:
            undo_whole(gpu._unpin, counted.pop(), reading, mine)
    finally:
        hold.__exit__(None, None, None)
