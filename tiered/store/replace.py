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
between: the undo then refused it ("pinned"), the old record stayed aside for ever and the key read nothing. An
explicit NVMe put's write-back fails only once its record is placed: ``restore`` drops it then, unless another
thread has pinned it meanwhile (that thread reads it: it stays, dirty, and the old record goes); between the drop
and the old record put back the key is absent, and a call on it then raises KeyError (open: one lock hold for both,
as ``undo``).

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
(sync_io.waiting_for_write); nothing of the put is committed there that its undo cannot take back. The last, an
explicit NVMe put's wait for its record's write-back, comes once the record is placed: pressed there, the put
completes (the old record discarded) and raises, its write going on in the background as a put's without a tier
does (an undo would wait for that write, on a disk that may never answer).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from ..interrupts import deferred_sigint, flagged
from .host_tier import in_room_wait
from .index import record_path, replacement_path
from .record_state import Move
from .records import Record, Tier, WriteBackError
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
    except BaseException:
        undo(st, gpu, rec, old)  # ``rec`` still in its move: no other call has used it
        raise
    st.finish(rec)
    fut = host.demote(rec) if tier == "nvme" and rec.buf is not None else None  # frees once written
    if explicit and fut is not None:
        try:  # an explicit NVMe put returns once written, so a full disk raises here
            with flagged(waiting):  # a disk may stall for ever: a press goes through (the module docstring)
                fut.result()
        except BaseException as e:
            if not (fut.done() and fut.exception() is e):  # pressed in the wait: the put completes, its write goes on
                discard(st, gpu, host, old)
                raise
            restore(st, gpu, rec, old)
            raise (e.cause if isinstance(e, WriteBackError) else e) from None  # the write's own error says it all
    discard(st, gpu, host, old)


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
    (as ``restore`` does), all while ``rec`` is still in its move. A call on the key that found ``rec`` waits for
    that move, so none has used it, and then finds the old record (a pin of ``rec`` pins that one: materialize)."""
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


def restore(st: StoreState, gpu: Any, rec: Record, old: Record | None) -> None:
    """A put failed once its new record ``rec`` was placed (its write-back): drop ``rec`` (and its file), and put
    the old one back (as it was, or as its file holds it), unless it has nothing left to read back or another put of
    the key came in meanwhile. A ``rec`` another thread pinned once placed stays (its data is what that thread
    reads, dirty): the old record is discarded, as after a put that worked."""
    try:
        gpu.drop(rec.key, missing_ok=True, only=rec)
    except ValueError:  # pinned by another thread's pin block
        discard(st, gpu, gpu.host, old)
        return
    with st.lock:
        back = rec.key not in st.recs and _put_back(st, old)
    if back:
        st.finish(old)  # type: ignore[arg-type]
    else:
        discard(st, gpu, gpu.host, old)


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
