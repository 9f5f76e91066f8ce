"""Fault-path acceptance tests for `IOEngine` (docs/internals.md, io_engine): no O_DIRECT, short files,
missing files, a full disk, worker errors and use after close.

The O_DIRECT and ENOSPC tests mount a small filesystem and skip cleanly where mounting is not permitted.
Note: since Linux 6.6 tmpfs accepts O_DIRECT, so the no-O_DIRECT fixture probes and falls back to ramfs,
which still rejects it.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from helpers import TIMEOUT, run_bounded

from io_engine import IOConfig, IOEngine, SerialEngine
from io_engine.errors import (
    DirectIOUnsupportedError,
    EngineClosedError,
    IOEngineError,
    ShortReadError,
)

MiB = 2**20


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def odirect_supported(directory: Path) -> bool:
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / ".odirect_probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return True


def mount(fstype: str, target: Path, options: str | None = None) -> bool:
    target.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, str(target)]
    try:
        proc = subprocess.run(cmd, capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def umount(target: Path) -> None:
    if subprocess.run(["umount", str(target)], capture_output=True, timeout=20).returncode != 0:
        subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=20)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs: big enough for a few files, small enough to fill."""
    target = tmp_path / "tmpfs"
    if not mount("tmpfs", target, "size=2m"):
        pytest.skip("cannot mount tmpfs here (needs root)")
    yield target
    umount(target)


@pytest.fixture
def no_odirect_dir(tmp_path):
    """A mounted filesystem that rejects O_DIRECT: tmpfs on old kernels, ramfs on new ones."""
    for fstype, options in (("tmpfs", "size=16m"), ("ramfs", None)):
        target = tmp_path / fstype
        if not mount(fstype, target, options):
            continue
        if not odirect_supported(target):
            yield target
            umount(target)
            return
        umount(target)
    pytest.skip("no mountable filesystem without O_DIRECT here")


def mentions_path(exc: BaseException, path: Path) -> bool:
    return str(path) in str(exc) or str(getattr(exc, "path", None)) == str(path)


# -------------------------------------------------------------------------------------------- no O_DIRECT


def test_auto_falls_back_with_one_warning_per_engine(no_odirect_dir):
    path = no_odirect_dir / "fallback.bin"
    twin = no_odirect_dir / "twin.bin"
    chunks = [payload(4097 * (i + 1), seed=i) for i in range(4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with IOEngine(IOConfig(threads=4, block_size=4096, direct="auto")) as eng, SerialEngine() as ser:
            off = 1
            for c in chunks:
                assert eng.write(c, str(path), off) == len(c)
                ser.write(c, str(twin), off)
                off += len(c)
            out = bytearray(off - 1)
            assert eng.read(out, str(path), 1) == len(out)
            eng.flush()
            stats = eng.stats()
        runtime = [w for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(runtime) == 1, [str(w.message) for w in runtime]

        # A second engine warns again: once per engine, not once per process.
        with IOEngine(IOConfig(direct="auto")) as eng2:
            eng2.write(b"x" * 10, str(no_odirect_dir / "second.bin"))
        runtime = [w for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(runtime) == 2, [str(w.message) for w in runtime]

    assert out == b"".join(chunks)
    assert path.read_bytes() == twin.read_bytes()
    assert stats["direct_bytes"] == 0 and stats["buffered_bytes"] > 0, stats


def test_direct_on_raises_direct_io_unsupported(no_odirect_dir):
    path = no_odirect_dir / "on.bin"
    with IOEngine(IOConfig(direct="on")) as eng:
        with pytest.raises(DirectIOUnsupportedError) as info:
            eng.pwrite(payload(8192), str(path)).result(timeout=TIMEOUT)
        assert isinstance(info.value, IOEngineError) and isinstance(info.value, OSError)
        assert mentions_path(info.value, path), str(info.value)
        path.write_bytes(bytes(8192))
        with pytest.raises(DirectIOUnsupportedError):
            eng.pread(bytearray(8192), str(path)).result(timeout=TIMEOUT)


def test_direct_on_engine_still_works_on_a_capable_filesystem_after_refusal(no_odirect_dir, tmp_path):
    if not odirect_supported(tmp_path):
        pytest.skip("tmp_path has no O_DIRECT")
    good = tmp_path / "good.bin"
    with IOEngine(IOConfig(direct="on", threads=2)) as eng:
        with pytest.raises(DirectIOUnsupportedError):
            eng.pwrite(payload(4096), str(no_odirect_dir / "bad.bin")).result(timeout=TIMEOUT)
        data = payload(65536, seed=2)
        assert eng.write(data, str(good)) == 65536
        out = bytearray(65536)
        assert eng.read(out, str(good)) == 65536
    assert out == data


def test_auto_on_tmpfs_round_trips(small_tmpfs):
    # Whether or not this kernel's tmpfs takes O_DIRECT, direct="auto" must just work there.
    data = payload(300001, seed=3)
    path = small_tmpfs / "auto.bin"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with IOEngine(IOConfig(direct="auto", threads=4, block_size=65536)) as eng:
            assert eng.write(data, str(path), 4095) == len(data)
            out = bytearray(len(data))
            assert eng.read(out, str(path), 4095) == len(data)
    assert out == data
    assert path.read_bytes() == bytes(4095) + data


# ------------------------------------------------------------------------------------------ short reads

SHORT_ENGINES = {
    "serial": lambda: SerialEngine(),
    "t1-off": lambda: IOEngine(IOConfig(threads=1, direct="off")),
    "t4-4k-auto": lambda: IOEngine(IOConfig(threads=4, block_size=4096, direct="auto")),
    "t16-64k-on": lambda: IOEngine(IOConfig(threads=16, block_size=65536, direct="on")),
}


@pytest.mark.parametrize("engine", list(SHORT_ENGINES))
@pytest.mark.parametrize(
    "offset, nbytes, found",
    [(0, 16384, 10000), (8192, 4096, 1808), (20000, 100, 0), (1, 65536, 9999)],
)
def test_truncated_file_raises_short_read(tmp_path, engine, offset, nbytes, found):
    if engine.endswith("-on") and not odirect_supported(tmp_path):
        pytest.skip("no O_DIRECT on tmp_path")
    path = tmp_path / "short.bin"
    path.write_bytes(payload(10000))
    with SHORT_ENGINES[engine]() as eng:
        with pytest.raises(ShortReadError) as info:
            eng.pread(bytearray(nbytes), str(path), offset).result(timeout=TIMEOUT)
        exc = info.value
        assert isinstance(exc, IOEngineError) and isinstance(exc, OSError)
        assert exc.expected == nbytes
        assert exc.found == found
        assert str(path) in str(exc), f"message should name the file: {exc}"
        # The engine keeps working after the error.
        out = bytearray(100)
        assert eng.read(out, str(path), 0) == 100


# ------------------------------------------------------------------------------------------- missing file


@pytest.mark.parametrize("engine", list(SHORT_ENGINES))
def test_reading_missing_file_raises_enoent(tmp_path, engine):
    if engine.endswith("-on") and not odirect_supported(tmp_path):
        pytest.skip("no O_DIRECT on tmp_path")
    path = tmp_path / "missing.bin"
    with SHORT_ENGINES[engine]() as eng:
        with pytest.raises(OSError) as info:
            eng.pread(bytearray(4096), str(path)).result(timeout=TIMEOUT)
        assert info.value.errno == errno.ENOENT
        assert mentions_path(info.value, path), str(info.value)
    assert not path.exists(), "pread must not create the file"


@pytest.mark.parametrize("engine_cls", [IOEngine, SerialEngine])
def test_writing_into_missing_directory_raises_enoent(tmp_path, engine_cls):
    with engine_cls() as eng:
        with pytest.raises(OSError) as info:
            eng.pwrite(b"abc", str(tmp_path / "nodir" / "f.bin")).result(timeout=TIMEOUT)
        assert info.value.errno == errno.ENOENT


# --------------------------------------------------------------------------------------------- full disk

FULL_ENGINES = {
    "serial": lambda: SerialEngine(),
    "t1-off": lambda: IOEngine(IOConfig(threads=1, block_size=65536, direct="off")),
    "t8-64k-auto": lambda: IOEngine(IOConfig(threads=8, block_size=65536, direct="auto")),
}


@pytest.mark.parametrize("engine", list(FULL_ENGINES))
def test_full_disk_raises_enospc_and_engine_recovers(small_tmpfs, engine):
    big = small_tmpfs / "big.bin"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with FULL_ENGINES[engine]() as eng:
            with pytest.raises(IOEngineError) as info:
                eng.pwrite(payload(4 * MiB), str(big)).result(timeout=TIMEOUT)
            assert info.value.errno == errno.ENOSPC
            assert mentions_path(info.value, big), str(info.value)
            run_bounded(lambda: _flush_ignoring_errors(eng))
            big.unlink()
            small = small_tmpfs / "small.bin"
            data = payload(65536 + 3, seed=5)
            assert eng.write(data, str(small), 1) == len(data)
            out = bytearray(len(data))
            assert eng.read(out, str(small), 1) == len(data)
            eng.flush()
    assert out == data


def _flush_ignoring_errors(eng) -> None:
    try:
        eng.flush()
    except OSError:
        pass  # the contract leaves open whether flush re-raises earlier write errors


# ------------------------------------------------------------------------------------ errors in workers


@pytest.mark.parametrize("engine_cls", [IOEngine, SerialEngine])
def test_worker_error_reaches_the_future(tmp_path, engine_cls):
    # Reading a directory opens fine and then fails inside the worker (EISDIR).
    d = tmp_path / "adir"
    d.mkdir()
    with engine_cls(IOConfig(direct="off", threads=2)) as eng:
        fut = eng.pread(bytearray(4096), str(d))
        with pytest.raises(OSError) as info:
            fut.result(timeout=TIMEOUT)
        assert info.value.errno == errno.EISDIR
        assert fut.done()
        assert isinstance(fut.exception(), OSError)
        out = bytearray(3)
        (tmp_path / "ok.bin").write_bytes(b"abc")
        assert eng.read(out, str(tmp_path / "ok.bin")) == 3


def test_mixed_good_and_failing_requests_all_resolve(tmp_path):
    good = tmp_path / "good.bin"
    good.write_bytes(payload(64 * 4096))
    missing = tmp_path / "missing.bin"
    with IOEngine(IOConfig(threads=4, block_size=4096, direct="off")) as eng:
        futs = []
        for i in range(64):
            if i % 3 == 0:
                futs.append(("bad", eng.pread(bytearray(4096), str(missing), i * 4096)))
            else:
                futs.append(("good", eng.pread(bytearray(4096), str(good), i * 4096)))
        for kind, fut in futs:
            if kind == "good":
                assert fut.result(timeout=TIMEOUT) == 4096
            else:
                with pytest.raises(OSError) as info:
                    fut.result(timeout=TIMEOUT)
                assert info.value.errno == errno.ENOENT, repr(info.value)  # not a TimeoutError
        run_bounded(lambda: _flush_ignoring_errors(eng))


def test_failing_callback_does_not_break_the_engine(tmp_path):
    path = tmp_path / "cb.bin"

    def bad_callback(_fut):
        raise RuntimeError("callback bug")

    with IOEngine(IOConfig(threads=1)) as eng:
        fut = eng.pwrite(b"abc", str(path))
        fut.add_done_callback(bad_callback)
        assert fut.result(timeout=TIMEOUT) == 3
        assert eng.pwrite(b"def", str(path), 3).result(timeout=TIMEOUT) == 3
    assert path.read_bytes() == b"abcdef"


# -------------------------------------------------------------------------------------------------- close


@pytest.mark.parametrize("engine_cls", [IOEngine, SerialEngine])
def test_use_after_close_raises_engine_closed(tmp_path, engine_cls):
    path = tmp_path / "c.bin"
    path.write_bytes(bytes(16))
    eng = engine_cls()
    eng.close()
    calls = {
        "pread": lambda: eng.pread(bytearray(16), str(path)),
        "pwrite": lambda: eng.pwrite(b"x", str(path)),
        "read": lambda: eng.read(bytearray(16), str(path)),
        "write": lambda: eng.write(b"x", str(path)),
        "flush": lambda: eng.flush(),
    }
    for name, call in calls.items():
        with pytest.raises(EngineClosedError) as info:
            call()
        assert isinstance(info.value, RuntimeError), name
    eng.close()  # closing twice is harmless
    assert path.read_bytes() == bytes(16)


@pytest.mark.parametrize("engine_cls", [IOEngine, SerialEngine])
def test_context_manager_closes(tmp_path, engine_cls):
    with engine_cls() as eng:
        eng.write(b"abc", str(tmp_path / "c.bin"))
    with pytest.raises(EngineClosedError):
        eng.pwrite(b"x", str(tmp_path / "c.bin"))


def test_close_leaves_no_future_pending(tmp_path):
    path = tmp_path / "inflight.bin"
    eng = IOEngine(IOConfig(threads=2, block_size=4096, direct="off"))
    futs = [eng.pwrite(payload(8193, i), str(path), i * 8193) for i in range(64)]
    run_bounded(eng.close)
    assert all(f.done() for f in futs), "close() returned with requests still pending"
    for f in futs:
        try:
            f.result(timeout=TIMEOUT)
        except (EngineClosedError, OSError):
            pass  # cancelling at close is acceptable; hanging is not


def test_close_during_a_slow_submit_never_strands_its_future(tmp_path):
    # pread() of a FIFO with no writer is slow to start whatever the engine does (its open() waits for a
    # writer, in the caller or in a worker). close() runs meanwhile. Afterwards the request must either
    # have been refused with EngineClosedError or resolve; a future nobody will ever complete is a hang.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    eng = IOEngine(IOConfig(threads=1, direct="off"))
    box: dict = {}

    def submit():
        try:
            box["fut"] = eng.pread(bytearray(16), str(fifo))
        except EngineClosedError as exc:
            box["refused"] = exc

    submitter = threading.Thread(target=submit, daemon=True)
    submitter.start()
    submitter.join(0.2)  # scheduling hint only: lets the submit reach its open() first
    closer = threading.Thread(target=eng.close, daemon=True)
    closer.start()
    closer.join(0.2)
    released = threading.Event()
    for _ in range(int(TIMEOUT / 0.02)):
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # succeeds once a reader waits in open()
        except OSError:
            if not submitter.is_alive() and "fut" in box and box["fut"].done():
                break
            released.wait(0.02)
            continue
        try:  # the reader's open() has returned: what this writer was for
            os.write(fd, bytes(16))
        except BrokenPipeError:  # and it read nothing and went (pread on a pipe fails, ESPIPE) before the write
            pass
        finally:
            os.close(fd)
        break
    submitter.join(TIMEOUT)
    assert not submitter.is_alive(), "pread() never returned"
    closer.join(TIMEOUT)
    assert not closer.is_alive(), "close() never returned"
    if "fut" in box:
        try:
            box["fut"].result(timeout=10)
        except TimeoutError:
            pytest.fail("a request submitted while close() ran was accepted but never completes")
        except OSError:
            pass  # pread on a pipe fails (ESPIPE): fine, the future resolved


# ------------------------------------------------------------------------------------------------ links


@pytest.mark.parametrize("engine_cls", [IOEngine, SerialEngine])
def test_follow_symlinks_false_refuses_links_and_leaves_their_targets(tmp_path, engine_cls):
    target = tmp_path / "target.bin"
    target.write_bytes(b"precious")
    link, dangling = tmp_path / "link.bin", tmp_path / "dangling.bin"
    os.symlink(target, link)
    os.symlink(tmp_path / "created-through-a-link", dangling)
    with engine_cls(IOConfig(direct="off"), follow_symlinks=False) as eng:
        for op, path in (("pwrite", link), ("pread", link), ("pwrite", dangling)):
            with pytest.raises(OSError) as info:
                getattr(eng, op)(bytearray(4096), str(path)).result(timeout=TIMEOUT)
            assert info.value.errno == errno.ELOOP and mentions_path(info.value, path), str(info.value)
            assert "follow_symlinks" in str(info.value)
        eng.write(b"plain", str(tmp_path / "plain.bin"))  # a regular file is fine
        eng.flush()
    assert target.read_bytes() == b"precious" and not (tmp_path / "created-through-a-link").exists()
    with engine_cls(IOConfig(direct="off")) as eng:  # the default still follows links
        eng.write(b"through", str(link))
    assert target.read_bytes() == b"throughs"  # written over in place


@pytest.mark.parametrize("engine_cls", [IOEngine, SerialEngine])
def test_follow_symlinks_is_validated(engine_cls):
    with engine_cls(IOConfig(threads=1)) as eng:
        assert eng.follow_symlinks is True
    with pytest.raises(TypeError, match="follow_symlinks"):
        engine_cls(IOConfig(threads=1), follow_symlinks="no")


# ---------------------------------------------------------------------------------------- lifecycle


def test_dropped_engine_stops_its_threads(tmp_path):
    import gc

    eng = IOEngine(IOConfig(threads=3, direct="off"))
    eng.write(b"abc", str(tmp_path / "a.bin"))
    workers = list(eng._workers)
    del eng
    gc.collect()
    for t in workers:
        t.join(TIMEOUT)
        assert not t.is_alive(), "a dropped engine's worker threads live on"


ENGINE_EXIT_SCRIPT = """
import sys, torch
from io_engine import IOConfig, IOEngine
eng = IOEngine(IOConfig(threads=4, block_size="64KiB"))
for i in range(24):
    eng.pwrite(torch.full((1 << 19,), float(i)), f"{sys.argv[1]}/f{i}.bin")  # 2 MiB each, in flight at exit
if sys.argv[2] == "raise":
    raise RuntimeError("the script's own error")
"""


@pytest.mark.slow
@pytest.mark.parametrize("end", ["return", "raise"])
def test_unclosed_engine_finishes_its_writes_at_exit(tmp_path, end):
    folders = [tmp_path / f"{end}{run}" for run in range(5)]

    def run(folder):
        folder.mkdir()
        return subprocess.run([sys.executable, "-c", ENGINE_EXIT_SCRIPT, str(folder), end], capture_output=True,
                              text=True, timeout=60)  # fmt: skip

    with ThreadPoolExecutor(len(folders)) as ex:  # the five runs at once: each is mostly its torch import
        procs = list(ex.map(run, folders))
    for folder, proc in zip(folders, procs, strict=True):
        assert "terminate called" not in proc.stderr, proc.stderr
        assert proc.returncode == (1 if end == "raise" else 0), proc.stderr
        for i in range(24):
            data = np.fromfile(folder / f"f{i}.bin", dtype=np.float32)
            assert data.size == 1 << 19 and (data == i).all(), f"f{i}.bin is incomplete after exit"


def test_an_engine_used_in_a_forked_child_raises_at_once(tmp_path):
    """An engine made before fork() accepted requests in the child that no thread would ever run: a hang."""
    from helpers import run_script

    code = f"""
import os, torch
from io_engine import IOEngine, IOConfig, EngineForkedError
eng = IOEngine(IOConfig(threads=2))
path = os.path.join({str(tmp_path)!r}, "f")
eng.pwrite(torch.ones(1024), path, 0).result()
pid = os.fork()
if pid == 0:
    try:
        eng.pread(torch.empty(1024), path, 0).result(timeout=60)
        os._exit(3)
    except EngineForkedError as e:
        print("child:", e, flush=True)
    eng.close()  # the parent's threads: nothing to wait for here
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status))
eng.pread(torch.empty(1024), path, 0).result()
eng.close()
"""
    proc = run_script(code, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "child exit 0" in proc.stdout and "before a fork" in proc.stdout and "spawn" in proc.stdout, proc.stdout


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_under_an_atomic_json_write_names_the_file_and_keeps_the_old_one(tmp_path):
    """A full disk while saving a store's index.json raised a bare OSError: no path, no offset."""
    from io_engine import write_json_atomic

    target = tmp_path / "index.json"
    target.write_text('{"old": 1}')
    with pytest.raises(IOEngineError) as e:
        write_json_atomic(target, {"new": 2}, tmp="/dev/full")  # every write there fails with ENOSPC
    assert e.value.errno == errno.ENOSPC and e.value.path == "/dev/full" and e.value.offset == 0
    assert "disk is full" in str(e.value) and "/dev/full" in str(e.value)
    assert target.read_text() == '{"old": 1}' and os.path.exists("/dev/full")
