"""TieredStore's life around its users: a close while other threads still use its memory, a Ctrl-C in the middle
of its bookkeeping, a fork, and a put that fails over a record a user had saved.

The crash and hang scenarios run in a subprocess under a timeout (helpers.run_script): the old store died there
with SIGSEGV, or waited for ever. Each waits on events, never on a sleep, so a loaded machine only slows it.
"""

from __future__ import annotations

import contextlib
import dis
import errno
import functools
import gc
import inspect
import linecache
import os
import signal
import sys
import textwrap
import threading
import time
from concurrent.futures import Future

import pytest
import torch
from helpers import TESTS_ROOT, TIMEOUT, run_bounded, run_script, wait_until

import io_engine.engine
from io_engine import IOConfig, IOEngineError, IOFuture
from tiered.store import TieredStore

CFG = IOConfig(threads=2, block_size="16KiB")

PRELUDE = """
import os, sys, threading, signal, tempfile, torch
sys.path.insert(0, {tests!r})
from helpers import wait_until
from tiered.store import TieredStore
s = TieredStore(os.path.join({tmp!r}, "s"), host_budget="64MiB")
s.put("a", torch.ones(1 << 16))
# close() has begun: the store no longer takes calls (a store without that step: its pool is closed, unmapped)
closing = lambda: s._state.closing if hasattr(s._state, "closing") else s._state.pool._closed
inside = threading.Event()
def pinned_until_closing(then):  # a worker inside a pin block of "a" until close() has begun, then then(tensor)
    with s.pin("a") as t:
        inside.set()
        assert wait_until(closing)
        then(t)
"""


def script(tmp_path, *parts: str) -> str:
    body = "".join(textwrap.dedent(p) for p in parts).replace("{tmp!r}", repr(str(tmp_path)))
    return PRELUDE.format(tests=TESTS_ROOT, tmp=str(tmp_path)) + body


def check(proc, *expected: str) -> None:
    assert proc.returncode == 0, f"rc={proc.returncode} (-11: SIGSEGV)\n{proc.stdout}\n{proc.stderr}"
    for e in expected:
        assert e in proc.stdout, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------- close under a user
def test_close_waits_for_another_threads_pin_block_and_keeps_its_change(tmp_path):
    """close() from one thread while another is inside a pin block unmapped the block's tensor: SIGSEGV."""
    proc = run_script(
        script(
            tmp_path,
            """
        def change(t):
            t.add_(1)  # the close has begun: the memory must still be there
            s.mark_dirty("a")
        th = threading.Thread(target=pinned_until_closing, args=(change,)); th.start(); inside.wait()
        s.close()  # waits for the pin block, then flushes its change
        th.join()
        try:
            s.get("a")
        except RuntimeError as e:
            print("later call:", e)
        with TieredStore(os.path.join({tmp!r}, "s")) as again:
            print("saved", float(again.get("a")[0]))
    """,
        )
    )
    check(proc, "saved 2.0", "is closed")


def test_close_at_exit_waits_for_a_worker_threads_pin_block(tmp_path):
    """The main thread ending while a worker is inside a pin block: the close at exit unmapped it (SIGSEGV). A
    daemon worker: the exit waits for non-daemon threads to end before it closes anything (io_engine.shutdown)."""
    proc = run_script(
        script(
            tmp_path,
            """
        then = lambda t: print("sum", float(t.sum()))
        threading.Thread(target=pinned_until_closing, args=(then,), daemon=True).start()
        inside.wait()
    """,
        )
    )
    check(proc, f"sum {float(1 << 16)}")


def test_close_waits_for_another_threads_get_copy(tmp_path):
    """close() while a get() copied a record out of host memory unmapped it under the copy (SIGSEGV)."""
    proc = run_script(
        script(
            tmp_path,
            """
        real = s._gpu.materialize
        def materialize(*a, **kw):  # get()'s copy holds the record here, then copies it out
            t = real(*a, **kw)
            inside.set()
            assert wait_until(closing)
            return t
        s._gpu.materialize = materialize
        out = {}
        th = threading.Thread(target=lambda: out.setdefault("t", s.get("a"))); th.start(); inside.wait()
        s.close()
        th.join()
        print("copied", float(out["t"].sum()))
    """,
        )
    )
    check(proc, f"copied {float(1 << 16)}")


LATE_STORE = """
import concurrent.futures.thread, os, sys, threading, torch
sys.path.insert(0, {tests!r})
from helpers import main_thread_joins, wait_until
from tiered.store import TieredStore
def late():  # a thread that opens its first store once the main thread has ended and the exit has begun
    global s  # not dropped
    assert wait_until(main_thread_joins)
    print("concurrent.futures shut down:", concurrent.futures.thread._shutdown, flush=True)
    s = TieredStore(os.path.join({tmp!r}, "s"), host_budget="64MiB")
    t = torch.arange(3 << 20, dtype=torch.float32)  # 12 MiB: its checksum runs in segments on the store's threads
    s.put("a", t)
    s.evict("a").result()
    print("read back", torch.equal(s.get("a"), t), flush=True)
{ending}
threading.Thread(target=late).start()  # non-daemon: Python waits for it, as for any thread
"""


def test_a_store_first_used_after_the_main_thread_ended_works(tmp_path):
    """A non-daemon thread that outlives the main thread (which fell off the script) and opens a store only then,
    with nothing of tiered's open before: concurrent.futures had shut its pools down by then ("cannot schedule new
    futures after interpreter shutdown" from the store's checksum and mover pools), as plain torch code works on."""
    code = LATE_STORE.format(tests=TESTS_ROOT, tmp=str(tmp_path), ending="    s.close()")
    proc = run_script(code, timeout=120)
    check(proc, "concurrent.futures shut down: True", "read back True")


def test_a_store_a_thread_opens_after_the_main_thread_ended_is_closed_at_exit(tmp_path):
    """The same store left open: the close at exit had run already (nothing was open then), so it was never
    closed: its index not saved (the record lost to the next store on the folder), its threads frozen at
    finalization."""
    proc = run_script(LATE_STORE.format(tests=TESTS_ROOT, tmp=str(tmp_path), ending=""), timeout=120)
    check(proc, "read back True")
    with TieredStore(tmp_path / "s") as again:
        assert torch.equal(again.get("a"), torch.arange(3 << 20, dtype=torch.float32))


def test_close_inside_ones_own_pin_block_is_refused_and_the_store_stays_usable(tmp_path):
    with TieredStore(tmp_path / "s", io=CFG) as s:
        s.put("a", torch.ones(4))
        with s.pin("a"), pytest.raises(ValueError, match="inside the pin block of record 'a'"):
            s.close()
        assert float(s.get("a").sum()) == 4.0


def test_close_gives_up_on_a_pin_that_never_ends_and_keeps_the_store_open(tmp_path, monkeypatch):
    from tiered.store import lifecycle

    with TieredStore(tmp_path / "s", io=CFG) as s:
        s.put("a", torch.ones(4))
        s._state.recs["a"].pins += 1  # another thread's pin block, as close() sees it
        with pytest.raises(TimeoutError, match="'a'"):
            lifecycle.wait_for_pins(s._state, timeout=0)
        s._state.recs["a"].pins -= 1
        assert float(s.get("a").sum()) == 4.0  # refused, not half closed


# ------------------------------------------------------------------------------------------ Ctrl-C
SIGINT_AT_HANDOVER = """
real, calls = s._host.start_write, []
def start_write(rec, version):  # a Ctrl-C arrives as the second write-back is handed to the movers
    calls.append(rec.key)
    if len(calls) == 2:
        signal.raise_signal(signal.SIGINT)
    real(rec, version)
s._host.start_write = start_write
"""


def test_ctrl_c_inside_flush_leaves_no_write_that_never_starts(tmp_path):
    """A KeyboardInterrupt between marking records' write-backs begun and handing them over left them in WRITE
    for ever: the next flush(), close() and the exit waited for ever."""
    proc = run_script(
        script(
            tmp_path,
            """
        for i in range(6):
            s.put(f"k{i}", torch.full((1024,), float(i)))
    """,
            SIGINT_AT_HANDOVER,
            """
        try:
            s.flush()
        except KeyboardInterrupt:
            print("interrupted")
        s._host.start_write = real
        s.flush()
        s.close()
        with TieredStore(os.path.join({tmp!r}, "s")) as again:
            print("saved", sorted(again.keys()))
    """,
        ),
        timeout=60,
    )
    check(proc, "interrupted", "saved ['a', 'k0', 'k1', 'k2', 'k3', 'k4', 'k5']")


def test_ctrl_c_while_a_put_evicts_leaves_no_write_that_never_starts(tmp_path):
    """The same in eviction: a put that needed room began victims' write-backs, then the Ctrl-C stranded them."""
    proc = run_script(
        script(
            tmp_path,
            """
        s.close()
        s = TieredStore(os.path.join({tmp!r}, "e"), host_budget="64KiB")
        for i in range(4):
            s.put(f"k{i}", torch.full((4096,), float(i)))  # 16 KiB each: the budget is full
    """,
            SIGINT_AT_HANDOVER,
            """
        try:
            s.put("big", torch.zeros(8192), tier="host")  # needs two victims written back
        except KeyboardInterrupt:
            print("interrupted")
        s._host.start_write = real
        s.flush()
        print("values", [float(s.get(f"k{i}")[0]) for i in range(4)])
        s.close()
    """,
        ),
        timeout=60,
    )
    check(proc, "interrupted", "values [0.0, 1.0, 2.0, 3.0]")


SIGINT_AT_ENGINE = """
real_pwrite, writes = s._state.io.pwrite, []
def pwrite(*a, **k):  # a Ctrl-C arrives as the second write is handed to the engine
    writes.append(1)
    if len(writes) == 2:
        signal.raise_signal(signal.SIGINT)
    return real_pwrite(*a, **k)
s._state.io.pwrite = pwrite
"""
# How a put streams its record to NVMe: the patch pressing at the hand-over of its write, its undoing, the put's tier
STREAMS = {
    # placed there by the policy (the scan policy's streamed pages), written back by the movers
    "by_the_policy": (
        SIGINT_AT_HANDOVER + 's._state.policy.placement = lambda key: "nvme"',
        "s._host.start_write = real",
        "",
    ),
    # put(tier="nvme"), which returns once written: its write handed to the engine in the put's thread
    "explicitly": (SIGINT_AT_ENGINE, "s._state.io.pwrite = real_pwrite", ', tier="nvme"'),
}


@pytest.mark.parametrize("how", sorted(STREAMS))
def test_ctrl_c_as_a_put_streams_its_record_to_nvme_leaves_no_write_that_never_starts(tmp_path, how):
    """The same in a put that streams its record to NVMe (the scan policy's streamed pages, a TieredCache's swapped
    tails): the put itself then waited for ever, in its clean-up, for the write the Ctrl-C stranded. (A put holds
    the press until it has placed its record: n1 is in.)"""
    patch, unpatch, tier = STREAMS[how]
    proc = run_script(
        script(
            tmp_path,
            patch,
            f"""
        s.put("n0", torch.full((1024,), 7.0){tier})
        try:
            s.put("n1", torch.full((1024,), 8.0){tier})
        except KeyboardInterrupt:
            print("interrupted", sorted(s.keys()))
        {unpatch}
        s.put("n1", torch.full((1024,), 9.0){tier})
        print("values", [float(s.get(k)[0]) for k in ("n0", "n1")])
        s.close()
    """,
        ),
        timeout=60,
    )
    check(proc, "interrupted ['a', 'n0', 'n1']", "values [7.0, 9.0]")


def test_a_ctrl_c_while_waiting_for_another_calls_move_reaches_the_caller(tmp_path):
    """A call that waits for a move another call owns leaves the move's error to its owner; it swallowed a Ctrl-C
    raised in that wait too, so the call went on (a state_dict() ran to its end) and the user had to press again."""

    class PressedInTheWait(Future):
        def result(self, timeout=None):
            signal.raise_signal(signal.SIGINT)  # Python raises it here, in the main thread's wait
            return super().result(timeout)

    with TieredStore(tmp_path / "s", host_budget="64KiB", io=CFG) as s:
        with pytest.raises(KeyboardInterrupt):
            s._state.wait(PressedInTheWait(), swallow=True)
        failed: Future = Future()
        failed.set_exception(OSError(errno.EIO, "the move's own failure: its owner reports it"))
        s._state.wait(failed, swallow=True)


class PressedInTheWait(threading.Condition):
    """The engine's condition, pressing Ctrl-C once ``armed`` in the main thread's wait for queue room."""

    def __init__(self, armed: threading.Event) -> None:
        super().__init__()
        self.armed = armed

    def wait_for(self, predicate, timeout=None):
        if self.armed.is_set() and threading.current_thread() is threading.main_thread() and not predicate():
            self.armed.clear()
            signal.raise_signal(signal.SIGINT)  # Python runs the handler here, in the wait for queue room
        return super().wait_for(predicate, timeout)


def test_a_ctrl_c_while_a_read_waits_for_io_queue_room_reaches_the_caller(tmp_path, monkeypatch):
    """A record's read is handed to the I/O threads with Ctrl-C held (its buffer must not go back while the read
    may write it). That held one pressed in the engine's wait for queue room too, where nothing is queued yet: on
    a disk that stalls, pin() waited with the press held, for ever if the disk never answered."""
    answered, stall, armed = threading.Event(), threading.Event(), threading.Event()
    real = io_engine.engine.pread_all

    def pread_all(*a, **k):  # the disk does not answer until the test is over (or TIMEOUT: no hang if it fails)
        stall.wait(TIMEOUT)
        answered.set()
        return real(*a, **k)

    s = TieredStore(tmp_path / "s", host_budget="1MiB", io=IOConfig(threads=1, queue_depth=1))
    try:
        s._state.io._idle = PressedInTheWait(armed)  # the engine is idle: nothing waits on the one it replaces
        for k in "abc":
            s.put(k, torch.full((1024,), float(ord(k))), tier="nvme")
        monkeypatch.setattr(io_engine.engine, "pread_all", pread_all)
        s.prefetch(["a", "b"])  # a's read holds the one I/O thread, b's fills the queue
        armed.set()
        with pytest.raises(KeyboardInterrupt):
            with s.pin("c"):
                pass
        assert not armed.is_set() and not answered.is_set()  # raised in the wait, the disk still silent
        stall.set()
        with s.pin("c") as t:
            assert float(t[0]) == ord("c")
    finally:
        stall.set()
        s.close()


def test_close_with_discard_writes_nothing(tmp_path):
    """close(discard=True), for a folder about to be removed (a TieredCache's, an optimizer's): the changes not yet
    written are dropped, not written; the folder keeps what was last saved."""
    with TieredStore(tmp_path / "s", host_budget="64KiB", io=CFG) as s:
        s.put("a", torch.ones(1024))
    s = TieredStore(tmp_path / "s", host_budget="64KiB", io=CFG)
    with s.pin("a") as t:
        t.add_(1)
    s.mark_dirty("a")
    s.put("b", torch.ones(1024))
    s.close(discard=True)
    with TieredStore(tmp_path / "s", io=CFG) as again:
        assert again.keys() == ["a"] and float(again.get("a").sum()) == 1024.0


def test_a_ctrl_c_inside_close_still_releases_the_store(tmp_path, monkeypatch):
    """close() runs once (a second returns at once): a Ctrl-C that stopped its release part-way left the store's
    threads and folder lock behind, for good. It comes once they are released."""
    before = set(threading.enumerate())
    s = TieredStore(tmp_path / "s", host_budget="64KiB", io=CFG)
    s.put("a", torch.ones(1024))
    real = s._state.settle

    def settle():
        signal.raise_signal(signal.SIGINT)
        real()

    monkeypatch.setattr(s._state, "settle", settle)
    with pytest.raises(KeyboardInterrupt):
        s.close()
    assert not [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    with TieredStore(tmp_path / "s", io=CFG) as again:  # the folder lock is free
        assert float(again.get("a").sum()) == 1024.0


CLOSE_PRESSED = """
release = threading.Event()
def pinned():  # a worker inside a pin block of "a" that close() waits for, until the test lets it end
    with s.pin("a") as t:
        inside.set()
        assert release.wait(60)
        t.add_(1)
        s.mark_dirty("a")
th = threading.Thread(target=pinned); th.start(); inside.wait()
"""


@pytest.mark.parametrize("when", ["in-the-wait", "as-the-wait-ends"])
def test_a_ctrl_c_while_close_waits_for_pins_leaves_the_store_open(tmp_path, when):
    """A Ctrl-C while close() waited for another thread's pin block raised out of the wait with the store left
    "closing": every call raised "closed", yet nothing was released until a second close(). Likewise one pending as
    the wait ended, before the release began. The interrupt still propagates, and the store is open as after a
    close() that timed out (its memory is still in use): calls work, and a later close() completes."""
    if when == "in-the-wait":  # from another thread once close() has begun: the main thread waits on the pin
        press = """
        def press():
            assert wait_until(closing)
            os.kill(os.getpid(), signal.SIGINT)
        threading.Thread(target=press).start()
        """
    else:  # pending as the wait returns: Python raises it at the next call, before close() goes on
        press = """
        import tiered.store, tiered.store.lifecycle
        real_wait, where = tiered.store.lifecycle.wait_for_pins, [tiered.store, tiered.store.lifecycle]
        def wait_then_press(st):
            for module in where:  # once
                module.wait_for_pins = real_wait
            release.set()  # the pin block ends, the wait returns, and then the press
            real_wait(st)
            signal.raise_signal(signal.SIGINT)
        for module in where:  # wherever close() looks it up
            module.wait_for_pins = wait_then_press
        """
    proc = run_script(
        script(
            tmp_path,
            CLOSE_PRESSED,
            press,
            """
        try:
            s.close()
            print("close returned")
        except KeyboardInterrupt:
            print("interrupted")
        print("still closing", s._state.closing, "closed", s._state.closed)
        print("reads", float(s.get("a")[0]))
        s.put("b", torch.ones(4))
        release.set()
        th.join()
        s.close()
        print("closed at last", s._state.closed)
        with TieredStore(os.path.join({tmp!r}, "s")) as again:
            print("saved", float(again.get("a")[0]), float(again.get("b").sum()))
    """,
        ),
        timeout=120,
    )
    check(proc, "interrupted", "still closing False closed False", "closed at last True", "saved 2.0 4.0")
    assert "close returned" not in proc.stdout


# -------------------------------------------------------------------------------------------- fork
def test_a_store_used_in_a_forked_child_raises_at_once(tmp_path):
    """A store made before fork() hung for ever in the child: its threads did not survive the fork."""
    proc = run_script(
        script(
            tmp_path,
            """
        s.evict("a").result()
        pid = os.fork()
        if pid == 0:
            try:
                s.get("a")
                os._exit(3)
            except RuntimeError as e:
                print("child:", e, flush=True)
            try:
                s.close()
            except RuntimeError:
                os._exit(0)
            os._exit(4)
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status))
        print("parent still reads", float(s.get("a").sum()))
        s.close()
    """,
        ),
        timeout=60,
    )
    check(proc, "before a fork", "spawn", "child exit 0", f"parent still reads {float(1 << 16)}")


def test_every_call_of_a_forked_childs_store_raises_though_a_thread_held_its_lock_at_the_fork(tmp_path):
    """len(), `in`, keys(), info(), is_resident(), stats() and mark_dirty() took the store's lock before checking
    the process: in a child forked while a store thread (a mover finishing a write-back) held it, they waited for
    ever, as the thread that would release it does not exist there. Every public call now raises at once."""
    proc = run_script(
        script(
            tmp_path,
            """
        held, go = threading.Event(), threading.Event()
        def hold():  # a store thread inside the lock at the fork
            with s._state.lock:
                held.set()
                go.wait()
        holder = threading.Thread(target=hold)
        holder.start()
        held.wait()
        calls = {"put": lambda: s.put("b", torch.ones(4)), "get": lambda: s.get("a"), "fetch": lambda: s.fetch("a"),
                 "prefetch": lambda: s.prefetch(["a"]), "pin": lambda: s.pin("a").__enter__(),
                 "mark_dirty": lambda: s.mark_dirty("a"), "spare": lambda: s.spare(8),
                 "exchange": lambda: s.exchange("a", None), "retire": lambda: s.retire("a"),
                 "evict": lambda: s.evict("a"), "delete": lambda: s.delete("a"), "keys": s.keys,
                 "__contains__": lambda: "a" in s, "__len__": lambda: len(s), "info": lambda: s.info("a"),
                 "is_resident": lambda: s.is_resident("a"), "stats": s.stats, "flush": s.flush, "close": s.close}
        public = {n for n, v in vars(TieredStore).items() if callable(v) and not n.startswith("_")}
        print("untested:", sorted(public - set(calls)) or "none", flush=True)
        pid = os.fork()
        if pid == 0:
            signal.alarm(15)  # a call that blocks is killed by SIGALRM
            for name, call in calls.items():
                try:
                    call()
                    print("child:", name, "returned", flush=True)
                except RuntimeError as e:
                    print("child:", name, "raised", "before a fork" in str(e), flush=True)
            os._exit(0)
        go.set()
        holder.join()
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status))
        print("parent still reads", float(s.get("a").sum()), len(s))
        s.close()
    """,
        ),
        timeout=60,
    )
    check(proc, "untested: none", "child exit 0", f"parent still reads {float(1 << 16)} 1")
    assert proc.stdout.count("raised True") == 19 and "returned" not in proc.stdout, proc.stdout


@pytest.mark.parametrize("child", ["pass", "lock.release()", "del s, lock; import gc; gc.collect()"])
def test_a_forked_child_that_exits_normally_leaves_the_parents_locks_held(tmp_path, child):
    """A child of os.fork() that ended with sys.exit ran the FolderLock finalizers it had copied: flock(LOCK_UN) on
    a descriptor it shares with its parent (an flock belongs to the open file description) dropped the parent's
    locks, so another optimizer under the same root could take the live folder for a dead run's and delete it."""
    proc = run_script(
        script(
            tmp_path,
            """
        from tiered.store.lock import FolderLock, StoreLockedError
        os.makedirs(os.path.join({tmp!r}, "bare"))
        lock = FolderLock(os.path.join({tmp!r}, "bare"))
        s.put("b", torch.full((1 << 16,), 2.0))
        s.flush()
        def probe(folder):
            try:
                FolderLock(folder).release()
                return "taken"
            except StoreLockedError:
                return "held"
        pid = os.fork()
        if pid == 0:
            CHILD
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status))
        print("store lock", probe(s.path), "bare lock", probe(lock.folder))
        print("parent still reads", float(s.get("a").sum() + s.get("b").sum()))
        s.close()
        lock.release()
        print("released", probe(s.path), probe(lock.folder))
    """.replace("CHILD", child),
        ),
        timeout=60,
    )
    check(proc, "child exit 0", "store lock held bare lock held", f"parent still reads {float(3 << 16)}",
          "released taken taken")  # fmt: skip


# ------------------------------------------------------------------------------------ failed replace
def test_a_refused_zeros_put_keeps_the_saved_record(tmp_path):
    with TieredStore(tmp_path / "s", io=CFG) as s:
        s.put("k", torch.ones(1024))
        s.flush()
        with pytest.raises(ValueError, match="not zero"):
            s.put("k", torch.ones(1024), tier="nvme", zeros=True)
        assert float(s.get("k").sum()) == 1024.0
    with TieredStore(tmp_path / "s", io=CFG) as s:
        assert float(s.get("k").sum()) == 1024.0


@pytest.mark.parametrize("dirty", [False, True])
def test_a_put_whose_write_fails_keeps_the_record_it_was_to_replace(tmp_path, dirty):
    """An explicit NVMe put on a full disk unlinked the old record's file first: the saved record was gone."""
    with TieredStore(tmp_path / "s", io=CFG) as s:
        s.put("k", torch.ones(1024))
        s.flush()
        if dirty:  # changed since the flush: the change must survive too
            with s.pin("k") as t:
                t.add_(1)
            s.mark_dirty("k")
        engine, real = s._state.io, s._state.io.pwrite

        def full(buf, path, offset=0, **kw):
            raise IOEngineError(errno.ENOSPC, "write failed: the disk is full", path, offset)

        engine.pwrite = full
        try:
            with pytest.raises(OSError, match="full"):
                s.put("k", torch.zeros(1024), tier="nvme")
        finally:
            engine.pwrite = real
        want = 2048.0 if dirty else 1024.0
        assert "k" in s and float(s.get("k").sum()) == want
    with TieredStore(tmp_path / "s", io=CFG) as s:
        assert float(s.get("k").sum()) == want
        s.put("k", torch.zeros(1024), tier="nvme")  # then a replace that works leaves one file
        assert float(s.get("k").sum()) == 0.0
        assert len(os.listdir(tmp_path / "s" / "records")) == 1


def test_a_ctrl_c_as_a_put_frees_the_old_records_memory_leaves_no_record_stuck(tmp_path, monkeypatch):
    """A put frees the replaced record's host buffer and starts the queued prefetches it makes room for, holding a
    Ctrl-C meanwhile. Raised as that ended, outside the put's undo, it left the key's new record in its move for
    good (every later call on the key waited for ever) and the old one out of the store. The put, which holds a
    press until it has placed its record, completes, then raises it."""
    with TieredStore(tmp_path / "s", host_budget="64KiB", io=CFG) as s:
        s.put("k", torch.ones(1024))
        s.flush()  # saved: a failed put over it brings it back (module docstring of store/replace.py)
        assert s.info("k").tier == "host"
        real = s._host._drain

        def drain():
            monkeypatch.setattr(s._host, "_drain", real)
            signal.raise_signal(signal.SIGINT)  # held by drain, raised as it ends
            real()

        monkeypatch.setattr(s._host, "_drain", drain)
        with pytest.raises(KeyboardInterrupt):
            s.put("k", torch.zeros(1024))
        assert float(run_bounded(lambda: s.get("k")).sum()) == 0.0  # the put happened
        run_bounded(lambda: s.put("k", torch.full((1024,), 2.0)))
        assert float(s.get("k").sum()) == 2048.0


def test_keys_starting_with_a_dot_read_back_after_a_reopen(tmp_path):
    with TieredStore(tmp_path / "s", io=CFG) as s:
        for k in (".x", "..", ".", "w"):
            s.put(k, torch.full((4,), float(len(k))))
    with TieredStore(tmp_path / "s", io=CFG) as s:
        assert sorted(s.keys()) == [".", "..", ".x", "w"]
        assert [float(s.get(k)[0]) for k in (".", "..", ".x")] == [1.0, 2.0, 2.0]


def test_a_killed_runs_unflushed_record_files_are_reclaimed_by_the_next_store(tmp_path):
    # A run SIGKILLed after records were written back (the budget full) but never flushed left their files in
    # records/: the next store listed only the flushed ones and never freed the rest, not at open, flush or close.
    folder = str(tmp_path / "s")
    code = f"""
import os, signal, torch
from tiered.store import TieredStore
s = TieredStore({folder!r}, host_budget="1MiB")
s.put("saved", torch.ones(10)); s.flush()
for i in range(8):
    s.put(f"tmp{{i}}", torch.ones(1 << 16))  # 256 KiB each: written back as the budget fills, never flushed
print("left", len(os.listdir(os.path.join({folder!r}, "records"))), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = run_script(code)
    assert proc.returncode == -9 and int(proc.stdout.split()[-1]) > 1, proc.stdout + proc.stderr
    with TieredStore(folder, host_budget="1MiB") as s:
        assert os.listdir(os.path.join(folder, "records")) == ["saved.bin"]
        assert torch.equal(s.get("saved"), torch.ones(10))


def test_a_ctrl_c_while_drain_starts_another_keys_prefetch_reaches_only_the_caller(tmp_path, monkeypatch):
    """delete() frees host room and starts a queued prefetch of another key, whose read waits for I/O queue room
    on a disk that stalls. A Ctrl-C pressed there was let through and stored in that prefetch's future, which the
    user holds: it raised the interrupt a second time, later. Held for drain()'s whole run instead, it waited as
    long as the disk. It reaches the caller at once, and only the caller: the prefetch is dropped (its future
    resolves, the record read when used)."""
    reading, answered, stall, armed = threading.Event(), threading.Event(), threading.Event(), threading.Event()
    real = io_engine.engine.pread_all

    def pread_all(*a, **k):  # the disk does not answer until the test lets it (or TIMEOUT: no hang if it fails)
        reading.set()
        stall.wait(TIMEOUT)
        answered.set()
        return real(*a, **k)

    s = TieredStore(tmp_path / "s", host_budget="12KiB", io=IOConfig(threads=1, queue_depth=1, direct="off"))
    try:
        s._state.io._idle = PressedInTheWait(armed)  # the engine is idle: nothing waits on the one it replaces
        for k in "ab":
            s.put(k, torch.full((1024,), float(ord(k))), tier="nvme")
        s.put("x", torch.ones(1024))
        s.put("y", torch.ones(1024))
        s.flush()
        s.mark_dirty("x")  # its eviction below is a write, which fills the I/O queue
        monkeypatch.setattr(io_engine.engine, "pread_all", pread_all)
        s.prefetch(["a"])
        assert reading.wait(TIMEOUT)  # a's read holds the one I/O thread
        (fb,) = s.prefetch(["b"])  # x goes to disk, its write queued; no host room left: b waits in the queue
        io, end = s._state.io, time.monotonic() + TIMEOUT
        while io._queued < 1 and time.monotonic() < end:  # a mover thread queues x's write: the I/O queue is full
            time.sleep(0.01)
        assert io._queued == 1
        assert not fb.done()
        armed.set()
        with pytest.raises(KeyboardInterrupt):
            s.delete("y")  # frees y's room: b's read starts here, and waits for queue room
        assert not armed.is_set() and not answered.is_set()  # pressed in the wait, raised with the disk still silent
        stall.set()
        assert fb.result(timeout=TIMEOUT) is None  # b's prefetch dropped, no interrupt in it
        assert "y" not in s.keys()
        with s.pin("b") as t:
            assert float(t[0]) == ord("b")
    finally:
        stall.set()
        s.close()


def pressed_at_hand_over(monkeypatch, pool) -> list[bool]:
    """Press Ctrl-C as the pool hands the main thread its next buffer (its return: the buffer out of the pool, no
    record holding it yet). Returns the arming flag, cleared once pressed."""
    armed = [True]

    def pressing(real):
        def take(*a, **k):
            buf = real(*a, **k)
            if buf is not None and armed[0] and threading.current_thread() is threading.main_thread():
                armed[0] = False
                signal.raise_signal(signal.SIGINT)  # Python raises it here, in the hand-over
            return buf

        return take

    monkeypatch.setattr(pool, "try_acquire", pressing(pool.try_acquire))
    monkeypatch.setattr(pool, "acquire", pressing(pool.acquire))
    return armed


def all_buffers_held_by_records(s: TieredStore) -> None:
    st = s._state
    assert run_bounded(lambda: wait_until(lambda: all(r.op is None for r in list(st.recs.values())))), "a move hangs"
    with st.lock:
        held = sum(r.footprint for r in st.recs.values() if r.buf is not None)
        assert st.pool.in_use == held, f"{st.pool.in_use - held} pool bytes held by no record"


@pytest.mark.parametrize("call", ["put", "pin", "evict_from_gpu"])
def test_a_ctrl_c_as_a_call_gets_its_host_buffer_loses_no_buffer(tmp_path, monkeypatch, call):
    """A call that takes a host buffer (a put waiting for host room as write-backs free it, a pin reading a record
    from NVMe, a record moving down from HBM) lost it to a Ctrl-C landing as the pool handed it over, before a record
    held it: the pool counted it in use for good, so the store's room stayed short by a record (later calls waited
    for room that never came back, or evicted more)."""
    with TieredStore(tmp_path / "s", host_budget="64KiB", io=CFG) as s:
        s.gpu_budget, s._device = 64 * 1024, torch.device("cpu")
        for i in range(4 if call == "put" else 2):  # 16 KiB each, never written: for the put, the budget is full
            s.put(f"k{i}", torch.full((4096,), float(i)), tier="nvme" if call == "pin" else "host")
        if call == "evict_from_gpu":
            s.put("g", torch.full((4096,), 7.0), tier="gpu")
        armed = pressed_at_hand_over(monkeypatch, s._state.pool)
        with pytest.raises(KeyboardInterrupt):
            if call == "put":
                s.put("n", torch.full((4096,), 9.0), tier="host")  # waits for a write-back to free room
            elif call == "pin":
                with s.pin("k1"):
                    pass
            else:
                s.evict("g", "host")
        assert not armed[0]
        monkeypatch.undo()
        all_buffers_held_by_records(s)
        run_bounded(lambda: s.put("n", torch.full((4096,), 8.0), tier="host"))
        all_buffers_held_by_records(s)
        assert float(s.get("n")[0]) == 8.0 and float(s.get("k1")[0]) == 1.0


class PressedInThePoolWait(threading.Condition):
    """The pool's condition, pressing Ctrl-C once ``armed`` in the main thread's wait for a buffer to come back."""

    def __init__(self, armed: threading.Event) -> None:
        super().__init__()
        self.armed = armed

    def wait(self, timeout=None):
        if self.armed.is_set() and threading.current_thread() is threading.main_thread():
            self.armed.clear()
            signal.raise_signal(signal.SIGINT)  # Python runs the handler here, in the wait for room
        return super().wait(timeout)


def test_a_ctrl_c_while_a_put_waits_for_room_others_pins_hold_reaches_it_at_once(tmp_path):
    """The buffer's hand-over holds Ctrl-C; the wait for room before it must not: another thread's pins hold the
    budget, so the put would wait as long as they do (for ever) with the press held. It raises in the wait, the put
    undone (no record, no buffer lost)."""
    inside, done, gone = threading.Event(), threading.Event(), threading.Event()
    armed = threading.Event()
    with TieredStore(tmp_path / "s", host_budget="64KiB", io=CFG) as s:
        for i in range(4):
            s.put(f"k{i}", torch.full((4096,), float(i)))  # 16 KiB each: the budget is full
        s._state.pool._lock = PressedInThePoolWait(armed)  # nothing waits on the one it replaces

        def pin_all():
            with s.pin("k0"), s.pin("k1"), s.pin("k2"), s.pin("k3"):
                inside.set()
                if not done.wait(TIMEOUT):  # no hang if the put stays deaf: the test then fails below
                    gone.set()

        t = threading.Thread(target=pin_all)
        t.start()
        try:
            assert inside.wait(TIMEOUT)
            armed.set()
            with pytest.raises(KeyboardInterrupt):
                s.put("n", torch.full((4096,), 9.0), tier="host")
            assert not armed.is_set() and not gone.is_set()  # raised in the wait, the pins still held
        finally:
            done.set()
            t.join(TIMEOUT)
        all_buffers_held_by_records(s)
        assert "n" not in s and float(s.get("k3")[0]) == 3.0


PRESS_AT = """
s.close()
s = TieredStore(os.path.join({tmp!r}, "w"), host_budget="64KiB")
s.gpu_budget, s._device = 1 << 20, torch.device("cpu")  # a stand-in HBM tier
armed, patched, futures = [True], [], []
def press(obj, name):  # Ctrl-C, once, as the main thread calls obj.name(...) on record "g"
    real = getattr(obj, name)
    def call(*a):
        main = threading.current_thread() is threading.main_thread()
        if armed and main and any(getattr(x, "key", None) == "g" for x in a):
            armed.pop()
            signal.raise_signal(signal.SIGINT)  # Python raises it here, as real(...) is called
        return real(*a)
    patched.append((obj, name, real))
    setattr(obj, name, call)
def note_futures():  # the move's future of each record "g" that finish() ends: resolved, or its waiters hang
    real = s._state.finish
    patched.append((s._state, "finish", real))
    s._state.finish = lambda rec: (futures.extend([rec.op] if rec.key == "g" else []), real(rec))[1]
def accounted():
    assert wait_until(lambda: all(r.op is None for r in list(s._state.recs.values()))), "a move never ended"
    held = sum(r.footprint for r in s._state.recs.values() if r.buf is not None)
    assert s._state.pool.in_use == held, (s._state.pool.in_use, held)
"""

# Each case: (setup, the pressing patch, the interrupted call, the value the key then holds)
WEDGES = {
    "move_down_from_hbm_ends": (
        's.put("g", torch.full((4096,), 7.0), tier="gpu")',
        'press(s._state, "finish")',
        's.evict("g", "host")',
        7.0,
    ),
    "move_up_into_hbm_ends": (
        's.put("g", torch.full((4096,), 7.0), tier="host")',
        'press(s._state, "finish")',
        'with s.pin("g", tier="gpu"): pass',
        7.0,
    ),
    "load_is_handed_over": (
        's.put("g", torch.full((4096,), 7.0), tier="nvme")',
        'press(s._host, "_start_load")',
        'with s.pin("g"): pass',
        7.0,
    ),
}


def run_pressed(tmp_path, setup: str, patch: str, call: str, value: float) -> None:
    body = f"""
{setup}
{patch}
try:
    {call}
except KeyboardInterrupt:
    print("interrupted", not armed)
for obj, name, real in reversed(patched):
    setattr(obj, name, real)
accounted()
print("value", float(s.get("g")[0]), all(f.done() for f in futures))
s.put("g", torch.full((4096,), 8.0))
accounted()
print("then", float(s.get("g")[0]))
s.close()
"""
    proc = run_script(script(tmp_path, PRESS_AT, body), timeout=60)
    check(proc, "interrupted True", f"value {value} True", "then 8.0")


@pytest.mark.parametrize("case", sorted(WEDGES))
def test_a_ctrl_c_at_a_moves_edge_leaves_no_record_stuck(tmp_path, case):
    """A Ctrl-C landing as a record's move ended (down from HBM, up into it: at its ``finish``), or as a load's buffer
    was handed to its read, left the record in its move for good (MOVE, ACQUIRING) and the buffer taken for it lost:
    every later call on the key waited for ever. The move now ends (or the read starts) first, then the press
    raises."""
    run_pressed(tmp_path, *WEDGES[case])


# A put of "g" over its record holding 7.0, pressed at its end; it completes, then the press raises
PUT_OVER = ('s.put("g", torch.full((4096,), 7.0))', 's.put("g", torch.full((4096,), 9.0))', 9.0)
PUT_EDGES = {
    "ends_its_move": 'press(s._state, "finish")',
    "resolves_its_moves_future": 'note_futures(); press(s._state, "evictable_now")',
    "discards_the_old_record": 'import tiered.store.replace as replace; press(replace, "discard")',
}


@pytest.mark.parametrize("where", sorted(PUT_EDGES))
def test_a_ctrl_c_as_a_put_ends_leaves_no_record_stuck(tmp_path, where):
    """A Ctrl-C landing as a put ended its new record's move (at ``finish`` in its ``finally``: the record stayed in
    MOVE and the put's own undo waited for it for ever; inside it: the move's future never resolved, and a call
    waiting on it waited for ever) or as it went on to discard the record it replaced (left aside in MOVE: every
    later put of the key waited for it) wedged the key. The put now completes, then the press raises."""
    setup, call, value = PUT_OVER
    run_pressed(tmp_path, setup, PUT_EDGES[where], call, value)


# ------------------------------------------------------------------------- undone puts, pins and presses
@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
def test_a_put_undone_while_another_thread_pins_its_key_keeps_the_old_record(tmp_path, monkeypatch, failure):
    """A put whose placing failed (a full disk, a Ctrl-C let through in a wait) ended its new record's move before
    its undo dropped it: a pin of the key taken meanwhile, by another thread, made the undo raise ValueError
    ('pinned') in place of the put's own error, the old record stayed set aside (every later put of the key waited
    for ever) and the key held the empty new record. The undo now runs while the new record is still in its move:
    the pin, which waited for that move, then pins the old record and reads it."""
    with TieredStore(tmp_path / "s", host_budget="1MiB", io=CFG) as s:
        s.put("k", torch.ones(1024), tier="nvme")  # saved: the put below must keep it
        st, real_copy, real_begin = s._state, s._gpu.copy_in, s._host.begin
        put_done, loading, got = threading.Event(), threading.Event(), []

        def begin(*a, **k):  # the pin's first load waits for the put to end, so its pin is held during the undo
            if not loading.is_set():
                loading.set()
                put_done.wait(TIMEOUT)
            return real_begin(*a, **k)

        def pin_k():
            with s.pin("k") as t:
                got.append(float(t[0]))

        def copy_in(rec, *a, **k):  # another thread pins the key while the new record is copied in, then it fails
            pinner.start()
            assert wait_until(lambda: rec.pins == 1)
            raise failure

        pinner = threading.Thread(target=pin_k)
        monkeypatch.setattr(s._host, "begin", begin)
        monkeypatch.setattr(s._gpu, "copy_in", copy_in)
        try:
            with pytest.raises(type(failure)):
                s.put("k", torch.full((1024,), 2.0), tier="host")
        finally:
            put_done.set()
            pinner.join(TIMEOUT)
        monkeypatch.setattr(s._gpu, "copy_in", real_copy)
        assert got == [1.0] and not st.aside
        assert float(s.get("k")[0]) == 1.0
        run_bounded(lambda: s.put("k", torch.full((1024,), 3.0)))
        assert float(s.get("k")[0]) == 3.0


PIN_PRESSES = {  # where the press lands (the nth call of a method, once the pin was counted), and the call pressed
    "pin_as_it_counts": ("policy", "access", 1, "pin"),
    "get_as_it_counts": ("policy", "access", 2, "get"),  # the first is get()'s own, before its pin
    "get_from_the_file_as_it_counts": ("state", "count", 1, "get_direct"),
    "pin_as_it_ends": ("state", "unpin", 1, "pin"),
    "get_from_the_file_as_it_ends": ("state", "unpin", 1, "get_direct"),
}


@pytest.mark.parametrize("case", sorted(PIN_PRESSES))
def test_a_ctrl_c_in_a_pins_bookkeeping_leaks_no_pin(tmp_path, monkeypatch, case):
    """A Ctrl-C landing in a pin's or a get's bookkeeping, between its count going up and the try that takes it
    down (or as that try took it down), left the record pinned for good: every later evict, put or delete of the
    key waited for ever. The press is held there, and raises once the count is whole again."""
    owner, name, nth, call = PIN_PRESSES[case]
    with TieredStore(tmp_path / "s", host_budget="64KiB", io=CFG) as s:
        if call == "get_direct":  # larger than the host budget: get() reads its file straight
            s.put("k", torch.ones(32 * 1024), tier="nvme")
        else:
            s.put("k", torch.ones(1024), tier="host")
        obj = s._state.policy if owner == "policy" else s._state
        real, armed, calls = getattr(obj, name), [True], [0]

        def pressing(*a, **k):
            calls[0] += threading.current_thread() is threading.main_thread()
            if armed and calls[0] == nth:
                armed.pop()
                signal.raise_signal(signal.SIGINT)  # Python raises it here, unless held
            return real(*a, **k)

        monkeypatch.setattr(obj, name, pressing)
        with pytest.raises(KeyboardInterrupt):
            if call == "pin":
                with s.pin("k"):
                    pass
            else:
                s.get("k")
        assert not armed
        monkeypatch.undo()
        assert s._state.recs["k"].pins == 0
        run_bounded(lambda: s.evict("k").result(TIMEOUT))
        run_bounded(lambda: s.put("k", torch.full((1024,), 2.0)))
        assert float(s.get("k")[0]) == 2.0


@functools.cache
def first_resume(code) -> int:
    return next(i.offset for i in dis.get_instructions(code) if i.opname == "RESUME")


class PressAtCall:
    """A ``sys.setprofile`` hook: once ``armed``, a real Ctrl-C at the ``k``-th call (Python's or C's) from there, as
    Python takes one that arrived just before: as a Python function begins (raised there, or counted by a block that
    holds it), or as a C function returns (Python looks for signals after it: a lock's ``__exit__`` has let go). A
    generator resumed is no such call: Python takes a signal inside it, where its ``try`` holds, but a hook's exception
    there leaves it without running its ``finally`` (and none comes at a ``throw``), so the press goes to the next
    call. ``left`` stays above 0 where the work ended first (a sweep over ``k`` is then through)."""

    def __init__(self, k: int) -> None:
        self.left, self.armed, self.fired, self.c_call = k, False, False, None

    def __call__(self, frame, event, arg) -> None:
        if not self.armed or self.fired:
            return
        if self.c_call is not None:
            if event in ("c_return", "c_exception") and self.c_call == (id(frame), id(arg)):
                self.press()
            return
        code = frame.f_code
        if event == "call" and code.co_flags & inspect.CO_GENERATOR and frame.f_lasti > first_resume(code):
            return
        if event not in ("call", "c_call"):
            return
        if self.left:
            self.left -= 1
        elif event == "call":
            self.press()
        else:
            self.c_call = (id(frame), id(arg))  # pressed as it returns

    def press(self) -> None:
        sys.setprofile(None)
        self.fired = True
        signal.raise_signal(signal.SIGINT)


def arm_after(monkeypatch, obj, name: str, hook: PressAtCall, body_press: bool) -> None:
    """``hook`` armed as ``obj.name(...)`` returns (the work that the release after it undoes), then (``body_press``)
    a Ctrl-C there too, as if pressed during that work."""
    real = getattr(obj, name)

    def call(*a, **k):
        out = real(*a, **k)
        hook.armed = True
        if body_press:
            signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(obj, name, call)


def disarm_before(monkeypatch, obj, name: str, hook: PressAtCall) -> None:
    real = getattr(obj, name)

    def call(*a, **k):
        hook.armed = False
        return real(*a, **k)

    monkeypatch.setattr(obj, name, call)


@pytest.mark.parametrize("body_press", [False, True], ids=["", "after_a_press_in_the_block"])
@pytest.mark.parametrize("call", ["pin", "get", "get_direct", "flush_from_hbm", "close"])
def test_a_ctrl_c_as_a_release_begins_leaks_nothing(tmp_path, monkeypatch, call, body_press):
    """A release in a ``finally`` (a pin's end, a get's, a flush's end of its HBM records' moves, close()'s shutdown)
    opened its own hold: a press pending as it began (one more after a press in the block, two Ctrl-Cs in a row)
    raised ``KeyboardInterrupt`` before that hold was in place, skipping the release. The pin stayed counted for good
    (evict, put and delete of the key refused or waited for ever, close() timed out), the HBM record stayed in its
    move (every later flush waited for ever), the store half closed. Swept over every call from the block's work's
    end to the release's; the release now runs whole, then the press raises. A press as the block's exit was called
    (before contextlib's ``__exit__`` resumed the pin's generator) left the pin counted while the interrupt lived:
    in the caller's ``except``, a put of the key and close() refused ("pinned"); the counts are checked there."""
    s = None
    for k in range(5000):
        if call == "close" or s is None:
            s = TieredStore(tmp_path / f"s{k}", host_budget="64KiB", io=CFG)
            s.gpu_budget, s._device = 1 << 20, torch.device("cpu")  # a stand-in HBM tier
            if call == "get_direct":  # larger than the host budget: get() reads its file straight
                s.put("k", torch.ones(32 * 1024), tier="nvme")
            elif call != "flush_from_hbm":
                s.put("k", torch.ones(1024), tier="host")
        if call == "flush_from_hbm":
            s.put("k", torch.ones(1024), tier="gpu")  # dirty in HBM: the flush writes it from there
        hook = PressAtCall(k)
        work = {"get": (s._gpu, "materialize"), "get_direct": (s._host, "read_now"),
                "flush_from_hbm": (s._host, "write_now"), "close": (s, "_write_back")}.get(call)  # fmt: skip
        if work is not None:
            arm_after(monkeypatch, *work, hook, body_press)
        if call == "flush_from_hbm":  # the sweep ends with the release: the flush's waits for its writes after it
            disarm_before(monkeypatch, s._state, "wait", hook)
        try:
            sys.setprofile(hook)
            if call == "pin":
                with s.pin("k"):
                    hook.armed = True
                    if body_press:
                        signal.raise_signal(signal.SIGINT)
            elif call == "flush_from_hbm":
                s.flush()
            elif call == "close":
                s.close()
            else:
                s.get("k")
            hook.armed = False  # the test's own calls from here on
        except KeyboardInterrupt:
            hook.armed = False
            assert hook.fired or body_press, "a Ctrl-C nobody pressed"
            if call != "close":  # released as the interrupt reaches the caller, not once its traceback is freed
                rec = s._state.recs["k"]
                assert (rec.pins, rec.reading, rec.file_reads) == (0, 0, 0), f"in the except: pressed at call {k}"
        else:
            assert not (hook.fired or body_press), "the press was lost"
        finally:
            sys.setprofile(None)
            monkeypatch.undo()
        if call == "close":
            assert s._state.closed, f"the store half closed (pressed at call {k})"
            with TieredStore(tmp_path / f"s{k}", io=CFG) as again:  # its folder lock is free
                assert float(again.get("k")[0]) == 1.0
        else:
            rec = s._state.recs["k"]
            assert (rec.pins, rec.reading, rec.file_reads, rec.op) == (0, 0, 0, None), f"pressed at call {k}"
        if hook.left:
            break
    assert k > 10 and hook.left, "the sweep never ran past the release"
    if call != "close":
        run_bounded(lambda: s.evict("k").result(TIMEOUT))
        run_bounded(lambda: s.put("k", torch.full((1024,), 2.0)))
        assert float(s.get("k")[0]) == 2.0
        s.close()


@pytest.mark.parametrize("at", ["_push_cm_exit", "__exit__"], ids=["in_enter_context", "as_the_stack_exits"])
def test_a_pin_whose_exit_a_ctrl_c_skipped_in_an_exit_stack_is_released_when_dropped(tmp_path, at):
    """Pins held in an ExitStack (as the KV cache's loads do with prefetch=0, and users for many keys): a Ctrl-C
    after a pin was counted but before the stack recorded its exit, or as the stack's own ``__exit__`` begins, means
    no ``__exit__`` of the pin is ever called. The pin is released once its block is dropped, so close() completes."""
    s = TieredStore(str(tmp_path / "s"), host_budget="1MiB", io=CFG)
    for k in "abc":
        s.put(k, torch.ones(1024), tier="host")
    s.flush()

    def press(frame, event, arg):
        if event == "call" and frame.f_code.co_name == at and frame.f_code.co_filename.endswith("contextlib.py"):
            sys.setprofile(None)
            signal.raise_signal(signal.SIGINT)

    def pin_all() -> None:
        with contextlib.ExitStack() as stack:
            for k in "abc":
                stack.enter_context(s.pin(k))
            sys.setprofile(press)  # armed last, as the last pin is counted / the stack exits
            if at == "_push_cm_exit":
                stack.enter_context(s.pin("a"))

    try:
        with pytest.raises(KeyboardInterrupt):
            pin_all()
    finally:
        sys.setprofile(None)
    gc.collect()
    assert {k: s._state.recs[k].pins for k in "abc"} == {"a": 0, "b": 0, "c": 0}
    s.put("a", torch.zeros(1024), tier="host")  # refused while "a" stays pinned
    s.close()  # refused while a pin is counted


@pytest.mark.parametrize("call", ["pin", "get"])
def test_an_uncaught_ctrl_c_as_a_pin_block_ends_still_saves_the_store_at_exit(tmp_path, call):
    """A Ctrl-C as a pin block's (or a get's copy's) exit was called, left uncaught: the traceback Python keeps at exit
    (``sys.last_traceback``) kept the pin counted, so the close at exit refused ("inside the pin block") and the
    puts not yet flushed were lost. The pin is released before the interrupt leaves the block."""
    body = "t.add_(0)" if call == "pin" else "pass"
    code = textwrap.dedent(f"""
        import signal, sys, torch
        from tiered.store import TieredStore
        s = TieredStore({str(tmp_path / "s")!r}, host_budget="1MiB")
        s.put("k", torch.ones(1024), tier="host")
        s.flush()
        s.put("new", torch.full((1024,), 7.0), tier="host")  # not flushed: the close at exit writes it
        def press(frame, event, arg):  # a Ctrl-C as the next Python function is called: the block's exit
            if event == "call":
                sys.setprofile(None)
                signal.raise_signal(signal.SIGINT)
        if {call!r} == "pin":
            with s.pin("k") as t:
                sys.setprofile(press)
                {body}
        else:
            real = s._gpu.materialize
            def materialize(*a):
                out = real(*a)
                sys.setprofile(press)  # the next call is the exit, once get() made its copy
                return out
            s._gpu.materialize = materialize
            s.get("k")
        print("the press was lost")
    """)
    proc = run_script(code)
    assert "KeyboardInterrupt" in proc.stderr and "the press was lost" not in proc.stdout, proc.stdout + proc.stderr
    assert "at exit failed" not in proc.stderr, proc.stderr
    with TieredStore(tmp_path / "s", io=CFG) as again:
        assert float(again.get("new")[0]) == 7.0


def test_a_ctrl_c_while_an_nvme_put_waits_for_a_stalled_disk_reaches_it_at_once(tmp_path, monkeypatch):
    """put(tier="nvme") returns once its record is written. It held a Ctrl-C through that wait, so on a disk that
    stalls no press stopped it until the disk answered. A press there raises at once; the put completes (the old
    record is gone), its write goes on and lands as a put's without a tier does."""
    stall, answered, armed = threading.Event(), threading.Event(), [True]
    real_write, real_result = io_engine.engine.pwrite_all, IOFuture.result

    def pwrite_all(*a, **k):  # the disk does not answer until the test lets it (or TIMEOUT: no hang if it fails)
        stall.wait(TIMEOUT)
        answered.set()
        return real_write(*a, **k)

    def result(self, timeout=None):  # the put's wait for its write
        if armed and threading.current_thread() is threading.main_thread():
            armed.pop()
            signal.raise_signal(signal.SIGINT)  # Python raises it here, in the put's wait, unless held
        return real_result(self, timeout)

    s = TieredStore(tmp_path / "s", host_budget="1MiB", io=CFG)
    try:
        s.put("k", torch.ones(1024), tier="nvme")
        monkeypatch.setattr(io_engine.engine, "pwrite_all", pwrite_all)
        monkeypatch.setattr(IOFuture, "result", result)
        with pytest.raises(KeyboardInterrupt):
            s.put("k", torch.full((1024,), 2.0), tier="nvme")
        assert not armed and not answered.is_set()  # raised in the wait, the disk still silent
        # The put's buffer, room on its way, is the write-back's now: counted once, as it was for the put.
        assert s._host.releasing == s._state.recs["k"].footprint
        monkeypatch.setattr(IOFuture, "result", real_result)
        stall.set()
        assert float(run_bounded(lambda: s.get("k"))[0]) == 2.0 and not s._state.aside
        run_bounded(s.flush)
        run_bounded(s._state.settle)
        assert s._host.releasing == 0
        assert len(os.listdir(tmp_path / "s" / "records")) == 1
    finally:
        stall.set()
        s.close()
    with TieredStore(tmp_path / "s", io=CFG) as s:
        assert float(s.get("k")[0]) == 2.0


@pytest.mark.parametrize("pinner", [False, True], ids=["gets", "gets_and_a_pin"])
def test_an_nvme_put_whose_write_fails_never_shows_its_key_absent_nor_its_value(tmp_path, monkeypatch, pinner):
    """put(tier="nvme") returns once written. Its write failing (a full disk), it dropped its new record, then put the
    old one back, in two lock holds: another thread's get of the key between them raised KeyError, a get that had
    waited for the write read the value the put then took back, and a pin taken during the write kept the new
    record (dirty, the saved one discarded). The new record now stays in its move until written, and a failed write
    drops it and puts the old one back in one hold, as any undone put: a get or pin waits for the write, then reads
    the old record; none sees the key absent, nor a value the put did not save."""
    with TieredStore(tmp_path / "s", host_budget="1MiB", io=CFG) as s:
        s.put("k", torch.ones(1024), tier="nvme")  # saved: the failed put must keep it
        st = s._state
        old_path, real_pwrite, real_drain = st.recs["k"].path, st.io.pwrite, s._host.drain
        failed, gap, read_in_gap, done = (threading.Event() for _ in range(4))
        seen, errors, pinned, putter = [], [], [], []

        def gets():  # another thread reading the key all along
            while not done.is_set():
                in_gap = gap.is_set()
                try:
                    seen.append(float(s.get("k")[0]))
                except BaseException as e:  # noqa: BLE001 - checked below
                    errors.append(e)
                if in_gap:
                    read_in_gap.set()

        def pin_k():
            with s.pin("k") as t:
                pinned.append(float(t[0]))

        def pwrite(buffer, path, offset=0, **kw):  # the put's write fails once a get (and the pin) wait on its record
            if os.fspath(path) == old_path or failed.is_set():
                return real_pwrite(buffer, path, offset, **kw)
            new = st.recs["k"]
            assert wait_until(lambda: new.reading >= 1)
            if pinner:
                pin_thread.start()
                assert wait_until(lambda: new.pins > new.reading)
            failed.set()
            return IOFuture.failed(IOEngineError(errno.ENOSPC, "No space left on device (injected)", path, offset))

        def drain():  # the put, its write failed, is done with its records: a get of the key now must find one
            if failed.is_set() and threading.current_thread() in putter and not gap.is_set():
                gap.set()
                read_in_gap.wait(TIMEOUT)
            real_drain()

        def put():
            putter.append(threading.current_thread())
            s.put("k", torch.full((1024,), 2.0), tier="nvme")

        reader, pin_thread = threading.Thread(target=gets), threading.Thread(target=pin_k)
        monkeypatch.setattr(st.io, "pwrite", pwrite)
        monkeypatch.setattr(s._host, "drain", drain)
        reader.start()
        try:
            with pytest.raises(OSError) as ei:
                run_bounded(put)
        finally:
            done.set()
            reader.join(TIMEOUT)
            if pin_thread.ident is not None:
                pin_thread.join(TIMEOUT)
        assert ei.value.errno == errno.ENOSPC
        assert not errors, errors
        assert seen and set(seen) == {1.0}, seen
        assert pinned == ([1.0] if pinner else [])
        assert gap.is_set() and read_in_gap.is_set()
        assert float(s.get("k")[0]) == 1.0 and not s.info("k").dirty and not st.aside
        assert os.listdir(tmp_path / "s" / "records") == [os.path.basename(old_path)]
        assert s._host.releasing == 0  # the failed write's buffer, counted as room on its way, went back with it
        run_bounded(lambda: s.put("k", torch.full((1024,), 3.0), tier="nvme"))
        assert float(s.get("k")[0]) == 3.0


SETTLE_S = 1.0  # how long a thread waits for the other to get into position (behaviour, not timing, is checked)
RETAKERS = {  # a call that waits for a get()'s copy of "k" to end (its own wait on ``unpinned``)
    "put": lambda s: s.put("k", torch.full((256,), 2.0), tier="nvme"),  # replace.detach
    "evict": lambda s: s.evict("k"),
    "delete": lambda s: s.delete("k"),  # GpuTier.drop
    "close": lambda s: s.close(),  # lifecycle.wait_for_pins
}


def retaking(ident: int) -> bool:
    """Thread ``ident`` is in a Condition.wait's re-take of its lock (woken, the lock not yet its own)."""
    f = sys._current_frames().get(ident)
    while f is not None and f.f_code is not threading.Condition.wait.__code__:
        f = f.f_back
    return f is not None and "_acquire_restore" in linecache.getline(f.f_code.co_filename, f.f_lineno)


@pytest.mark.parametrize("call", sorted(RETAKERS))
def test_a_ctrl_c_as_a_call_retakes_the_lock_after_a_gets_copy_leaves_the_lock_to_its_holder(tmp_path, call):
    """A call waiting for another thread's get() copy to end (a put replacing the key, an evict, a delete, a close)
    is woken as the copy ends, then takes the store's lock back while that thread still holds it. A Ctrl-C there
    came out of the lock's acquire, the lock not taken: the call's ``with lock:`` then released the lock the other
    thread held, so two threads ran inside it and the other's own release raised "release unlocked lock". The
    press now raises once the call has the lock back."""
    with TieredStore(tmp_path / "s", host_budget="1MiB", io=CFG) as s:
        s.put("k", torch.ones(256), tier="nvme")
        st, main = s._state, threading.get_ident()
        rec = st.recs["k"]
        with st.lock:  # what get() takes for its copy of a record on NVMe only, read straight from its file
            rec.pins, rec.reading, rec.file_reads = rec.pins + 1, rec.reading + 1, rec.file_reads + 1
        done, seen = threading.Event(), {}

        def copy_ends() -> None:  # the get()'s copy ends under the lock, which its thread holds a moment longer
            try:
                assert wait_until(lambda: st.unpinned._waiters), "the call never waited for the copy"
                with st.lock:
                    rec.file_reads -= 1
                    st.unpin(rec, reading=True)  # wakes the call: it now waits to take the lock back
                    wait_until(lambda: retaking(main), SETTLE_S)
                    signal.pthread_kill(main, signal.SIGINT)
                    done.wait(SETTLE_S)  # the call, had the press let it go on without the lock
            except BaseException as e:  # noqa: BLE001 - reported by the test thread
                seen["error"] = repr(e)

        holder = threading.Thread(target=copy_ends)
        holder.start()
        try:
            RETAKERS[call](s)
        except KeyboardInterrupt:
            seen["pressed"] = True
        finally:
            done.set()
            holder.join(TIMEOUT)
        assert not holder.is_alive() and "error" not in seen, seen
        assert seen.get("pressed"), "the press was lost"
        assert run_bounded(lambda: st.lock.acquire(timeout=TIMEOUT) and st.lock.release() is None)  # free again
        assert rec.pins == 0 and not st.aside
        if call != "close":  # a close stopped by the press refuses new calls (it left ``closing`` set)
            assert float(run_bounded(lambda: s.get("k"))[0]) == 1.0  # nothing was replaced, evicted or deleted
