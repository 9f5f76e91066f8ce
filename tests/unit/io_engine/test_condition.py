"""io_engine.condition.Condition: a wait ends with its lock held, however it ends (a Ctrl-C's KeyboardInterrupt too).

A wait on a threading.Condition over a Lock let a Ctrl-C out of its re-take of the lock, the lock not taken: the
caller's ``with`` then released the lock another thread held. Every condition of io_engine and tiered is now a
``Condition``, on an RLock, whose re-take a Ctrl-C cannot interrupt.
"""

from __future__ import annotations

import ast
import linecache
import signal
import sys
import threading
from pathlib import Path

import pytest
from helpers import REPO, TIMEOUT, run_bounded, wait_until

from io_engine.condition import Condition

SETTLE_S = 1.0  # how long a thread waits for the other to get into position (behaviour, not timing, is checked)


def retaking(ident: int) -> bool:
    """Thread ``ident`` is in a Condition.wait's re-take of its lock (woken, the lock not yet its own)."""
    f = sys._current_frames().get(ident)
    while f is not None and f.f_code is not threading.Condition.wait.__code__:
        f = f.f_back
    return f is not None and "_acquire_restore" in linecache.getline(f.f_code.co_filename, f.f_lineno)


def test_a_ctrl_c_as_a_wait_retakes_its_lock_from_another_thread_raises_once_the_lock_is_back():
    cond = Condition()
    main, done, seen = threading.get_ident(), threading.Event(), {}

    def notify_and_hold() -> None:  # wakes the wait, and holds the lock a moment longer, as any caller may
        try:
            assert wait_until(lambda: cond._waiters), "the wait never began"
            with cond:
                cond.notify_all()
                wait_until(lambda: retaking(main), SETTLE_S)
                signal.pthread_kill(main, signal.SIGINT)
                done.wait(SETTLE_S)  # the waiter, had the press let it go on without the lock
                seen["still_mine"] = cond._is_owned()
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            seen["error"] = repr(e)

    holder = threading.Thread(target=notify_and_hold)
    holder.start()
    try:
        with pytest.raises(KeyboardInterrupt), cond:
            try:
                cond.wait(TIMEOUT)
            finally:
                seen["owned"] = cond._is_owned()
    finally:
        done.set()
        holder.join(TIMEOUT)
    assert not holder.is_alive() and seen == {"still_mine": True, "owned": True}, seen
    assert run_bounded(lambda: cond.acquire(timeout=TIMEOUT))  # given back by the waiter's ``with``


class LetGoThenPressed:
    """An RLock whose wait lets it go and then raises KeyboardInterrupt: a Ctrl-C's handler running just after the
    wait let the lock go, before the try whose finally takes it back."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.acquire, self.release = self.lock.acquire, self.lock.release
        self._is_owned, self._acquire_restore = self.lock._is_owned, self.lock._acquire_restore
        if hasattr(self.lock, "_recursion_count"):
            self._recursion_count = self.lock._recursion_count

    def __enter__(self) -> bool:
        return self.lock.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.lock.__exit__(*exc)

    def _release_save(self) -> object:
        self.lock._release_save()
        raise KeyboardInterrupt


@pytest.mark.parametrize("wait", ["wait", "wait_for"])
def test_a_ctrl_c_just_as_a_wait_lets_its_lock_go_leaves_the_wait_with_the_lock(wait):
    lock = LetGoThenPressed()
    cond, seen = Condition(lock), {}
    with pytest.raises(KeyboardInterrupt), cond:  # a threading.Condition's with: "cannot release un-acquired lock"
        try:
            cond.wait(TIMEOUT) if wait == "wait" else cond.wait_for(lambda: False, TIMEOUT)
        finally:
            seen["owned"] = lock._is_owned()
    assert seen == {"owned": True}
    assert run_bounded(lambda: lock.acquire(timeout=TIMEOUT))  # given back by the ``with``


def test_a_condition_refuses_a_lock_whose_retake_a_ctrl_c_interrupts():
    with pytest.raises(TypeError, match="RLock"):
        Condition(threading.Lock())
    Condition(threading.RLock())


def test_every_condition_of_the_packages_is_a_condition_of_io_engine():
    """A threading.Condition made anywhere in io_engine or tiered (a Lock's or an RLock's) is one whose wait a
    Ctrl-C can leave without its lock."""
    made = []
    for pkg in ("io_engine", "tiered"):
        for path in sorted((Path(REPO) / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                f = node.func if isinstance(node, ast.Call) else None
                if isinstance(f, ast.Attribute) and f.attr == "Condition" and getattr(f.value, "id", "") == "threading":
                    made.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert made == [], "threading.Condition made in: " + ", ".join(made)
