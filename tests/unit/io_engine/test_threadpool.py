"""io_engine.threadpool.ThreadPool: ThreadPoolExecutor's behaviour (results, errors, order, lazily started threads,
shutdown), and what it is for: it keeps working once the interpreter's exit has begun, where concurrent.futures'
pools refuse every task. Waits are on events and futures, bounded by helpers.TIMEOUT, never on a sleep."""

from __future__ import annotations

import gc
import threading
from concurrent.futures import CancelledError

import pytest
from helpers import TESTS_ROOT, TIMEOUT, run_script, wait_until

from io_engine.threadpool import ThreadPool


def test_results_errors_and_map_as_thread_pool_executor():
    with ThreadPool(3, thread_name_prefix="t") as pool:
        assert pool.submit(pow, 2, 10).result(TIMEOUT) == 1024
        assert pool.submit(lambda *, x: x, x=5).result(TIMEOUT) == 5
        with pytest.raises(ZeroDivisionError):
            pool.submit(lambda: 1 / 0).result(TIMEOUT)
        assert list(pool.map(abs, range(-20, 0), timeout=TIMEOUT)) == list(range(20, 0, -1))


def test_one_thread_runs_its_tasks_in_submission_order():
    seen: list[int] = []
    with ThreadPool(1) as pool:
        futs = [pool.submit(seen.append, i) for i in range(200)]
        futs[-1].result(TIMEOUT)
    assert seen == list(range(200))


def test_threads_start_as_work_needs_them_up_to_max_workers_and_are_daemons():
    pool = ThreadPool(2, thread_name_prefix="lazy")
    assert pool._threads == []  # none before the first task
    pool.submit(int).result(TIMEOUT)
    assert len(pool._threads) == 1
    release, started = threading.Event(), threading.Semaphore(0)

    def hold():
        started.release()
        assert release.wait(TIMEOUT)

    futs = [pool.submit(hold) for _ in range(4)]
    assert started.acquire(timeout=TIMEOUT) and started.acquire(timeout=TIMEOUT)  # two run at once
    assert len(pool._threads) == 2 and all(t.daemon and t.name.startswith("lazy_") for t in pool._threads)
    release.set()
    for f in futs:
        f.result(TIMEOUT)
    assert [pool.submit(int, i).result(TIMEOUT) for i in range(50)] == list(range(50))
    assert len(pool._threads) == 2  # never more
    pool.shutdown()
    assert not any(t.is_alive() for t in pool._threads)


@pytest.mark.parametrize("cancel", [False, True])
def test_shutdown_runs_the_queued_tasks_or_cancels_them_and_refuses_new_ones(cancel):
    pool = ThreadPool(1)
    running, gate = threading.Event(), threading.Event()
    first = pool.submit(lambda: running.set() or gate.wait(TIMEOUT))
    queued = [pool.submit(int, i) for i in range(3)]
    assert running.wait(TIMEOUT)  # the others wait in the queue
    pool.shutdown(wait=False, cancel_futures=cancel)
    gate.set()
    pool.shutdown()
    assert first.result(0) is True
    if cancel:
        for f in queued:
            with pytest.raises(CancelledError):
                f.result(0)
    else:
        assert [f.result(0) for f in queued] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(int)


def test_shutdown_from_one_of_its_own_tasks_does_not_wait_on_itself():
    pool = ThreadPool(1)
    assert pool.submit(lambda: pool.shutdown(wait=True)).result(TIMEOUT) is None
    assert wait_until(lambda: not pool._threads[0].is_alive())


def test_a_pool_collected_without_shutdown_ends_its_threads():
    pool = ThreadPool(2)
    pool.submit(int).result(TIMEOUT)
    threads = list(pool._threads)
    del pool
    gc.collect()
    assert wait_until(lambda: not any(t.is_alive() for t in threads))


def test_it_works_in_a_thread_that_outlives_the_main_thread():
    """Once the main thread has ended, concurrent.futures' exit hook stops its pools, and a ThreadPoolExecutor made
    after it refuses every task; Python still waits for the non-daemon threads, which may go on working."""
    code = f"""
import concurrent.futures, sys, threading
sys.path.insert(0, {TESTS_ROOT!r})
from helpers import main_thread_joins, wait_until
from io_engine.threadpool import ThreadPool
def late():
    assert wait_until(main_thread_joins)
    try:
        concurrent.futures.ThreadPoolExecutor(2).submit(int)
    except RuntimeError as e:
        print("ThreadPoolExecutor:", e)
    with ThreadPool(2) as pool:
        print("ThreadPool:", sum(pool.map(abs, range(-100, 0))))
threading.Thread(target=late).start()
"""
    proc = run_script(code, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "ThreadPoolExecutor: cannot schedule new futures after interpreter shutdown",
        "ThreadPool: 5050",
    ], proc.stdout + proc.stderr


def test_where_python_refuses_new_threads_its_error_is_raised_unless_a_thread_runs(monkeypatch):
    """Python 3.12 refuses to start threads once the exit has begun: a pool with no thread says so (its task is
    not left queued for ever); one with a thread queues the task for it."""
    pool = ThreadPool(2)
    real_start = threading.Thread.start

    def refuse(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="can't create new thread"):
        pool.submit(int)
    assert pool._threads == []
    monkeypatch.setattr(threading.Thread, "start", real_start)
    gate = threading.Event()
    first = pool.submit(gate.wait, TIMEOUT)  # keeps the one thread busy: the next task wants a second one
    monkeypatch.setattr(threading.Thread, "start", refuse)
    second = pool.submit(int, 7)
    gate.set()
    assert first.result(TIMEOUT) is True and second.result(TIMEOUT) == 7
    monkeypatch.setattr(threading.Thread, "start", real_start)
    pool.shutdown()
