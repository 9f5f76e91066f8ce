"""``TieredStore.put``'s body: a new record in, and the one it replaces out only once the new one is in.

A put that fails must lose nothing a user had saved (design.md, "Errors"). Its arguments are checked before this
runs (``TieredStore.put``); what can still fail is the placing: a full disk under an NVMe write, a host or HBM
budget that cannot make room. So the old record of the key is taken out of service (``detach``: held in
``Move.MOVE``, out of ``recs``) but kept, with its file: the new record writes the key's other file name (index.py
``replacement_path``). Once the new record is placed the old one is discarded (``discard``: memory, then its
file); if placing fails, or anything stops it once the new record is installed (a Ctrl-C let through in a wait),
the new record is dropped and the old one is put back (``undo``), while the new record is still in its move: a call
on the key that found it waits for that move, then finds the old record (a pin or get of the new one pins the
old: ``GpuTier.materialize``; a ``fetch`` or ``prefetch`` of it raises KeyError "deleted (or replaced) while this call
waited", the old record in place). An undo that ended the move first let another thread pin the new record, empty, in
between: the undo then refused it ("pinned"), the old record stayed aside for ever and the key read nothing.

An explicit NVMe put returns once written, so its record is written in its move (``write_placed``), from its buffer,
in the put's thread: no other call reads the value before the put has saved it, and a failed write is undone as any
failed placing. Written as a write-back once the record was placed, a failure left readers the value the put then
took back, the new record dropped and the old one put back in two lock holds (a call on the key between them raised
KeyError: absent), and a record another thread had pinned meanwhile kept in place of the saved one, dirty.

File names. A key alternates between its two file names, so the old record's name is the one the put after next
takes: a record set aside is listed in ``StoreState.aside`` by its file until its file is unlinked (or it is put
back), and ``detach`` gives no new record a name listed there; it waits for that record instead. Otherwise a put
that overtook this one (once the new record is idle) would write that name, and this put's unlink would take its
file: the last value put, lost, its index entry naming a missing file.

Memory. The old record's buffer or HBM tensor is freed at once, as a put always did, so a replace needs no more
room than the record: a clean record's file holds its bytes anyway. Only a dirty one (changes never written)
replaced by an explicit ``tier="nvme"`` put keeps its memory until that write lands, since such a put needs no
room to wait for. Other puts over a dirty record, if they fail, bring back its file's bytes, the last saved, and
none when it was never written.

Ctrl-C. A put runs with it held (``deferred_sigint``), from before its record's move begins until its undo or the
old record's discard has ended, and raises it then: a put pressed part-way completes, or (pressed in a wait, or
failing) leaves the old record in place. One landing where a record's move ends, or on the way from the placing to
the undo or the discard, left the new record in ``Move.MOVE`` (the put's own undo waited for it), its move's future
unresolved, or the old record aside: every later call on the key waited for ever. Only its waits let a press
through at once, as if nothing held it, since they can last for ever: for another call of the key (``detach``), for
host room or I/O queue room (host_tier.in_room_wait), for a record's direct write to the disk
(sync_io.waiting_for_write); nothing of the put is committed there that its undo cannot take back. An explicit
NVMe put's wait for its record's write from its buffer lets one through too, but the put then completes (the old
record discarded) and raises: the write, under way, becomes the record's write-back (``HostTier.adopt_write``), its
move ends, and it lands in the background as a put's without a tier does (an undo would wait for that write, on a
disk that may never answer, before its buffer could go back).
"""

from __future__ import annotations

import contextlib
import os
from concurrent import futures
from typing import Any

import torch

from ..interrupts import deferred_sigint, flagged
from .host_tier import in_room_wait
from .index import record_path, replacement_path
from .record_state import Move
from .records import Record, Tier
from .state import StoreState
from .sync_io import waiting_for_write

__all__ = ["put_record"]


def put_record(st: StoreState, gpu: Any, host: Any, rec: Record, tensor: torch.Tensor, tier: Tier | None,
               zeros: bool) -> None:  # fmt: skip
    """Install ``rec`` (new, checked) holding ``tensor`` in ``tier`` (None: as the policy says), replacing the
    record of its key only once it is placed; on failure the old record stays (see the module docstring)."""
    waiting = [False]
    # Held throughout, but for the waits (the module docstring): raised once the put or its undo has ended.
    with deferred_sigint(lands=lambda: waiting[0] or in_room_wait() or waiting_for_write()):
        _put(st, gpu, host, rec, tensor, tier, zeros, waiting)


def _put(st: StoreState, gpu: Any, host: Any, rec: Record, tensor: torch.Tensor, tier: Tier | None, zeros: bool,
         waiting: list[bool]) -> None:  # fmt: skip
    key, explicit = rec.key, tier is not None
    rec.begin(Move.MOVE)  # nobody touches it while it is copied in
    old: Record | None = None
    pressed: BaseException | None = None  # a Ctrl-C in the wait for its write: the put completes, then raises it
    try:  # whatever stops the put here (a press let through in a wait, an error) puts ``old`` back
        old, freed = detach(st, gpu, host, rec, keep_memory=tier == "nvme", waiting=waiting)
        if freed:  # the old record's buffer is back in the pool: queued prefetches may start
            host.drain()
        with st.lock:
            if tier is None and gpu.has_room(rec.nbytes):
                tier = "gpu"
            # A record in HBM takes no host memory, so it takes no room in the policy's resident set (the scan
            # policy would otherwise stream to NVMe chunks that fit host_budget beside it).
            st.policy.insert(key, 0 if tier == "gpu" else rec.footprint)
            if tier is None:
                tier = st.policy.placement(key) if rec.footprint <= st.host_budget else "nvme"
        gpu.copy_in(rec, tensor, tier, zeros=zeros)
        if explicit and tier == "nvme" and rec.buf is not None:  # returns once written: written in its move
            pressed = write_placed(st, host, rec, waiting)
    except BaseException:
        undo(st, gpu, rec, old)  # ``rec`` still in its move: no other call has used it
        raise
    if pressed is None:
        st.finish(rec)
        if not explicit and tier == "nvme" and rec.buf is not None:
            host.demote(rec)  # streamed: frees its buffer once written, in the background
    discard(st, gpu, host, old)
    if pressed is not None:
        raise pressed


def write_placed(st: StoreState, host: Any, rec: Record, waiting: list[bool]) -> BaseException | None:
    """An explicit NVMe put's record ``rec``, in its move, written from its buffer in this thread, which then goes
    back to the pool (unless a call waiting for the move wants it). A failed write raises, for the put's undo. A
    Ctrl-C in the wait for it, let through (the module docstring), is returned: the write, under way, becomes the
    record's write-back (``HostTier.adopt_write``), its move ends, and the put completes.

    Until then the buffer is room on its way, as a releasing write-back's: counted in ``HostTier.releasing``
    (``rec.releasing`` says so), else a prefetch or a put needing room meanwhile would evict a chunk read ahead, or
    give up, rather than wait for it (host_tier.py, ``coming``). The count goes in the hold that frees or keeps the
    buffer: here once written, in ``undo`` after a failed write; ``adopt_write`` takes it over."""
    with st.lock:
        version = rec.version
        st.nvme["write_started_bytes"] += rec.nbytes
        rec.releasing, host.releasing = True, host.releasing + rec.footprint
    data = rec.buf.tensor[: rec.nbytes]  # type: ignore[union-attr]
    iof = st.io.pwrite(data, rec.path, 0)
    try:
        crc = st.crc.compute(data)  # while the disk writes: both only read the buffer
    except BaseException:
        futures.wait([iof])  # the undo gives the buffer back: only once the write is off it
        raise
    try:
        with flagged(waiting):  # a disk may stall for ever: a press goes through
            iof.result()
    except BaseException as e:
        if iof.done() and iof.exception() is e:  # the write's own error: the put is undone
            raise
        host.adopt_write(rec, iof, version, crc)
        return e
    with st.lock:
        rec.on_disk, rec.checksum, rec.error = True, crc, None
        rec.dirty = rec.version != version
        st.nvme["bytes_written"] += rec.nbytes
        st.nvme["writes"] += 1
        rec.releasing, host.releasing = False, host.releasing - rec.footprint
        if not (rec.pins or rec.dirty):  # else a call waiting for the move wants it in memory: it stays, evictable
            free, rec.buf = rec.buf, None
            free.release()  # type: ignore[union-attr] # back to the pool under the lock (host_tier.py)
            st.evictions += 1
    host.drain()  # the room freed starts queued prefetches; kept, it drops those that counted on it (cancel_starved)
    return None


def detach(
    st: StoreState, gpu: Any, host: Any, rec: Record, *, keep_memory: bool, waiting: list[bool]
) -> tuple[Record | None, bool]:
    """Install ``rec`` in place of its key's record, once that one is idle and unpinned and no record set aside
    holds the file name ``rec`` takes (its unlink would take ``rec``'s file); returns the old record, held
    (``Move.MOVE``), out of ``recs`` and in ``st.aside``, its file untouched (None: there was none), and whether
    its host buffer went back to the pool (the caller then drains the prefetch queue, where a failure puts the old
    record back). Its memory is freed, unless ``keep_memory`` and it holds changes its file does not (see the
    module docstring). ``waiting[0]`` is True while it waits for another call, with nothing taken aside."""
    key = rec.key
    while True:
        freed, cancelled, busy = False, None, None  # busy: the move to wait for before looking again
        with st.lock:
            cur = st.recs.get(key)
            path = record_path(st.path, key) if cur is None else replacement_path(st.path, key, cur.path)
            held = st.aside.get(path)
            if held is not None:  # an earlier put has yet to unlink that file (or put its record back): wait
                assert held.op is not None, "a record set aside stays in Move.MOVE until it is discarded"
                busy = held.op
            elif cur is None:
                rec.path, st.recs[key] = path, rec
                return None, False
            elif cur.pins > cur.reading:
                raise ValueError(f"record {key!r} is pinned: delete or replace it after its pin block")
            elif cur.pins:  # get()'s copies end by themselves: wait for them, then look again
                with flagged(waiting):
                    st.unpinned.wait()
                continue
            else:
                cancelled, busy = host.cancel_queued(cur), cur.op
            if busy is None and cur is not None:  # cur is idle: take it aside
                cur.begin(Move.MOVE)
                del st.recs[key]
                st.aside[cur.path] = cur
                st.policy.remove(key)
                if not (keep_memory and (cur.dirty or not cur.on_disk)):
                    freed, free, cur.buf = cur.buf is not None, cur.buf, None
                    if free is not None:  # back to the pool under the lock: room never looks short (host_tier.py)
                        free.release()
                    gpu.forget(cur)
                rec.path, st.recs[key] = path, rec
        if cancelled is not None:
            cancelled.set_result(None)
        if busy is None:
            return cur, freed
        with flagged(waiting):
            st.wait(busy, swallow=True)


def undo(st: StoreState, gpu: Any, rec: Record, old: Record | None) -> None:
    """A put failed before its new record ``rec`` was placed: drop ``rec`` (and its file) and put the old one back
    (as it was, or as its file holds it: ``_put_back``), all while ``rec`` is still in its move. A call on the key
    that found ``rec`` waits for that move, so none has used it, and then finds the old record (a pin of ``rec``
    pins that one: materialize)."""
    key = rec.key
    try:
        with st.lock:
            mine = st.recs.get(key) is rec  # else detach never installed it: the key's file is another's
        if mine:  # ``rec`` in its move holds off every other put of the key, so nobody writes this name meanwhile
            with contextlib.suppress(OSError):  # a file left is overwritten by the key's next put
                os.unlink(rec.path)
        with st.lock:
            if mine:
                del st.recs[key]
                st.policy.remove(key)
                if rec.releasing:  # its failed write counted the buffer as room on its way (write_placed): it comes
                    rec.releasing, gpu.host.releasing = False, gpu.host.releasing - rec.footprint
                rec.deleted, free, rec.buf = True, rec.buf, None
                if free is not None:  # back to the pool under the lock: room never looks short (host_tier.py)
                    free.release()
                gpu.forget(rec)
            back = _put_back(st, old)
        if back:
            st.finish(old)  # type: ignore[arg-type]
        elif old is not None:
            discard(st, gpu, gpu.host, old)
    finally:
        st.finish(rec)
    gpu.host.drain()


def _put_back(st: StoreState, old: Record | None) -> bool:  # lock held
    """Put ``old`` (set aside) back in ``recs``, as it was or as its file holds it, unless nothing of it is left."""
    if old is None or not (old.on_disk or old.buf is not None or old.gpu is not None):
        return False
    old.dirty = old.dirty and (old.buf is not None or old.gpu is not None)  # else: its file's bytes
    del st.aside[old.path]
    st.recs[old.key] = old
    st.policy.insert(old.key, 0 if old.gpu is not None else old.footprint)
    return True


def discard(st: StoreState, gpu: Any, host: Any, old: Record | None) -> None:
    """The put that replaced ``old`` (held, out of ``recs``) is done: free its memory, then remove its file."""
    if old is None:
        return
    free = None
    # Whatever stops it (an error; a Ctrl-C is held by the put), ``old`` leaves ``aside`` and its move ends: a put of
    # the key waits for exactly that, and would wait for ever.
    try:
        with st.lock:
            old.deleted, free, old.buf = True, old.buf, None
            if free is not None:  # back to the pool under the lock: room never looks short (host_tier.py)
                free.release()
            gpu.forget(old)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(old.path)
    finally:
        with st.lock:  # the file is gone (or left, the put failing): a put of the key may use its name again
            st.aside.pop(old.path, None)
        st.finish(old)
    if free is not None:
        host.drain()
