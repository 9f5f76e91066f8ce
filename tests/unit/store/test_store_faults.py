"""TieredStore under faults (issue 13): failed write-backs, an unclosed store at exit, planted links.

Write-back failures come from real sources where we can (a full tmpfs, a read-only remount, files made
unwritable for an unprivileged user) and from ``FaultyEngine`` (injected EIO, writes held in flight) where
timing matters. Every call that could hang runs under a timeout (``run_bounded``, ``run_script``).
"""

from __future__ import annotations

import errno
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import run_bounded, run_script, small_tmpfs, wait_until

from io_engine import IOConfig, IOFuture, SerialEngine
from io_engine.errors import IOEngineError
from tiered.store import TieredStore
from tiered.store.lock import FolderLock

KIB = 1024
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CFG = IOConfig(threads=2, block_size="16KiB")


def chunk(value: float, kib: int = 64) -> torch.Tensor:
    return torch.full((kib * KIB // 4,), float(value))  # float32: exactly `kib` KiB


def remount(path: str, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", path], check=True, capture_output=True)


class FaultyEngine(SerialEngine):
    """A SerialEngine whose writes fail with ``broken`` (an errno) while set, or wait in ``held`` while
    ``hold`` is set, until ``release(err)`` finishes them (``err`` None: really written)."""

    def __init__(self) -> None:
        super().__init__(IOConfig(direct="off"))
        self.broken: int | None = None
        self.hold = False
        self.held: list[tuple[IOFuture, object, str, int]] = []
        self.writes = 0
        self._lock = threading.Lock()

    def pwrite(self, buffer, path, offset=0, *, nbytes=None):  # type: ignore[override]
        with self._lock:
            self.writes += 1
            if self.hold:
                f = IOFuture(parts=1)
                self.held.append((f, buffer, os.fspath(path), offset))
                return f
        if self.broken is not None:
            return IOFuture.failed(IOEngineError(self.broken, "write failed: injected fault", path, offset))
        return super().pwrite(buffer, path, offset, nbytes=nbytes)

    def wait_held(self, n: int, timeout: float = 30.0) -> None:
        """Wait until ``n`` writes are held (the store submits them from its mover threads)."""
        deadline = time.monotonic() + timeout
        while len(self.held) < n:
            assert time.monotonic() < deadline, f"{len(self.held)} writes held, expected {n}"
            time.sleep(0.01)

    def release(self, err: int | None = None) -> None:
        with self._lock:
            held, self.held, self.hold = self.held, [], False
        for f, buf, path, off in held:
            if err is None:
                SerialEngine.pwrite(self, buf, path, off).result()
                f._part_done(None)
            else:
                f._part_done(IOEngineError(err, "write failed: injected fault", path, off))


# ------------------------------------------------------------------------------ failed write-backs
def test_full_disk_raises_from_put_keeps_data_and_recovers():
    """The issue's repro: a 1 MiB tmpfs, host_budget 512 KiB, eight 256 KiB puts hung at the sixth."""
    with small_tmpfs("1m") as d:
        path = os.path.join(d, "store")
        s = TieredStore(path, host_budget="512KiB")
        try:
            done: list[int] = []

            def fill() -> None:
                for i in range(len(done), 8):
                    s.put(f"k{i}", chunk(i, 256))
                    done.append(i)

            with pytest.raises(OSError) as ei:
                run_bounded(fill, 30)
            assert ei.value.errno == errno.ENOSPC
            assert os.path.join(path, "records") in str(ei.value), str(ei.value)
            assert 0 < len(done) < 8 and f"k{len(done)}" not in s  # the failed put kept nothing
            held = [k for k in s.keys() if s.info(k).dirty]
            assert held, "the records whose write-back failed stay in memory, dirty"
            for k in held:
                assert s.info(k).tier == "host"
                with s.pin(k) as t:  # in memory: no room needed
                    assert torch.equal(t, chunk(int(k[1:]), 256))
            with pytest.raises(OSError) as ei:
                run_bounded(s.flush, 30)
            assert ei.value.errno == errno.ENOSPC
            remount(d, "size=4m")  # space freed: the same calls now succeed
            run_bounded(fill, 30)
            run_bounded(s.flush, 30)
            for i in range(8):
                assert torch.equal(s.get(f"k{i}"), chunk(i, 256)), i
        finally:
            remount(d, "size=4m")
            run_bounded(s.close, 30)
        with TieredStore(path, host_budget="512KiB") as s:
            for i in range(8):
                assert torch.equal(s.get(f"k{i}"), chunk(i, 256)), i


def test_read_only_records_folder_raises_from_pin_put_and_flush_then_recovers():
    """EROFS: records/ becomes a read-only bind mount (the store's own lock file stays writable)."""
    with small_tmpfs("4m") as d:
        path = os.path.join(d, "store")
        records = os.path.join(path, "records")
        s = TieredStore(path, host_budget="256KiB", io=CFG)
        ro = False
        try:
            for i in range(6):  # k0, k1 are written back to make room; k2..k5 fill the host tier, dirty
                s.put(f"k{i}", chunk(i))
            assert [s.info(f"k{i}").tier for i in range(6)] == ["nvme"] * 2 + ["host"] * 4
            subprocess.run(["mount", "--bind", records, records], check=True, capture_output=True)
            ro = True
            remount(records, "bind,ro")
            for call in (lambda: s.pin("k0").__enter__(), lambda: s.put("k6", chunk(6)), s.flush):
                with pytest.raises(OSError) as ei:
                    run_bounded(call, 30)
                assert ei.value.errno == errno.EROFS and records in str(ei.value), str(ei.value)
            assert "k6" not in s
            for i in range(2, 6):
                assert s.info(f"k{i}").tier == "host" and s.info(f"k{i}").dirty
            subprocess.run(["umount", records], check=True, capture_output=True)
            ro = False
            with s.pin("k0") as t:
                assert torch.equal(t, chunk(0))
            s.put("k6", chunk(6))
            run_bounded(s.flush, 30)
        finally:
            if ro:
                subprocess.run(["umount", "-l", records], capture_output=True)
            run_bounded(s.close, 30)
        with TieredStore(path, host_budget="256KiB", io=CFG) as s:
            assert all(torch.equal(s.get(f"k{i}"), chunk(i)) for i in range(7))


def test_failing_disk_raises_with_key_and_path_and_retries_each_record_once(tmp_path):
    eng = FaultyEngine()
    path = str(tmp_path / "s")
    s = TieredStore(path, host_budget="256KiB", io=eng)
    try:
        s.put("n", chunk(9), tier="nvme")
        for i in range(4):
            s.put(f"k{i}", chunk(i))  # the host tier is full of dirty records
        eng.broken = errno.EIO
        for call in (lambda: s.put("k4", chunk(4)), lambda: s.pin("n").__enter__()):
            before = eng.writes
            with pytest.raises(OSError) as ei:
                run_bounded(call, 30)
            assert ei.value.errno == errno.EIO
            assert os.path.join(path, "records") in str(ei.value) and "'k" in str(ei.value), str(ei.value)
            assert eng.writes - before <= 4  # each dirty record tried once: no retry loop
        with pytest.raises(OSError) as ei:
            s.evict("k0").result(timeout=30)
        assert ei.value.errno == errno.EIO and "'k0'" in str(ei.value)
        with pytest.raises(OSError):
            run_bounded(s.flush, 30)
        assert all(s.info(f"k{i}").dirty and s.info(f"k{i}").tier == "host" for i in range(4))
        eng.broken = None
        s.put("k4", chunk(4))
        with s.pin("n") as t:
            assert torch.equal(t, chunk(9))
        run_bounded(s.flush, 30)
        assert all(torch.equal(s.get(f"k{i}"), chunk(i)) for i in range(5))
    finally:
        eng.broken = None
        run_bounded(s.close, 30)


def test_prefetch_queued_on_a_failed_write_back_resolves(tmp_path):
    eng = FaultyEngine()
    s = TieredStore(tmp_path / "s", host_budget="256KiB", io=eng)
    try:
        s.put("p", chunk(9), tier="nvme")
        for i in range(4):
            s.put(f"k{i}", chunk(i))
        eng.hold = True
        ev = s.evict("k0")  # its write-back is in flight, and will free the room the prefetch waits for
        (fut,) = s.prefetch(["p"])
        assert not fut.done()
        eng.wait_held(1)
        eng.release(errno.EIO)
        with pytest.raises(OSError):
            ev.result(timeout=30)
        with pytest.raises(OSError) as ei:
            fut.result(timeout=30)  # hung before: queued for room that never came
        assert ei.value.errno == errno.EIO
        with s.pin("p") as t:  # the room is found once the disk works again
            assert torch.equal(t, chunk(9))
    finally:
        eng.release()
        run_bounded(s.close, 30)


def acquire_failing_once(s: TieredStore, error) -> threading.Event:
    """The store's pool, its ``try_acquire`` raising ``error()`` once, the first time after the event returned is
    set (a block that cannot be made: mmap ENOMEM, a failed cudaHostRegister; or an interrupt in it)."""
    pool, fail = s._state.pool, threading.Event()
    try_acquire = pool.try_acquire

    def failing_once(nbytes: int):
        if fail.is_set():
            fail.clear()
            raise error()
        return try_acquire(nbytes)

    pool.try_acquire = failing_once  # type: ignore[method-assign]
    return fail


def test_a_queued_prefetch_whose_buffer_cannot_be_made_fails_and_the_rest_go_on(tmp_path):
    """A queued prefetch is started on a mover thread by the write-back that frees its room. When taking its buffer
    fails there (mmap ENOMEM, a failed cudaHostRegister, a bad $TIERED_HUGE_PAGES set meanwhile), that prefetch's
    future fails with the error and the next queued one still starts. Before, the error was lost on the mover: the
    prefetch and the write-back's own future never resolved (a caller waiting hung), and the room it was taking
    stayed counted for good."""
    eng = FaultyEngine()
    s = TieredStore(tmp_path / "s", host_budget="256KiB", io=eng, mover_threads=1)  # one mover: a set order
    fail = acquire_failing_once(s, lambda: OSError(errno.ENOMEM, "Cannot allocate memory"))
    try:
        s.put("p", chunk(8), tier="nvme")
        s.put("q", chunk(9), tier="nvme")
        for i in range(4):
            s.put(f"k{i}", chunk(i))
        eng.hold = True
        evs = [s.evict("k0"), s.evict("k1")]  # their write-backs are in flight: the room p and q wait for
        fp, fq = s.prefetch(["p", "q"])
        assert not fp.done() and not fq.done()
        eng.wait_held(2)
        fail.set()
        eng.release()
        for ev in evs:
            assert ev.result(timeout=30) is None  # hung before: the write-back's drain raised first
        with pytest.raises(OSError) as ei:
            fp.result(timeout=30)  # hung before
        assert ei.value.errno == errno.ENOMEM
        assert fq.result(timeout=30) is None and s.info("q").tier == "host"  # the next one still started
        assert s._host.taking == 0 and not s._host.queue and s._host.queued == 0
        with s.pin("p") as t:  # the failed prefetch left it on NVMe, read when used
            assert torch.equal(t, chunk(8))
    finally:
        fail.clear()
        eng.release()
        run_bounded(s.close, 30)


def test_an_interrupt_making_a_queued_prefetchs_buffer_leaves_the_rest_of_the_queue_started(tmp_path):
    """An interrupt (KeyboardInterrupt, injected: a real one lands on the main thread, whose drain holds it) while a
    mover makes a queued prefetch's buffer drops that prefetch (its future resolves; read when used) and the next
    one, whose room the same write-back freed, still starts. Before, the interrupt stopped the mover's drain there:
    the next prefetch stayed queued with its room free, its future waiting for another write-back."""
    eng = FaultyEngine()
    s = TieredStore(tmp_path / "s", host_budget="256KiB", io=eng, mover_threads=1)
    fail = acquire_failing_once(s, KeyboardInterrupt)
    try:
        s.put("p", chunk(8), tier="nvme")
        s.put("q", chunk(9), tier="nvme")
        for i in range(2):
            s.put(f"k{i}", chunk(i, 128))
        eng.hold = True
        ev = s.evict("k0")  # one write-back frees the room of both
        fp, fq = s.prefetch(["p", "q"])
        eng.wait_held(1)
        fail.set()
        eng.release()
        assert ev.result(timeout=30) is None
        assert fp.result(timeout=30) is None and s.info("p").tier == "nvme"  # dropped, not failed
        assert fq.result(timeout=30) is None and s.info("q").tier == "host"  # hung before: left queued
        assert s._host.taking == 0 and not s._host.queue and s._host.queued == 0
        with s.pin("p") as t:
            assert torch.equal(t, chunk(8))
    finally:
        fail.clear()
        eng.release()
        run_bounded(s.close, 30)


def test_a_prefetch_whose_checksum_cannot_be_computed_fails(tmp_path):
    """A load's checksum is checked on a mover thread. A failure to compute it (no checksum thread could start) is
    the load's error; before, it was lost there and the load never ended: its future and close() hung."""
    s = TieredStore(tmp_path / "s", host_budget="256KiB", io=CFG)
    compute = s._state.crc.compute

    def broken(buffer):
        raise RuntimeError("can't start new thread")

    try:
        s.put("p", chunk(8), tier="nvme")
        s._state.crc.compute = broken  # type: ignore[method-assign]
        (fut,) = s.prefetch(["p"])
        with pytest.raises(RuntimeError, match="new thread"):
            fut.result(timeout=30)  # hung before
        assert s._host.loading == 0 and s.info("p").tier == "nvme"
        s._state.crc.compute = compute  # type: ignore[method-assign]
        with s.pin("p") as t:  # read again when used
            assert torch.equal(t, chunk(8))
    finally:
        s._state.crc.compute = compute  # type: ignore[method-assign]
        run_bounded(s.close, 30)


def test_close_raises_a_failed_write_back_and_releases_everything(tmp_path):
    eng = FaultyEngine()
    path = str(tmp_path / "s")
    s = TieredStore(path, host_budget="256KiB", io=eng)
    for i in range(4):
        s.put(f"k{i}", chunk(i))
    eng.broken = errno.EIO
    with pytest.raises(OSError) as ei:
        run_bounded(s.close, 30)
    assert ei.value.errno == errno.EIO
    FolderLock(path).release()  # the lock was released
    with pytest.raises(RuntimeError, match="closed"):
        s.put("x", chunk(1))


def test_unwritable_record_files_raise_eacces_as_an_unprivileged_user():
    """Root ignores file modes, so this runs as `nobody`; close() must raise too, and release the lock."""
    try:
        uid = pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.skip("no user 'nobody' here")
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run as another user")
    home = tempfile.mkdtemp(prefix="tiered-nobody-")
    os.chmod(home, 0o755)
    os.chown(home, uid, uid)
    path = os.path.join(home, "store")
    code = f"""
import errno, os, torch
from io_engine import IOConfig
from tiered.store.lock import FolderLock
from tiered.store import TieredStore
path = {path!r}
rec = os.path.join(path, "records")
def t(i): return torch.full((16384,), float(i))
def chmod_all(mode):
    for f in os.listdir(rec): os.chmod(os.path.join(rec, f), mode)
s = TieredStore(path, host_budget="256KiB", io=IOConfig(threads=2, block_size="16KiB"))
for i in range(4): s.put(f"k{{i}}", t(i))
s.flush()
for i in range(4):
    with s.pin(f"k{{i}}") as x:
        x.add_(100); s.mark_dirty(f"k{{i}}")
chmod_all(0o400)
try:
    s.put("k4", t(4))
except OSError as e:
    assert e.errno == errno.EACCES and rec in str(e), repr(e)
else:
    raise SystemExit("put did not raise")
assert all(s.info(f"k{{i}}").dirty for i in range(4))
chmod_all(0o600)
s.put("k4", t(4)); s.flush()
assert all(torch.equal(s.get(f"k{{i}}"), t(i) + (100 if i < 4 else 0)) for i in range(5))
with s.pin("k4") as x:
    x.add_(1); s.mark_dirty("k4")
chmod_all(0o400)
try:
    s.close()
except OSError as e:
    assert e.errno == errno.EACCES, repr(e)
else:
    raise SystemExit("close did not raise")
FolderLock(path).release()
print("OK")
"""
    try:
        p = run_script(code, timeout=90, cwd=home, user=str(uid), env={"PYTHONPATH": REPO, "HOME": home})
    finally:
        shutil.rmtree(home, ignore_errors=True)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout + p.stderr


# ------------------------------------------------------------------------------------ clean exit
EXIT_SCRIPT = """
import sys, torch
from io_engine import IOConfig
from tiered.store import TieredStore
path, end = sys.argv[1], sys.argv[2]
s = TieredStore(path, host_budget="4MiB", io=IOConfig(threads=4, block_size="64KiB"))
s.prefetch([f"n{i}" for i in range(12)])  # reads in flight at exit
for i in range(8):
    s.put(f"d{i}", torch.full((64 * 1024,), float(i)))  # dirty in host memory
s.evict("d0")  # a write-back in flight
if end == "raise":
    raise RuntimeError("the script's own error")
sys.exit(3)
"""


@pytest.mark.slow
def test_unclosed_store_is_closed_at_exit(tmp_path):
    """Ten runs, four at a time, ending in turn by sys.exit(3) and by the script's own uncaught error (both end
    the interpreter through the same exit handlers): the prompt exit with the script's own code, no abort, and
    the dirty data saved."""
    ends = ["exit3", "raise"] * 5
    folders = [str(tmp_path / f"s{j}") for j in range(len(ends))]
    for f in folders:
        with TieredStore(f, host_budget="4MiB", io=CFG) as s:
            for i in range(12):
                s.put(f"n{i}", chunk(i, 256), tier="nvme")

    def run(folder: str, end: str) -> subprocess.CompletedProcess:
        # The timeout only guards a hang: four interpreters starting at once on a loaded 2-core machine took over 60 s.
        return subprocess.run([sys.executable, "-c", EXIT_SCRIPT, folder, end], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "PYTHONPATH": REPO})  # fmt: skip

    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(run, folders, ends))
    for f, end, p in zip(folders, ends, results, strict=True):
        assert "terminate called" not in p.stderr, p.stderr
        if end == "raise":
            assert p.returncode == 1 and "RuntimeError: the script's own error" in p.stderr, p.stderr
        else:
            assert p.returncode == 3, p.stderr
        with TieredStore(f, host_budget="4MiB", io=CFG) as s:  # the lock was released; the data saved
            for i in range(8):
                assert torch.equal(s.get(f"d{i}"), torch.full((64 * 1024,), float(i))), (f, i)
            for i in range(12):
                assert torch.equal(s.get(f"n{i}"), chunk(i, 256)), (f, i)


# ------------------------------------------------------------------------------------------ links
@pytest.fixture
def victim(tmp_path):
    """A file someone wants a root run to overwrite; checked unchanged at the end."""
    p = tmp_path / "victim"
    p.write_bytes(b"precious")
    yield str(p)
    assert p.read_bytes() == b"precious" and not p.is_symlink()


def test_symlink_at_a_record_file_is_never_followed(tmp_path, victim):
    path = str(tmp_path / "s")
    with TieredStore(path, host_budget="256KiB", io=CFG) as s:
        s.put("old", chunk(1), tier="nvme")
        link = os.path.join(path, "records", "k.bin")
        for call in (lambda: s.put("k", chunk(2), tier="nvme"), lambda: s.put("k", chunk(2))):
            os.symlink(victim, link)  # planted while the store is open
            with pytest.raises(OSError) as ei:
                call()
                s.flush()  # the write-back of a put to host
            assert ei.value.errno == errno.ELOOP and "k.bin" in str(ei.value), str(ei.value)
            if "k" in s:
                s.delete("k")  # a put to host failed at flush: the record is there, unsaved
            if os.path.islink(link):
                os.unlink(link)
        old = os.path.join(path, "records", "old.bin")
        os.unlink(old)
        os.symlink(victim, old)
        with pytest.raises(OSError) as ei:
            s.get("old")  # reads do not follow links either
        assert ei.value.errno == errno.ELOOP and "old.bin" in str(ei.value)
        os.unlink(old)
        s.delete("old")
    os.symlink(victim, link)  # planted in a closed store's folder: refused at open
    with pytest.raises(OSError, match="k.bin"):
        TieredStore(path, io=CFG)


def test_symlink_at_the_index_temp_file_is_never_followed(tmp_path, victim):
    path = str(tmp_path / "s")
    s = TieredStore(path, host_budget="256KiB", io=CFG)
    s.put("a", chunk(1))
    tmp = os.path.join(path, "index.json.tmp")
    os.symlink(victim, tmp)
    with pytest.raises(OSError) as ei:
        s.flush()
    assert ei.value.errno == errno.ELOOP and "index.json.tmp" in str(ei.value), str(ei.value)
    os.unlink(tmp)
    s.close()
    os.symlink(victim, tmp)  # planted in a closed store's folder: refused at open
    with pytest.raises(OSError, match="index.json.tmp"):
        TieredStore(path, io=CFG)
    os.unlink(tmp)
    with TieredStore(path, io=CFG) as s:
        assert torch.equal(s.get("a"), chunk(1))


def test_symlink_at_the_lock_file_is_never_followed(tmp_path, victim):
    path = tmp_path / "s"
    path.mkdir()
    os.symlink(victim, path / ".lock")
    with pytest.raises(OSError) as ei:
        TieredStore(path, io=CFG)
    assert ".lock" in str(ei.value) and str(path) in str(ei.value), str(ei.value)
    with pytest.raises(OSError) as ei:
        FolderLock(path)
    assert ei.value.errno == errno.ELOOP and ".lock" in str(ei.value)
    assert not (path / "records").exists()


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_when_the_lock_is_taken_names_the_lock_file_and_the_fix(tmp_path, monkeypatch, err):
    # The kernel's ENOSPC from writing the pid names no file: a user starting a run on a full disk was told
    # "No space left on device" and not which filesystem. Nothing is left behind, and the folder works once freed.
    import tiered.store.lock as lock

    def full(*a, **k):
        raise OSError(err, os.strerror(err))

    path = tmp_path / "s"
    for make in (lambda: FolderLock(path), lambda: TieredStore(path, io=CFG)):
        path.mkdir(exist_ok=True)
        with monkeypatch.context() as m:
            m.setattr(lock.os, "pwrite", full)
            with pytest.raises(OSError) as ei:
                make()
        assert ei.value.errno == err and ei.value.filename == str(path / ".lock"), repr(ei.value)
        assert str(path) in str(ei.value) and "nvme_path" in str(ei.value) and "Free space" in str(ei.value)
        assert not [n for n in os.listdir(path) if n.startswith(".lock")], os.listdir(path)
    with TieredStore(path, io=CFG) as s:
        s.put("a", chunk(1))


def test_store_folder_or_records_folder_as_a_symlink_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    os.symlink(target, tmp_path / "s")
    with pytest.raises(OSError) as ei:
        TieredStore(tmp_path / "s", io=CFG)
    assert ei.value.errno == errno.ELOOP and str(tmp_path / "s") in str(ei.value), str(ei.value)
    assert os.listdir(target) == []
    (tmp_path / "t").mkdir()
    os.symlink(target, tmp_path / "t" / "records")
    with pytest.raises(OSError, match="records"):
        TieredStore(tmp_path / "t", io=CFG)
    assert os.listdir(target) == [] and not (tmp_path / "t" / ".lock").exists()


def test_folder_with_foreign_files_is_refused(tmp_path):
    path = tmp_path / "s"
    path.mkdir()
    (path / "notes.txt").write_text("mine")
    with pytest.raises(OSError) as ei:
        TieredStore(path, io=CFG)
    msg = str(ei.value)
    assert str(path) in msg and "notes.txt" in msg and "nvme_path" in msg, msg
    assert sorted(os.listdir(path)) == ["notes.txt"]  # nothing created in it
    (path / "notes.txt").unlink()
    (path / "records").mkdir()
    (path / "records" / "y.txt").write_text("")
    with pytest.raises(OSError, match="y.txt"):
        TieredStore(path, io=CFG)
    (path / "records" / "y.txt").unlink()
    (tmp_path / "theirs").write_text("")
    os.link(tmp_path / "theirs", path / "records" / "x.bin")  # a hard link to someone's file is no record file
    with pytest.raises(OSError, match="x.bin"):
        TieredStore(path, io=CFG)
    (path / "records" / "x.bin").unlink()
    TieredStore(path, io=CFG).close()  # an empty folder is fine, and so is a store's own
    TieredStore(path, io=CFG).close()


def test_prefetch_queued_on_a_write_back_that_keeps_its_buffer_resolves(tmp_path):
    """The room a queued prefetch counted on never comes when the record being written back is pinned
    meanwhile (its buffer is kept). The prefetch is then dropped: its future resolves and the record is read
    when used. Before, nothing started it and a caller waiting on it hung (under load, an eight-thread mix)."""
    eng = FaultyEngine()
    s = TieredStore(tmp_path / "s", host_budget="256KiB", io=eng)
    pinned, done = threading.Event(), threading.Event()

    def pin_k0() -> None:
        with s.pin("k0") as t:  # waits for k0's write-back, then keeps its buffer
            assert torch.equal(t, chunk(0))
            pinned.set()
            done.wait(30)

    try:
        s.put("p", chunk(9), tier="nvme")
        for i in range(4):
            s.put(f"k{i}", chunk(i))
        eng.hold = True
        ev = s.evict("k0")  # its write-back is in flight, and would free the room the prefetch waits for
        (fut,) = s.prefetch(["p"])
        assert not fut.done()
        eng.wait_held(1)
        t = threading.Thread(target=pin_k0, daemon=True)
        t.start()
        assert wait_until(lambda: s._state.get("k0").keep or s._state.get("k0").pins)  # the pin is waiting
        eng.release()
        ev.result(timeout=30)
        assert pinned.wait(30)
        assert fut.result(timeout=30) is None  # hung before: queued for room that never came
        done.set()
        t.join(30)
        with s.pin("p") as got:  # read when used
            assert torch.equal(got, chunk(9))
    finally:
        done.set()
        eng.release()
        run_bounded(s.close, 30)


class FirstReadHeld(FaultyEngine):
    """The first pread waits until ``go`` is set (a get() reading its record's file, slowly)."""

    def __init__(self) -> None:
        super().__init__()
        self.reading, self.go, self.first = threading.Event(), threading.Event(), True

    def pread(self, buffer, path, offset=0, *, nbytes=None):  # type: ignore[override]
        with self._lock:
            first, self.first = self.first, False
        if first:
            self.reading.set()
            assert self.go.wait(30)
        return super().pread(buffer, path, offset, nbytes=nbytes)


def test_flush_does_not_write_a_file_that_a_get_is_reading(tmp_path):
    """A get() of a record on NVMe reads its file directly. If another thread meanwhile pins the record,
    changes it and flushes, the flush must not write that file under the read (a torn read failed its
    checksum: an IntegrityError for an intact record, once under load); it writes once the read is done."""
    eng = FirstReadHeld()
    s = TieredStore(tmp_path / "s", host_budget="256KiB", io=eng, policy="scan")
    got: list[torch.Tensor] = []
    try:
        for i in range(4):  # the scan policy's resident set, on NVMe: "k" streams, so get() reads its file
            s.put(f"r{i}", chunk(i), tier="nvme")
        s.put("k", chunk(1), tier="nvme")
        assert not s._state.policy.promote_on_get("k")
        writes = eng.writes
        reader = threading.Thread(target=lambda: got.append(s.get("k")), daemon=True)
        reader.start()
        assert eng.reading.wait(30)
        with s.pin("k") as t:  # loads the record beside the read in flight
            t.fill_(2.0)
            s.mark_dirty("k")
        flusher = threading.Thread(target=s.flush, daemon=True)
        flusher.start()
        flusher.join(0.5)
        assert eng.writes == writes  # held back while the file is being read
        eng.go.set()
        reader.join(30)
        flusher.join(30)
        assert not flusher.is_alive() and eng.writes == writes + 1
        assert torch.equal(got[0], chunk(1))  # what the file held when the read began, checksum intact
        assert torch.equal(s.get("k"), chunk(2.0))
    finally:
        eng.go.set()
        run_bounded(s.close, 30)
