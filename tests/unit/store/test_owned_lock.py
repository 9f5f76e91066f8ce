"""OwnedLock (store/owner.py) under a Ctrl-C: the lock of a TieredOptimizer, a TieredCache and an offloaded model.

Python raises a pending signal's exception (a Ctrl-C's ``KeyboardInterrupt``) as a Python function begins and right
after a C function returns: a tracer raises one as each function of the lock's begins, in turn, and a patched C lock
right after its acquire took it. Wherever it comes, the lock is left as it was, never held by the main thread for good
(any other thread's call, a background save or a monitor's stats, then waited for ever).
"""

from __future__ import annotations

import _thread
import sys
import threading

import pytest

from tiered.store import owner
from tiered.store.owner import OwnedLock


class PressAt:
    """A tracer raising ``KeyboardInterrupt`` once, as the ``at``-th function of owner.py begins (where Python raises a
    pending signal's); ``points``: how many began."""

    def __init__(self, at: int) -> None:
        self.at, self.points, self.raised = at, 0, False

    def __call__(self, frame, event, arg):
        if event == "call" and frame.f_code.co_filename == owner.__file__:
            self.points += 1
            if self.points - 1 == self.at:
                self.raised = True
                raise KeyboardInterrupt
        return None

    def __enter__(self) -> PressAt:
        sys.settrace(self)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(None)


def takes(lock: OwnedLock) -> int:
    """How many times the main thread holds the lock (an RLock counts re-entries)."""
    return lock._recursion_count()


def free_for_another_thread(lock: OwnedLock) -> bool:
    got = []

    def take() -> None:
        got.append(lock.acquire(timeout=10))  # bounded: a lock held for good fails the test, never hangs it
        if got[-1]:
            lock.release()

    t = threading.Thread(target=take, daemon=True)
    t.start()
    t.join(timeout=30)
    return got == [True]


def with_block(lock: OwnedLock) -> None:
    with lock:
        pass


def acquire_release(lock: OwnedLock) -> None:  # cache.close's way: a bounded take, released in a finally
    locked = lock.acquire(timeout=10)
    try:
        pass
    finally:
        if locked:
            lock.release()


@pytest.mark.parametrize("nested", [False, True], ids=["outermost", "re-entered"])
@pytest.mark.parametrize("use", [with_block, acquire_release], ids=lambda f: f.__name__)
def test_a_ctrl_c_anywhere_in_the_lock_leaves_it_as_it_was(use, nested):
    # A press at the start of release() or __exit__, before the release, left the lock held by the main thread for
    # good.
    lock = OwnedLock("TieredOptimizer")
    outer = 1 if nested else 0
    if nested:
        lock.acquire()
    at = 0
    while True:
        with PressAt(at) as press:
            try:
                use(lock)
            except KeyboardInterrupt:
                assert press.raised
        assert takes(lock) == outer, f"a press at point {at} of {press.points} left the lock held"
        if not press.raised:
            break  # past the last point
        at += 1
    assert at >= 2  # the points were met: this test is no empty pass
    if nested:
        lock.release()
    assert takes(lock) == 0
    assert free_for_another_thread(lock)


class PressedAsAcquireReturns:
    """owner.py's C lock, whose acquire raises ``KeyboardInterrupt`` once it has taken the lock: Python raises a
    pending Ctrl-C right after a C function returns."""

    release = _thread.RLock.release

    @staticmethod
    def acquire(lock, *args) -> bool:
        assert _thread.RLock.acquire(lock, *args)
        raise KeyboardInterrupt


@pytest.mark.parametrize("nested", [False, True], ids=["outermost", "re-entered"])
@pytest.mark.parametrize("use", [with_block, acquire_release], ids=lambda f: f.__name__)
def test_a_ctrl_c_as_the_acquire_takes_the_lock_gives_the_take_back(monkeypatch, use, nested):
    # The lock taken, the exception raised in acquire before the caller's ``with`` body (or ``try``) began, so no
    # __exit__ (or ``finally``) ran: the lock stayed held by the main thread for good.
    lock = OwnedLock("TieredCache")
    if nested:
        lock.acquire()
    monkeypatch.setattr(owner, "_RLock", PressedAsAcquireReturns)
    with pytest.raises(KeyboardInterrupt):
        use(lock)
    monkeypatch.undo()
    assert takes(lock) == int(nested)
    if nested:
        lock.release()
    assert free_for_another_thread(lock)
