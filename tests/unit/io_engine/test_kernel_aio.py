"""IOConfig(submit="aio"): kernel AIO from one thread, against the threads and the serial twin.

Skipped where this kernel or container refuses io_setup, or the folder refuses O_DIRECT (then nothing would go
through kernel AIO). Each hang-prone case runs under a timeout.
"""

from __future__ import annotations

import errno
import gc
import os
import threading

import pytest
import torch
from helpers import TIMEOUT

from io_engine import IOConfig, IOEngine, KernelAIOUnavailableError, SerialEngine, aligned_empty, kernel_aio
from io_engine import engine as engine_mod
from io_engine.errors import ShortReadError

MiB = 1 << 20
AIO = IOConfig(submit="aio", threads=8, block_size=256 * 1024)

pytestmark = pytest.mark.skipif(
    kernel_aio.unavailable_reason() is not None, reason=str(kernel_aio.unavailable_reason())
)


@pytest.fixture
def folder(tmp_path):
    probe = tmp_path / ".probe"
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        pytest.skip("this folder refuses O_DIRECT: nothing would reach kernel AIO")
    probe.unlink()
    return tmp_path


def aligned(n: int, seed: int | None = None) -> torch.Tensor:
    t = torch.frombuffer(aligned_empty(n, 4096)[0], dtype=torch.uint8)
    if seed is not None:
        t.random_(0, 256, generator=torch.Generator().manual_seed(seed))
    return t


def round_trip(path, nbytes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``nbytes`` written to ``path`` through an AIO engine, flushed, read back: (written, read, the stats)."""
    src, dst = aligned(nbytes, seed=seed), aligned(nbytes)
    with IOEngine(AIO) as eng:
        eng.pwrite(src, path).result(timeout=TIMEOUT)
        eng.flush()
        eng.pread(dst, path).result(timeout=TIMEOUT)
        return src, dst, eng.stats()


def test_requests_go_through_kernel_aio_and_read_back_what_was_written(folder):
    """Direct bytes counted, every byte back; the engine's one thread is its submitter."""
    src, dst = aligned(8 * MiB, seed=1), aligned(8 * MiB)
    with IOEngine(AIO) as eng:
        names = [t.name for t in eng._workers]  # the submitter, and the synchronous workers for buffered tasks
        assert names == ["io_engine-aio"] + [f"io_engine-sync-{i}" for i in range(AIO.threads)]
        futs = [eng.pwrite(src[i : i + MiB], folder / "f.bin", i) for i in range(0, 8 * MiB, MiB)]
        assert [f.result(timeout=TIMEOUT) for f in futs] == [MiB] * 8
        eng.flush()
        assert eng.pread(dst, folder / "f.bin").result(timeout=TIMEOUT) == 8 * MiB
        stats = eng.stats()
    assert torch.equal(src, dst)
    assert stats["direct_bytes"] == 16 * MiB and stats["buffered_bytes"] == 0


def test_many_threads_at_once_match_the_serial_twin(folder):
    """Eight threads submit reads and writes of their own ranges at once, through a queue smaller than what
    they submit (callers wait for room); every file and read equals the serial twin's."""
    size = 4 * MiB
    results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def worker(k: int, eng, ser) -> None:
        src = aligned(size, seed=k)
        eng.pwrite(src, folder / f"e{k}.bin").result(timeout=TIMEOUT)
        ser.pwrite(src, folder / f"s{k}.bin").result(timeout=TIMEOUT)
        a, b = aligned(size - 8192), aligned(size - 8192)
        eng.pread(a, folder / f"e{k}.bin", 4096 + 512 * (k % 2)).result(timeout=TIMEOUT)  # some heads unaligned
        ser.pread(b, folder / f"s{k}.bin", 4096 + 512 * (k % 2)).result(timeout=TIMEOUT)
        results[k] = (a, b)

    with IOEngine(AIO.replace(queue_depth=4)) as eng, SerialEngine() as ser:
        threads = [threading.Thread(target=worker, args=(k, eng, ser)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert not any(t.is_alive() for t in threads), "a submitter hung"
    assert sorted(results) == list(range(8))
    for k, (a, b) in results.items():
        assert torch.equal(a, b), k
        assert (folder / f"e{k}.bin").read_bytes() == (folder / f"s{k}.bin").read_bytes()


def test_a_short_read_is_the_same_error_as_the_threads_give(folder):
    src = aligned(MiB, seed=3)
    (folder / "f.bin").write_bytes(src.numpy().tobytes())
    errors = []
    for cfg in (AIO, AIO.replace(submit="threads")):
        with IOEngine(cfg) as eng, pytest.raises(ShortReadError) as info:
            eng.pread(aligned(MiB), folder / "f.bin", 4096).result(timeout=TIMEOUT)
        errors.append((info.value.expected, info.value.found, str(info.value)))
    assert errors[0] == errors[1]


def test_a_completion_that_comes_back_short_or_failed_runs_again_synchronously(folder, monkeypatch):
    """The kernel's result for every other task is replaced by -EIO or a short count: those tasks run again
    through the synchronous path, and every byte still lands and reads back."""
    real = kernel_aio.AioContext.events
    calls = {"n": 0}

    def flaky(self, min_nr, timeout_s):
        out = []
        for tag, res in real(self, min_nr, timeout_s):
            calls["n"] += 1
            out.append((tag, -errno.EIO if calls["n"] % 3 == 0 else res // 2 if calls["n"] % 3 == 1 else res))
        return out

    monkeypatch.setattr(kernel_aio.AioContext, "events", flaky)
    src, dst, _ = round_trip(folder / "f.bin", 4 * MiB, seed=4)
    assert calls["n"] >= 3 and torch.equal(src, dst)


def test_a_failing_kernel_fails_the_requests_in_flight_and_the_engine_goes_on(folder, monkeypatch):
    """io_getevents itself fails: what was in flight fails with that error, the engine's thread carries on
    through the synchronous path, and nothing hangs."""

    def broken(self, min_nr, timeout_s):
        raise OSError(errno.EFAULT, "io_getevents failed (injected)")

    src = aligned(2 * MiB, seed=5)
    with IOEngine(AIO) as eng:
        monkeypatch.setattr(kernel_aio.AioContext, "events", broken)
        with pytest.raises(OSError, match="injected"):
            eng.pwrite(src, folder / "f.bin").result(timeout=TIMEOUT)
        monkeypatch.undo()
        assert eng.pwrite(src, folder / "f.bin").result(timeout=TIMEOUT) == 2 * MiB  # now one task at a time
        dst = aligned(2 * MiB)
        assert eng.pread(dst, folder / "f.bin").result(timeout=TIMEOUT) == 2 * MiB
    assert torch.equal(src, dst)


def test_refused_by_name_where_kernel_aio_cannot_run(monkeypatch):
    def refused(depth):
        raise OSError(errno.EPERM, "Operation not permitted")  # io_setup under a seccomp profile

    monkeypatch.setattr(engine_mod, "AioContext", refused)
    with pytest.raises(KernelAIOUnavailableError, match="submit='aio'.*Operation not permitted.*submit='threads'"):
        IOEngine(AIO)
    with pytest.raises(ValueError, match="submit must be 'threads' or 'aio'"):
        IOConfig(submit="libaio")  # type: ignore[arg-type]
    assert IOConfig.from_dict(AIO.to_dict()) == AIO


def test_an_engine_dropped_without_close_stops_its_threads(folder):
    eng = IOEngine(AIO)
    eng.pwrite(aligned(MiB, seed=6), folder / "f.bin").result(timeout=TIMEOUT)
    eng.pwrite(bytearray(b"x" * 1000), folder / "g.bin", 5).result(timeout=TIMEOUT)  # buffered: a sync worker
    threads = list(eng._workers)
    del eng
    gc.collect()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads)


def test_buffered_tasks_run_on_threads_beside_the_aio_thread(folder, monkeypatch):
    """Without O_DIRECT (direct="off" here; a filesystem that refuses it behaves the same) nothing can go to kernel
    AIO: the tasks run on the synchronous workers, several at once, and every byte lands."""
    ran: set[str] = set()
    real_pread = engine_mod.pread_all

    def spy(*args, **kw):
        ran.add(threading.current_thread().name)
        return real_pread(*args, **kw)

    monkeypatch.setattr(engine_mod, "pread_all", spy)
    src, dst = aligned(8 * MiB, seed=8), aligned(8 * MiB)
    with IOEngine(AIO.replace(direct="off")) as eng:
        eng.pwrite(src, folder / "f.bin").result(timeout=TIMEOUT)
        barrier = threading.Barrier(2, timeout=TIMEOUT)  # two tasks in pread at once: two threads serve them
        met, lock = {"n": 0}, threading.Lock()

        def meet(*args, **kw):
            with lock:  # the first two tasks only, counted under a lock
                first = met["n"] < 2
                met["n"] += 1
            if first:
                barrier.wait()
            return spy(*args, **kw)

        monkeypatch.setattr(engine_mod, "pread_all", meet)
        assert eng.pread(dst, folder / "f.bin").result(timeout=TIMEOUT) == 8 * MiB
        stats = eng.stats()
    assert torch.equal(src, dst)
    assert stats["direct_bytes"] == 0 and stats["buffered_bytes"] == 16 * MiB
    assert ran and all(name.startswith("io_engine-sync-") for name in ran) and len(ran) >= 2


def test_a_kernel_that_takes_nothing_leaves_the_tasks_to_the_synchronous_path(folder, monkeypatch):
    """io_submit refuses (EAGAIN: its queue is full) or takes only the first of a batch: the rest run on the
    engine's thread, one at a time, and every byte lands."""
    real = kernel_aio.AioContext.submit
    calls = {"n": 0}

    def stingy(self, requests):
        calls["n"] += 1
        if calls["n"] % 2:
            raise OSError(errno.EAGAIN, "io_submit: resource temporarily unavailable (injected)")
        return real(self, requests[:1])

    monkeypatch.setattr(kernel_aio.AioContext, "submit", stingy)
    src, dst, stats = round_trip(folder / "f.bin", 4 * MiB, seed=7)
    assert calls["n"] >= 2 and torch.equal(src, dst) and stats["direct_bytes"] == 8 * MiB


def test_after_a_kernel_failure_a_dropped_engine_still_stops_its_thread(folder, monkeypatch):
    def broken(self, min_nr, timeout_s):
        raise OSError(errno.EFAULT, "io_getevents failed (injected)")

    eng = IOEngine(AIO)
    monkeypatch.setattr(kernel_aio.AioContext, "events", broken)
    with pytest.raises(OSError, match="injected"):
        eng.pwrite(aligned(MiB, seed=8), folder / "f.bin").result(timeout=TIMEOUT)
    monkeypatch.undo()
    thread = eng._workers[0]
    del eng
    gc.collect()
    thread.join(TIMEOUT)
    assert not thread.is_alive(), "the engine's thread outlived it: something still holds the engine"


def test_with_every_slot_busy_the_thread_waits_for_half_of_them_at_once(folder, monkeypatch):
    """The thread takes the GIL back once for many completions (workers.py's _reap): with all slots in flight it
    first takes what is done without releasing the GIL, then waits for half the slots, never for more than are
    in flight; with slots free it waits for one, a millisecond at most. Every byte still lands."""
    real = kernel_aio.AioContext.events
    asked: list[tuple[int, float | None, int]] = []

    def spy(self, min_nr, timeout_s):
        asked.append((min_nr, timeout_s, self.depth - len(self._free)))
        return real(self, min_nr, timeout_s)

    monkeypatch.setattr(kernel_aio.AioContext, "events", spy)
    src, dst, _ = round_trip(folder / "f.bin", 16 * MiB, seed=7)  # 64 tasks of 256 KiB through 8 slots
    assert torch.equal(src, dst)
    waits = [(m, t, n) for m, t, n in asked if t != 0]
    assert all(0 < m <= n for m, _, n in waits)  # never more than in flight: no hang
    assert any(m == AIO.threads // 2 and t is None for m, t, _ in waits)  # all busy: half of them
    assert all(t is None or (m, t) == (1, 0.001) for m, t, _ in waits)
    assert any(m == 0 and t == 0 for m, t, _ in asked)  # a look at what is done, first


def test_calls_that_return_at_once_keep_the_gil(monkeypatch):
    """io_submit and a zero-timeout io_getevents go through PyDLL (the GIL kept: taking it back is what costs
    beside Python); waits through CDLL (released)."""
    used = []

    class Spy:
        def __init__(self, name, lib):
            self.name, self.lib = name, lib

        def syscall(self, *args):
            used.append(self.name)
            return self.lib.syscall(*args)

    monkeypatch.setattr(kernel_aio, "_libc", Spy("released", kernel_aio._libc))
    monkeypatch.setattr(kernel_aio, "_held", Spy("held", kernel_aio._held))
    ctx = kernel_aio.AioContext(2)
    try:
        used.clear()
        ctx.events(0, 0)
        assert used == ["held"]
        used.clear()
        ctx.events(0, 0.001)
        assert used == ["released"]
    finally:
        ctx.close()
