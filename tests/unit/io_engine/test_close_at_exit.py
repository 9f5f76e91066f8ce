"""io_engine.close_at_exit and the program's other threads: an object left open is closed when the main thread
ends, but only after the non-daemon threads that may still use it have ended, as Python waits for them anyway.

Each case runs a script in a subprocess under a timeout (helpers.run_script): a hang at exit fails the test. The
scripts synchronise on events and on where the main thread waits (helpers.main_thread_joins), never on a sleep.
"""

from __future__ import annotations

import os
import signal

import pytest
from helpers import TESTS_ROOT, run_script

PRELUDE = f"""
import os, signal, sys, threading
sys.path.insert(0, {TESTS_ROOT!r})
from helpers import main_thread_joins, wait_until
from io_engine import close_at_exit

def say(*words):  # one write: lines from two threads never interleave
    os.write(1, (" ".join(words) + "\\n").encode())

class Resource:  # what an optimizer is to close_at_exit: closed at exit, unusable after
    closed = False
    def close(self):
        self.closed = True
        say("closed")

res = Resource()
close_at_exit(res, early=True)
ended = threading.Event()  # the main thread ran its last line
"""

USER = """
def train():  # a training thread: uses res after the main thread has ended, once the exit has begun
    ended.wait()
    assert wait_until(lambda: res.closed or main_thread_joins())
    say("used it", "closed" if res.closed else "open")
threading.Thread(target=train).start()  # non-daemon: Python waits for it at exit
ended.set()
"""


@pytest.mark.parametrize("ending", ["", "signal.raise_signal(signal.SIGINT)"])
def test_a_thread_that_outlives_the_main_thread_uses_the_object_before_it_is_closed(ending):
    """The main thread ending (falling off the script, or by a Ctrl-C) while a non-daemon thread still works: the
    object was closed under that thread, which then found it closed; Python would have waited for it."""
    proc = run_script(PRELUDE + USER + ending + "\n", timeout=60)
    assert proc.stdout.splitlines() == ["used it open", "closed"], proc.stdout + proc.stderr
    if ending:
        assert proc.returncode == -signal.SIGINT and "KeyboardInterrupt" in proc.stderr, proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr


def test_thread_and_process_pools_left_open_do_not_hold_the_exit():
    """Their idle workers (non-daemon threads) end only in their own exit hooks, which run after close_at_exit's:
    waiting for them first would wait for ever."""
    code = (
        "import concurrent.futures.process, multiprocessing\n"  # its exit hook before ours: it runs after ours
        + PRELUDE
        + "from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor\n"
        "threads = ThreadPoolExecutor(2)\n"
        "assert threads.submit(abs, -1).result() == 1\n"
        "procs = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context('fork'))\n"
        "assert procs.submit(abs, -2).result() == 2\n" + USER
    )
    proc = run_script(code, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["used it open", "closed"], proc.stdout + proc.stderr


@pytest.mark.parametrize("first", ["", "signal.raise_signal(signal.SIGINT)"])
def test_a_ctrl_c_while_the_exit_waits_closes_and_ends_the_wait(first):
    """A thread that never ends holds the exit, as without close_at_exit; a Ctrl-C then ends the wait (as it
    ends Python's own) and the object is still closed."""
    code = (
        PRELUDE
        + """
def stuck():
    ended.wait()
    assert wait_until(main_thread_joins)
    say("exit waits")
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    threading.Event().wait()  # never ends by itself
threading.Thread(target=stuck).start()
ended.set()
"""
        + first
        + "\n"
    )
    proc = run_script(code, timeout=60)
    assert "exit waits" in proc.stdout and "closed" in proc.stdout, proc.stdout + proc.stderr
    assert "KeyboardInterrupt" in proc.stderr, proc.stderr


def test_a_ctrl_c_while_the_exit_waits_still_ends_a_process_pool_left_open():
    """The Ctrl-C that ends the wait comes out of our exit hook, and threading runs no hook after one that raises:
    concurrent.futures' (registered before ours, run after it) must still run, or the process pool's workers are
    never told to end and multiprocessing's exit waits for them for ever, long after the thread has ended."""
    code = (
        "import concurrent.futures.process, multiprocessing\n"  # its exit hook before ours: it runs after ours
        + PRELUDE
        + """
from concurrent.futures import ProcessPoolExecutor
procs = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"))
assert procs.submit(abs, -2).result() == 2
def training():
    ended.wait()
    assert wait_until(main_thread_joins)
    say("exit waits")
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # then it ends
threading.Thread(target=training).start()
ended.set()
"""
    )
    proc = run_script(code, timeout=60)
    assert proc.stdout.splitlines() == ["exit waits", "closed"], proc.stdout + proc.stderr
    assert "KeyboardInterrupt" in proc.stderr, proc.stderr


def test_with_nothing_left_open_the_exit_is_pythons_own():
    """A thread that waits for the main thread to end (a watcher) would wait for ever if the exit joined it first;
    with every object closed nothing is waited for, exactly as without close_at_exit."""
    code = (
        PRELUDE
        + """
res.close()
from io_engine.shutdown import forget
forget(res)
def watcher():
    threading.main_thread().join()
    say("main ended")
threading.Thread(target=watcher).start()
"""
    )
    proc = run_script(code, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["closed", "main ended"], proc.stdout + proc.stderr


def test_an_object_a_late_thread_registers_is_closed_too(tmp_path):
    """A thread that outlives the main thread and opens an object then: it is closed once that thread ends."""
    code = (
        PRELUDE
        + f"""
def late():
    global kept  # close_at_exit holds it weakly
    ended.wait()
    assert wait_until(main_thread_joins)
    class Late(Resource):
        def close(self):
            open(os.path.join({str(tmp_path)!r}, "late-closed"), "w").close()
    kept = Late()
    close_at_exit(kept)
    say("registered")
threading.Thread(target=late).start()
ended.set()
"""
    )
    proc = run_script(code, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert os.path.exists(tmp_path / "late-closed"), proc.stdout + proc.stderr


@pytest.mark.parametrize("imported", ["before the main thread ended", "by the late thread"])
def test_an_object_registered_once_the_exit_hook_has_run_is_closed_before_finalization(imported):
    """Nothing registered as the main thread ended: the hook had nothing to wait for nor close. A non-daemon thread
    that outlives the main thread then opens an object (io_engine imported before, or only then, too late to hook
    the end of the main thread): it was never closed, its threads frozen at finalization, its files left."""
    code = f"""
import os, sys, threading
sys.path.insert(0, {TESTS_ROOT!r})
from helpers import main_thread_joins, wait_until
import torch  # first imported after the main thread ended, torch itself fails (concurrent.futures' hook)
{"import io_engine" if imported.startswith("before") else ""}
def say(*words):
    os.write(1, (" ".join(words) + "\\n").encode())
class Late:
    def close(self):
        say("closed")
def late():
    global kept  # close_at_exit holds it weakly
    assert wait_until(main_thread_joins)  # the exit hooks of the main thread's end have run
    from io_engine import close_at_exit
    kept = Late()
    close_at_exit(kept)
    say("registered")
threading.Thread(target=late).start()
"""
    proc = run_script(code, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["registered", "closed"], proc.stdout + proc.stderr
