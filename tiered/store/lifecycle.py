"""Closing a TieredStore while other threads may still hold its memory: wait for them, then release.

A pin block's tensor and a get()'s copy read the store's pinned host buffers in place. Releasing the pool unmaps
those buffers, so a thread still inside a pin block (or a get() copying out) would touch unmapped memory: a
SIGSEGV, the whole process gone. It happens most easily at exit: ``close_at_exit`` closes a store when the main
thread ends (after the non-daemon threads have ended), while a daemon thread may be inside a pin block.

So ``close()`` first stops new calls (``StoreState.closing``: they raise "closed"), then waits for every pin and
get() copy in flight to end (``wait_for_pins``), for at most ``CLOSE_WAIT_S``. Past that it gives up and raises
``TimeoutError`` naming the records, and the store stays open, its memory mapped: a close that cannot finish
safely is refused, never done under a user. A close from inside the caller's own pin block could never finish,
so it is refused at once (``ValueError``). Only then does the store flush and ``shutdown`` release the buffers,
the threads and the folder lock.

A Ctrl-C (or a held signal's handler that raises: a SIGTERM's exit) while close() waits ends the wait as a timeout
does: the interrupt propagates and the store is open again (``reopen``), never left "closing" with nothing released
until a second close(); a later close() completes. One that arrives once the wait is over is held until the release
is done: the store is then closed. Another thread's close() waiting meanwhile marks the store closing again as it
wakes, so a reopen by one close() never lets it release under a new pin.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..interrupts import deferred_sigint
from .state import StoreState

__all__ = ["CLOSE_WAIT_S", "close_whole", "wait_for_pins", "reopen", "shutdown"]

CLOSE_WAIT_S = 30.0  # how long close() waits for other threads' pin blocks and get() copies to end


def close_whole(st: StoreState, release: Callable[[], None], write_back: Callable[[], None] | None) -> None:
    """close()'s body: wait for pins, ``write_back`` (None: the changes dropped), then ``release`` everything.

    The release runs whole: stopped part-way (or before it began, by a press pending as the write-back ended) it
    left the threads, buffers and folder lock of a store that reads closed, so a Ctrl-C comes after it. One during
    the wait for pins, or pending as it returns, leaves the store open instead (``reopen``), and is raised."""
    waited = False
    with deferred_sigint(lets_through=True) as sigint:
        try:
            sigint.through = True
            wait_for_pins(st)  # never unmap memory a thread still uses
            waited = True
            if write_back is not None:
                write_back()
        finally:
            sigint.through = False
            if waited:
                release()
            else:
                reopen(st)


def wait_for_pins(st: StoreState, timeout: float | None = None) -> None:
    """Stop new calls on the store, then wait until no pin block or get() copy holds a record.

    Raises ``ValueError`` when the calling thread itself holds a pin (it could never end), and ``TimeoutError``
    when others still hold pins after ``timeout`` (default ``CLOSE_WAIT_S``) seconds; the store is open again then.
    """
    st.check_process()  # a forked child's copy has no threads to flush through: refused, never a hang
    own = getattr(st.mine, "pins", ())
    if own:
        raise ValueError(f"close() was called inside the pin block of record {own[0].key!r}: close the store "
                         "after the block ends")  # fmt: skip
    limit = CLOSE_WAIT_S if timeout is None else timeout
    deadline = time.monotonic() + limit
    with st.lock:
        while True:
            st.closing = True  # again at each wake: another close() that gave up may have reopened the store
            held = [r.key for r in st.recs.values() if r.pins]
            left = deadline - time.monotonic()
            if not held:
                return
            if left <= 0:
                st.closing = False  # refused: the store stays usable, nothing was released
                shown = ", ".join(repr(k) for k in held[:5]) + (" ..." if len(held) > 5 else "")
                raise TimeoutError(f"close() of the TieredStore at {st.path} waited {limit:g} s "
                                   f"for other threads' pin blocks or get() copies of {shown} to end; it does not "
                                   "release memory they use. End those blocks (join the threads), then close() "
                                   "again")  # fmt: skip
            st.unpinned.wait(left)  # notified as a record's last pin ends


def reopen(st: StoreState) -> None:
    """close() stopped before its release (its wait refused, timed out or interrupted): the store takes calls
    again. Not in a forked child, whose close() refused before it changed anything (and whose lock a thread of the
    parent may have held at the fork)."""
    if st.here:
        with st.lock:
            if not st.closed:
                st.closing = False


def shutdown(st: StoreState, host: Any, gpu: Any, flock: Any) -> None:
    """Release everything of a store no thread uses any more: buffers, HBM tensors, threads, the folder lock (None:
    the lock was handed in, and stays its holder's)."""
    with st.lock:
        if st.closed:  # another thread's close() got here first
            return
        st.closed = True
        queued = [host.cancel_queued(r) for r in list(host.queue)]
    for f in queued:
        f.set_result(None)
    st.settle()  # let every move in flight land before the threads and buffers go
    with st.lock:
        for r in st.recs.values():
            if r.buf is not None:
                r.buf.release()
            r.buf = r.gpu = None
        gpu.used = 0
    st.close()
    if flock is not None:
        flock.release()
