"""Acceptance tests for `IOEngine`: parity with its serial twin `SerialEngine` (docs/internals.md, io_engine).

Every request waits with a timeout, so a hang fails a test instead of stalling the suite.
Fault paths (tmpfs, ENOSPC, short reads, close) live in test_io_engine_faults.py.
"""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import gc
import mmap
import os
import platform
import resource
import signal
import struct
import sys
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import REPO, TIMEOUT, odirect_512_supported, run_bounded, run_script, wait_until

import io_engine
from io_engine import IOConfig, IOEngine, PinnedBufferPool, SerialEngine
from io_engine.errors import EngineClosedError, ShortReadError
from io_engine.kernel_aio import unavailable_reason

MiB = 2**20


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def odirect_supported(directory: Path) -> bool:
    probe = directory / ".odirect_probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return hasattr(os, "O_DIRECT")


@pytest.fixture
def direct_ok(tmp_path):
    if not odirect_supported(tmp_path):
        pytest.skip("tmp_path's filesystem has no O_DIRECT; direct='on' is covered in the fault tests")


_SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282}.get(platform.machine())
_UFFDIO_API = (3 << 30) | (24 << 16) | (0xAA << 8) | 0x3F  # _IOWR(0xAA, 0x3F, struct uffdio_api)
_UFFDIO_REGISTER = (3 << 30) | (32 << 16) | (0xAA << 8) | 0x00  # _IOWR(0xAA, 0x00, struct uffdio_register)


class StalledBuffer:
    """An anonymous mmap registered with userfaultfd: the first time anything (the kernel, in a worker's
    pread) touches it, that thread blocks until release(). It keeps a request pending for as long as a
    test needs, whatever the engine's design, with no sleeps. After release it is ordinary memory."""

    def __init__(self, nbytes: int):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        fd = libc.syscall(_SYS_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "userfaultfd")
        self._fd = fd
        try:
            fcntl.ioctl(fd, _UFFDIO_API, bytearray(struct.pack("QQQ", 0xAA, 0, 0)))
            self.mm = mmap.mmap(-1, nbytes)
            addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
            length = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
            fcntl.ioctl(fd, _UFFDIO_REGISTER, bytearray(struct.pack("QQQQ", addr, length, 1, 0)))
        except OSError:
            os.close(fd)
            raise

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # wakes the blocked thread; the fault then resolves normally
            self._fd = -1


@pytest.fixture
def stall():
    """Factory of StalledBuffers, all released at teardown (skips where userfaultfd is unavailable)."""
    made: list[StalledBuffer] = []

    def make(nbytes: int) -> StalledBuffer:
        if _SYS_USERFAULTFD is None:
            pytest.skip("userfaultfd syscall number unknown on this machine")
        try:
            buf = StalledBuffer(nbytes)
        except OSError as exc:
            pytest.skip(f"userfaultfd unavailable: {exc}")
        made.append(buf)
        return buf

    yield make
    for buf in made:
        buf.release()


# Several thread counts, block sizes and direct modes (direct="on" needs O_DIRECT on tmp_path).
CONFIGS = {
    "t1-4k-off": dict(threads=1, block_size=4096, direct="off"),
    "t4-64k-auto": dict(threads=4, block_size=65536, direct="auto"),
    "t16-1m-on": dict(threads=16, block_size=MiB, direct="on"),
    "t4-4k-on": dict(threads=4, block_size=4096, direct="on"),
    "t16-64k-off": dict(threads=16, block_size=65536, direct="off"),
    "t1-1m-auto": dict(threads=1, block_size=MiB, direct="auto"),
}


def make_engine(name: str, tmp_path: Path) -> IOEngine:
    cfg = CONFIGS[name]
    if cfg["direct"] == "on" and not odirect_supported(tmp_path):
        pytest.skip("no O_DIRECT on tmp_path")
    return IOEngine(IOConfig(**cfg))


SIZES = [1, 4095, 4097, 3 * MiB + 3]
OFFSETS = [0, 1, 4095, 8193]


# ------------------------------------------------------------------------------------ round trips vs twin


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_round_trip_matches_serial_twin(tmp_path, cfg, size, offset):
    data = payload(size, seed=size + offset)
    # Files start with other content: pwrite never truncates and leaves the neighbours alone.
    base = payload(offset + size + 5003, seed=1)
    a, b = tmp_path / "engine.bin", tmp_path / "serial.bin"
    a.write_bytes(base)
    b.write_bytes(base)
    with make_engine(cfg, tmp_path) as eng, SerialEngine() as ser:
        assert eng.write(bytearray(data), str(a), offset) == size
        assert ser.write(bytearray(data), str(b), offset) == size
        eng.flush()
        assert a.read_bytes() == b.read_bytes()
        assert a.read_bytes() == base[:offset] + data + base[offset + size :]
        out = bytearray(size)
        assert eng.read(out, str(b), offset) == size
        assert out == data
        twin = bytearray(size)
        assert ser.read(twin, str(a), offset) == size
        assert twin == out


@pytest.mark.parametrize("cfg", ["t4-4k-on", "t16-1m-on", "t4-64k-auto"])
@pytest.mark.parametrize("size, offset", [(3 * 4096 + 5, 0), (8192 + 100, 4096), (4096, 4096), (5, 1)])
def test_read_ending_exactly_at_end_of_file(tmp_path, cfg, size, offset):
    path = tmp_path / "eof.bin"
    data = payload(size, seed=size)
    path.write_bytes(data)
    with make_engine(cfg, tmp_path) as eng:
        out = bytearray(size - offset)
        assert eng.read(out, str(path), offset) == size - offset
    assert out == data[offset:]


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_write_creates_missing_file_at_offset(tmp_path, cfg):
    data = payload(10007, seed=3)
    a, b = tmp_path / "new_engine.bin", tmp_path / "new_serial.bin"
    with make_engine(cfg, tmp_path) as eng, SerialEngine() as ser:
        assert eng.write(data, str(a), 4099) == len(data)
        assert ser.write(data, str(b), 4099) == len(data)
        eng.flush()
    assert a.read_bytes() == b.read_bytes() == bytes(4099) + data


def test_default_engine_round_trips(tmp_path):
    data = payload(123457, seed=4)
    path = tmp_path / "f.bin"
    with IOEngine() as eng:
        assert eng.write(data, str(path), 17) == len(data)
        out = bytearray(len(data))
        assert eng.read(out, str(path), 17) == len(data)
    assert out == data


def test_accepts_pathlike_paths(tmp_path):
    path = tmp_path / "p.bin"
    with IOEngine(IOConfig(threads=2, direct="off")) as eng:
        assert eng.write(b"hello", path) == 5
        out = bytearray(5)
        assert eng.read(out, path) == 5
        eng.flush(path)
    assert out == b"hello"


# --------------------------------------------------------------------------------------------- concurrency


@pytest.mark.parametrize("cfg", ["t4-4k-on", "t16-64k-off", "t4-64k-auto"])
def test_python_threads_submit_concurrently_to_distinct_regions(tmp_path, cfg):
    # Odd-sized slots that straddle 4 KiB blocks: even slots are written while odd slots of the same
    # file are read, from four Python threads at once. A read-modify-write of a shared block that is
    # not serialised corrupts a neighbour.
    slot, nslots, nthreads, lead = 3001, 64, 4, 7
    path = tmp_path / "shared.bin"
    base = payload(lead + slot * nslots + 100, seed=5)
    path.write_bytes(base)
    new = {k: payload(slot, seed=1000 + k) for k in range(0, nslots, 2)}
    reads: dict[int, bytearray] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(nthreads)

    with make_engine(cfg, tmp_path) as eng:

        def worker(t: int) -> None:
            try:
                barrier.wait(TIMEOUT)
                futs = []
                for k in range(t, nslots, nthreads):
                    off = lead + k * slot
                    if k % 2 == 0:
                        futs.append((slot, eng.pwrite(new[k], str(path), off)))
                    else:
                        reads[k] = bytearray(slot)
                        futs.append((slot, eng.pread(reads[k], str(path), off)))
                for n, fut in futs:
                    assert fut.result(timeout=TIMEOUT) == n
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(nthreads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
            assert not t.is_alive(), "a submitting thread hung"
        assert not errors, errors
        eng.flush()

    got = path.read_bytes()
    assert len(got) == len(base)
    for k in range(nslots):
        off = lead + k * slot
        if k % 2 == 0:
            assert got[off : off + slot] == new[k], f"written slot {k} wrong"
        else:
            assert got[off : off + slot] == base[off : off + slot], f"neighbour slot {k} was clobbered"
            assert reads[k] == base[off : off + slot], f"read of slot {k} wrong"
    assert got[:lead] == base[:lead] and got[lead + slot * nslots :] == base[lead + slot * nslots :]


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_many_requests_in_flight_then_flush(tmp_path, cfg):
    # 96 adjacent 4097-byte writes submitted without waiting; flush() must wait for all of them.
    n, size, lead = 96, 4097, 1
    path = tmp_path / "many.bin"
    chunks = [payload(size, seed=i) for i in range(n)]
    with make_engine(cfg, tmp_path) as eng:
        futs = [eng.pwrite(chunks[i], str(path), lead + i * size) for i in range(n)]
        eng.flush()
        assert all(f.done() for f in futs), "flush() returned before every submitted request finished"
        assert [f.result(timeout=TIMEOUT) for f in futs] == [size] * n
        assert path.read_bytes() == bytes(lead) + b"".join(chunks)

        outs = [bytearray(size) for _ in range(n)]
        rfuts = [eng.pread(outs[i], str(path), lead + i * size) for i in range(n)]
        assert [f.result(timeout=TIMEOUT) for f in rfuts] == [size] * n
        assert outs == [bytearray(c) for c in chunks]


def test_engine_keeps_buffers_alive_until_done(tmp_path):
    # The caller drops its only reference right after pwrite; the bytes written must still be its bytes.
    path = tmp_path / "temp_buffers.bin"
    n, size = 64, 4097
    with IOEngine(IOConfig(threads=4, block_size=4096, direct="off")) as eng:
        for i in range(n):
            eng.pwrite(torch.full((size,), i, dtype=torch.uint8), str(path), i * size)
            eng.pwrite(np.full(size, 255 - i, dtype=np.uint8), str(path), (n + i) * size)
        gc.collect()
        eng.flush()
    expected = b"".join(bytes([i]) * size for i in range(n))
    expected += b"".join(bytes([255 - i]) * size for i in range(n))
    assert path.read_bytes() == expected


@pytest.mark.parametrize("engine_cls", [IOEngine, SerialEngine])
def test_no_hold_on_the_buffer_once_the_request_is_done(tmp_path, engine_cls):
    # Once result() returns, the buffer is the caller's again: it can be resized, closed or freed.
    path = tmp_path / "hold.bin"
    path.write_bytes(payload(10000))
    with engine_cls(IOConfig(threads=2, direct="off")) as eng:
        ba = bytearray(10000)
        assert eng.read(ba, str(path)) == 10000
        ba.extend(b"more")  # BufferError while anything still exports ba

        mm = mmap.mmap(-1, 10000)
        assert eng.read(mm, str(path)) == 10000
        mm.close()  # BufferError while anything still exports mm

        t = torch.ones(250_000)  # 1 MB
        ref = weakref.ref(t)
        assert eng.write(t, str(path)) == 1_000_000
        del t
        gc.collect()
        assert ref() is None, "the engine keeps a finished request's tensor alive"


@pytest.mark.parametrize("alignment", [512, 8192])
def test_every_valid_alignment_works_with_direct_on(tmp_path, direct_ok, alignment):
    # IOConfig accepts any power of two >= 512; the engine must honour what the config accepts.
    # 512 needs a disk with 512-byte logical blocks (it is skipped elsewhere).
    if alignment == 512 and not odirect_512_supported(tmp_path):
        pytest.skip("tmp_path's disk needs 4096-byte O_DIRECT alignment")
    try:
        cfg = IOConfig(threads=4, block_size=65536, direct="on", alignment=alignment)
    except ValueError as exc:
        # Refusing it at the boundary is a consistent answer too.
        assert "alignment" in str(exc)
        return
    data = payload(3 * 65536 + 777, seed=16)
    path = tmp_path / "align.bin"
    with IOEngine(cfg) as eng, SerialEngine() as ser:
        for buf_off in (0, 1):  # aligned and misaligned memory
            storage = bytearray(len(data) + 1)
            view = memoryview(storage)[buf_off : buf_off + len(data)]
            view[:] = data
            assert eng.write(view, str(path), alignment * 3 + 5) == len(data)
            out = bytearray(len(data))
            assert ser.read(out, str(path), alignment * 3 + 5) == len(data)
            assert out == data
            back = memoryview(bytearray(len(data) + 1))[buf_off : buf_off + len(data)]
            assert eng.read(back, str(path), alignment * 3 + 5) == len(data)
            assert back.tobytes() == data


# ------------------------------------------------------------------------------------------------- flush


def test_flush_path_fsyncs_that_file(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync, real_fdatasync = os.fsync, os.fdatasync

    def record(real):
        def wrapper(fd):
            fdn = fd if isinstance(fd, int) else fd.fileno()
            synced.append(os.path.realpath(f"/proc/self/fd/{fdn}"))
            return real(fd)

        return wrapper

    monkeypatch.setattr(os, "fsync", record(real_fsync))
    monkeypatch.setattr(os, "fdatasync", record(real_fdatasync))
    # Also catch `from os import fsync` inside the package.
    for name, mod in list(sys.modules.items()):
        if name == "io_engine" or name.startswith("io_engine."):
            for attr, real in (("fsync", real_fsync), ("fdatasync", real_fdatasync)):
                if getattr(mod, attr, None) is real:
                    monkeypatch.setattr(mod, attr, record(real))

    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    with IOEngine(IOConfig(threads=2, direct="off")) as eng:
        eng.write(b"a" * 100, str(a))
        eng.write(b"b" * 100, str(b))
        synced.clear()
        eng.flush(str(a))
        assert os.path.realpath(a) in synced, "flush(path) must fsync that file"
        assert os.path.realpath(b) not in synced, "flush(path) fsyncs only that path"
        synced.clear()
        eng.fsync()
        assert os.path.realpath(b) in synced, "fsync() (alias of flush()) must fsync every written file"


def test_flush_path_waits_for_all_requests(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    with IOEngine(IOConfig(threads=4, block_size=4096, direct="off")) as eng:
        futs = [eng.pwrite(payload(8191, i), str(b), i * 8191) for i in range(32)]
        futs.append(eng.pwrite(b"x", str(a)))
        eng.flush(str(a))
        assert all(f.done() for f in futs), "flush(path) waits for every request submitted so far"


def test_flush_with_nothing_written_is_fine():
    with IOEngine() as eng:
        eng.flush()
        eng.fsync()
        assert eng.stats()["bytes_written"] == eng.stats()["requests"] == 0
    with SerialEngine() as ser:
        ser.flush()
        assert ser.stats()["bytes_written"] == 0


# ------------------------------------------------------------------------------------------------ buffers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.int64])
@pytest.mark.parametrize("engine_cls", [IOEngine, SerialEngine])
def test_torch_tensor_round_trip(tmp_path, engine_cls, dtype):
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        src = torch.randn(3, 1001, generator=g).to(dtype)
    else:
        src = torch.randint(-100, 100, (3, 1001), generator=g).to(dtype)
    nbytes = src.numel() * src.element_size()
    path = tmp_path / "t.bin"
    with engine_cls() as eng:
        assert eng.write(src, str(path), 5) == nbytes
        dst = torch.empty_like(src)
        assert eng.read(dst, str(path), 5) == nbytes
    assert torch.equal(dst, src)
    assert path.read_bytes()[5:] == src.reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.int16, np.uint8, np.float64])
@pytest.mark.parametrize("engine_cls", [IOEngine, SerialEngine])
def test_numpy_round_trip(tmp_path, engine_cls, dtype):
    src = (np.arange(5 * 777) % 251).astype(dtype).reshape(5, 777)
    path = tmp_path / "n.bin"
    with engine_cls() as eng:
        assert eng.write(src, str(path), 3) == src.nbytes
        dst = np.zeros_like(src)
        assert eng.read(dst, str(path), 3) == src.nbytes
    np.testing.assert_array_equal(dst, src)
    assert path.read_bytes()[3:] == src.tobytes()


@pytest.mark.parametrize("engine_cls", [IOEngine, SerialEngine])
def test_bytes_bytearray_memoryview_mmap(tmp_path, engine_cls):
    data = payload(9001, seed=7)
    path = tmp_path / "m.bin"
    with engine_cls() as eng:
        assert eng.write(data, str(path)) == 9001  # bytes are fine for pwrite
        assert eng.write(memoryview(data), str(path), 9001) == 9001
        ba = bytearray(9001)
        assert eng.read(ba, str(path)) == 9001
        assert ba == data
        mv = memoryview(bytearray(9001))
        assert eng.read(mv, str(path), 9001) == 9001
        assert mv.tobytes() == data
        mm = mmap.mmap(-1, 9001)
        assert eng.read(mm, str(path)) == 9001
        assert mm[:] == data
        assert eng.write(mm, str(path), 18002) == 9001
    assert path.read_bytes() == data * 3


@pytest.mark.parametrize("engine_cls", [IOEngine, SerialEngine])
def test_tensor_view_with_storage_offset_reads_into_the_right_place(tmp_path, engine_cls):
    base = torch.zeros(64, 16, dtype=torch.float32)
    view = base[8:24]
    assert view.is_contiguous() and view.storage_offset() == 128
    src = torch.arange(16 * 16, dtype=torch.float32).reshape(16, 16) + 1
    path = tmp_path / "v.bin"
    path.write_bytes(src.numpy().tobytes())
    with engine_cls() as eng:
        assert eng.read(view, str(path)) == src.numel() * 4
    assert torch.equal(base[8:24], src)
    assert not base[:8].any() and not base[24:].any(), "bytes outside the view were touched"


@pytest.mark.parametrize("engine_cls", [IOEngine, SerialEngine])
def test_tensor_view_with_storage_offset_writes_its_own_bytes(tmp_path, engine_cls):
    base = torch.arange(64 * 16, dtype=torch.int32).reshape(64, 16)
    view = base[8:24]
    path = tmp_path / "v.bin"
    with engine_cls() as eng:
        assert eng.write(view, str(path)) == view.numel() * 4
    assert path.read_bytes() == view.numpy().tobytes()


@pytest.mark.parametrize("engine_cls", [IOEngine, SerialEngine])
def test_sliced_numpy_and_memoryview_offsets(tmp_path, engine_cls):
    data = payload(1000, seed=8)
    path = tmp_path / "s.bin"
    path.write_bytes(data)
    arr = np.zeros(1010, dtype=np.uint8)
    ba = bytearray(1010)
    with engine_cls() as eng:
        assert eng.read(arr[5:1005], str(path)) == 1000
        assert eng.read(memoryview(ba)[7:1007], str(path)) == 1000
    assert arr[5:1005].tobytes() == data and not arr[:5].any() and not arr[1005:].any()
    assert ba[7:1007] == data and ba[:7] == bytes(7) and ba[1007:] == bytes(3)


@pytest.mark.parametrize("engine_cls", [IOEngine, SerialEngine])
def test_nbytes_counts_bytes_and_leaves_the_rest(tmp_path, engine_cls):
    path = tmp_path / "nb.bin"
    src = torch.arange(256, dtype=torch.float32)  # 1024 bytes
    with engine_cls() as eng:
        assert eng.write(src, str(path), nbytes=10) == 10
        assert path.stat().st_size == 10, "pwrite writes only the first nbytes"
        assert path.read_bytes() == src.view(torch.uint8)[:10].numpy().tobytes()
        dst = torch.full((256,), -1.0)
        sentinel = dst.clone()
        assert eng.read(dst, str(path), nbytes=8) == 8
    assert torch.equal(dst[:2], src[:2])
    assert torch.equal(dst[2:], sentinel[2:]), "pread must fill only the first nbytes of the buffer"


def test_pooled_buffer_round_trip_counts_direct_bytes(tmp_path, direct_ok):
    path = tmp_path / "pool.bin"
    data = payload(MiB, seed=9)
    pool = PinnedBufferPool(4 * MiB)
    try:
        src, dst = pool.acquire(MiB), pool.acquire(MiB)
        src.tensor.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        with IOEngine(IOConfig(threads=4, block_size=256 * 1024, direct="on")) as eng:
            assert eng.write(src.tensor, str(path), 4096) == MiB
            assert eng.read(dst.tensor, str(path), 4096) == MiB
            stats = eng.stats()
        assert bytes(dst.tensor.numpy()) == data
        assert stats["direct_bytes"] > 0, f"aligned direct='on' I/O moved no direct bytes: {stats}"
    finally:
        pool.close()


@pytest.mark.gpu
def test_pinned_tensor_round_trip(tmp_path):
    src = torch.arange(10000, dtype=torch.float32).pin_memory()
    dst = torch.empty_like(src).pin_memory()
    path = tmp_path / "pinned.bin"
    with IOEngine() as eng:
        assert eng.write(src, str(path), 1) == 40000
        assert eng.read(dst, str(path), 1) == 40000
    assert torch.equal(src, dst)


# -------------------------------------------------------------------------------------------- bad arguments

ENGINES = [IOEngine, SerialEngine]


@pytest.mark.parametrize("engine_cls", ENGINES)
def test_negative_offset_raises_value_error(tmp_path, engine_cls):
    path = tmp_path / "x.bin"
    with engine_cls() as eng:
        with pytest.raises(ValueError, match="offset"):
            eng.pread(bytearray(10), str(path), -1)
        with pytest.raises(ValueError, match="offset"):
            eng.pwrite(b"0123456789", str(path), -4096)
    assert not path.exists(), "a rejected pwrite must not touch the file"


@pytest.mark.parametrize("engine_cls", ENGINES)
def test_nbytes_larger_than_buffer_raises_value_error(tmp_path, engine_cls):
    path = tmp_path / "x.bin"
    path.write_bytes(bytes(100))
    with engine_cls() as eng:
        with pytest.raises(ValueError, match="nbytes"):
            eng.pread(bytearray(10), str(path), nbytes=11)
        with pytest.raises(ValueError, match="nbytes"):
            eng.pwrite(torch.zeros(2, dtype=torch.float32), str(path), nbytes=9)
        with pytest.raises(ValueError, match="nbytes"):
            eng.pwrite(b"abc", str(path), nbytes=-1)
    assert path.read_bytes() == bytes(100)


@pytest.mark.parametrize("engine_cls", ENGINES)
@pytest.mark.parametrize(
    "make", [lambda: torch.zeros(64, 64).t(), lambda: torch.zeros(128)[::2]], ids=["transposed", "strided"]
)
def test_non_contiguous_tensor_raises_type_error_naming_contiguous(tmp_path, engine_cls, make):
    t = make()
    assert not t.is_contiguous()
    with engine_cls() as eng:
        with pytest.raises(TypeError, match="contiguous"):
            eng.pread(t, str(tmp_path / "x.bin"))
        with pytest.raises(TypeError, match="contiguous"):
            eng.pwrite(t, str(tmp_path / "x.bin"))


@pytest.mark.parametrize("engine_cls", ENGINES)
def test_non_contiguous_numpy_array_is_rejected(tmp_path, engine_cls):
    arr = np.zeros((64, 64), dtype=np.float32)[:, ::2]
    with engine_cls() as eng:
        with pytest.raises((TypeError, ValueError), match="contiguous"):
            eng.pread(arr, str(tmp_path / "x.bin"))


def _readonly_numpy() -> np.ndarray:
    arr = np.zeros(16, dtype=np.uint8)
    arr.flags.writeable = False
    return arr


@pytest.mark.parametrize("engine_cls", ENGINES)
@pytest.mark.parametrize(
    "make",
    [lambda: bytes(16), lambda: memoryview(bytes(16)), _readonly_numpy],
    ids=["bytes", "readonly-memoryview", "readonly-numpy"],
)
def test_read_only_buffer_for_pread_raises_type_error_naming_fix(tmp_path, engine_cls, make):
    path = tmp_path / "x.bin"
    path.write_bytes(bytes(range(16)))
    with engine_cls() as eng:
        with pytest.raises(TypeError) as info:
            eng.pread(make(), str(path))
    msg = str(info.value).lower()
    assert "writ" in msg or "bytearray" in msg, f"message should say to pass a writable buffer: {msg}"


@pytest.mark.parametrize("engine_cls", ENGINES)
@pytest.mark.parametrize("bad", [[1, 2, 3], "text", 12345], ids=["list", "str", "int"])
def test_unsupported_buffer_type_raises_type_error(tmp_path, engine_cls, bad):
    with engine_cls() as eng:
        with pytest.raises(TypeError):
            eng.pread(bad, str(tmp_path / "x.bin"))
        with pytest.raises(TypeError):
            eng.pwrite(bad, str(tmp_path / "x.bin"))


@pytest.mark.gpu
@pytest.mark.parametrize("engine_cls", ENGINES)
def test_cuda_tensor_raises_type_error_naming_cpu(tmp_path, engine_cls):
    t = torch.zeros(16, device="cuda")
    with engine_cls() as eng:
        with pytest.raises(TypeError) as info:
            eng.pread(t, str(tmp_path / "x.bin"))
        assert "cpu" in str(info.value).lower()
        with pytest.raises(TypeError) as info:
            eng.pwrite(t, str(tmp_path / "x.bin"))
        assert "cpu" in str(info.value).lower()


# ------------------------------------------------------------------------------------------------ futures


def test_future_result_done_exception(tmp_path):
    path = tmp_path / "f.bin"
    with IOEngine(IOConfig(threads=2)) as eng:
        fut = eng.pwrite(payload(5000), str(path), 3)
        assert isinstance(fut, io_engine.IOFuture)
        assert fut.result(timeout=TIMEOUT) == 5000
        assert fut.done()
        assert fut.exception() is None
        assert fut.result() == 5000, "result() may be called again"


def test_future_exception_returns_the_error_without_raising(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(100))
    with IOEngine(IOConfig(threads=2, direct="off")) as eng:
        fut = eng.pread(bytearray(4096), str(path))
        with pytest.raises(ShortReadError):
            fut.result(timeout=TIMEOUT)
        assert fut.done()
        exc = fut.exception()
        assert isinstance(exc, ShortReadError)


def test_add_done_callback_is_called_once_with_the_future(tmp_path):
    path = tmp_path / "cb.bin"
    calls: list = []
    fired = threading.Event()

    def cb(f):
        calls.append(f)
        fired.set()

    with IOEngine(IOConfig(threads=2)) as eng:
        fut = eng.pwrite(payload(70000), str(path))
        fut.add_done_callback(cb)
        assert fired.wait(TIMEOUT)
        assert fut.result(timeout=TIMEOUT) == 70000
        # Added after completion: still called (at once).
        late = threading.Event()
        fut.add_done_callback(lambda f: late.set())
        assert late.wait(TIMEOUT)
        eng.flush()
    assert calls == [fut]


def test_callback_sees_failures_too(tmp_path):
    fired = threading.Event()
    seen: list = []

    def cb(f):
        seen.append(f.exception())
        fired.set()

    with IOEngine(IOConfig(threads=2)) as eng:
        fut = eng.pread(bytearray(10), str(tmp_path / "missing.bin"))
        fut.add_done_callback(cb)
        assert fired.wait(TIMEOUT)
    assert isinstance(seen[0], OSError)


def test_pending_future_times_out_then_completes(tmp_path, stall):
    path = tmp_path / "src.bin"
    data = payload(8192, seed=11)
    path.write_bytes(data)
    gate = stall(8192)
    calls: list = []
    eng = IOEngine(IOConfig(threads=1, direct="off"))
    try:
        fut = eng.pread(gate.mm, str(path))
        fut.add_done_callback(calls.append)
        with pytest.raises(TimeoutError):
            fut.result(timeout=0.2)
        assert not fut.done()
        assert calls == [], "a done-callback ran before the request finished"
        gate.release()
        assert fut.result(timeout=TIMEOUT) == 8192
        assert fut.done() and fut.exception() is None
    finally:
        gate.release()
        run_bounded(eng.close)
    assert calls == [fut]
    assert gate.mm[:] == data


def test_flush_waits_for_a_pending_request(tmp_path, stall):
    path = tmp_path / "src.bin"
    path.write_bytes(payload(8192))
    gate = stall(8192)
    eng = IOEngine(IOConfig(threads=2, direct="off"))
    try:
        fut = eng.pread(gate.mm, str(path))
        wfut = eng.pwrite(b"w" * 100, str(tmp_path / "other.bin"))
        returned = threading.Event()
        flusher = threading.Thread(target=lambda: (eng.flush(), returned.set()), daemon=True)
        flusher.start()
        # A correct flush() cannot return while the read is held; a broken one returns at once.
        assert not returned.wait(0.3), "flush() returned while a request was still pending"
        assert not fut.done()
        gate.release()
        assert returned.wait(TIMEOUT), "flush() did not return after the request finished"
        assert fut.done() and wfut.done()
        assert fut.result(timeout=0) == 8192
    finally:
        gate.release()
        run_bounded(eng.close)


def test_close_waits_for_a_pending_request(tmp_path, stall):
    path = tmp_path / "src.bin"
    data = payload(4096, seed=12)
    path.write_bytes(data)
    gate = stall(4096)
    eng = IOEngine(IOConfig(threads=1, direct="off"))
    fut = eng.pread(gate.mm, str(path))
    closer = threading.Thread(target=eng.close, daemon=True)
    closer.start()
    try:
        closer.join(0.3)
        # Either close() waits for the request, or it fails it; it must not leave it pending forever.
        gate.release()
        closer.join(TIMEOUT)
        assert not closer.is_alive(), "close() hung"
        assert fut.done(), "close() returned with a request still pending"
    finally:
        gate.release()
    if fut.exception() is None:
        assert fut.result() == 4096 and gate.mm[:] == data


def test_many_requests_in_flight_need_few_file_descriptors(tmp_path, stall):
    # The single worker is held by the first read, so the next 300 requests are all in flight at once.
    # How many may be in flight is queue_depth's business; it must not be bounded by RLIMIT_NOFILE
    # (1024 by default on most Linux systems), so the test allows only 128 descriptors more than now.
    path = tmp_path / "src.bin"
    data = payload(8 * 4096, seed=13)
    path.write_bytes(data)
    gate = stall(4096)
    n = 300
    outs = [bytearray(4096) for _ in range(n)]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    eng = IOEngine(IOConfig(threads=1, block_size=4096, queue_depth=1024, direct="off"))
    futs = []
    try:
        first = eng.pread(gate.mm, str(path))
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 128, hard))
        try:
            futs = [eng.pread(outs[i], str(path), (i % 8) * 4096) for i in range(n)]
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    finally:
        gate.release()
    assert first.result(timeout=TIMEOUT) == 4096
    errors = []
    for i, fut in enumerate(futs):
        try:
            fut.result(timeout=TIMEOUT)
        except TimeoutError:
            raise AssertionError(f"request {i} never finished") from None
        except OSError as exc:
            errors.append((i, exc))
    run_bounded(eng.close)
    assert not errors, f"{len(errors)} of {n} in-flight requests failed, first: {errors[0][1]!r}"
    for i in range(n):
        assert outs[i] == data[(i % 8) * 4096 : (i % 8 + 1) * 4096]


def test_done_callback_may_submit_more_io(tmp_path, stall):
    # Chaining (read, then write from the callback) is the obvious use of add_done_callback. The
    # callback must be able to submit even when the engine's queue is small.
    src = tmp_path / "src.bin"
    src.write_bytes(payload(4096, seed=14))
    dst = tmp_path / "dst.bin"
    data = payload(4 * 4096, seed=15)
    gate = stall(4096)
    eng = IOEngine(IOConfig(threads=1, block_size=4096, queue_depth=1, direct="off"))
    box: dict = {}
    submitted = threading.Event()

    def chain(_fut):
        try:
            box["fut"] = eng.pwrite(data, str(dst))  # four tasks through a queue of one
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc
        submitted.set()

    try:
        first = eng.pread(gate.mm, str(src))
        first.add_done_callback(chain)
    finally:
        gate.release()
    assert submitted.wait(10), "a done-callback that submits I/O deadlocked the engine"
    assert "error" not in box, box.get("error")
    assert box["fut"].result(timeout=TIMEOUT) == len(data)
    run_bounded(eng.close)
    assert dst.read_bytes() == data


def test_ctrl_c_while_waiting_for_queue_room_strands_nothing(tmp_path, stall):
    # A benchmark or a save interrupted by Ctrl-C: the KeyboardInterrupt lands in a submit that waits for
    # queue room. close() on the way out must then finish what was queued and return, not wait forever
    # for a request that was never queued. A handler that holds Ctrl-C around a submit sees the wait by
    # waiting_for_room(), which lets it stop the wait.
    path = tmp_path / "src.bin"
    path.write_bytes(payload(3 * 4096, seed=16))
    gate = stall(4096)
    eng = IOEngine(IOConfig(threads=1, block_size=4096, queue_depth=1, direct="off"))
    first = eng.pread(gate.mm, str(path))  # the only worker blocks on the stalled buffer
    assert wait_until(lambda: eng._queued == 0), "the worker never took the first task"
    second = eng.pread(bytearray(4096), str(path), 4096)  # fills the queue
    waiting = []

    def ctrl_c(*_):
        waiting.append(io_engine.waiting_for_room())
        raise KeyboardInterrupt

    assert not io_engine.waiting_for_room()
    previous = signal.signal(signal.SIGALRM, ctrl_c)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(KeyboardInterrupt):
            eng.pread(bytearray(4096), str(path), 8192)  # waits for room until the "Ctrl-C"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        gate.release()
    assert waiting == [True] and not io_engine.waiting_for_room()
    assert first.result(timeout=TIMEOUT) == 4096 and second.result(timeout=TIMEOUT) == 4096
    run_bounded(eng.close)
    assert eng.stats()["requests"] == 2


def _press_at(n: int, skip: object):
    """A profile function raising KeyboardInterrupt at the ``n``-th place a Ctrl-C can land: Python runs a signal's
    handler as a function starts (a "call") and as a builtin returns (a "c_return"); ``skip``: the caller's code."""
    seen = [0]

    def prof(frame, event, arg):
        if event in ("call", "c_return") and frame.f_code is not skip:
            seen[0] += 1
            if seen[0] == n:
                raise KeyboardInterrupt

    return prof, seen


def _lock_free(eng: IOEngine) -> bool:
    if not eng._idle.acquire(timeout=TIMEOUT):
        return False
    eng._idle.release()
    return True


@pytest.mark.parametrize("nbytes", [3 * 4096, 0], ids=["three-tasks", "empty"])
def test_a_ctrl_c_anywhere_in_a_submit_leaves_close_nothing_to_wait_for(tmp_path, nbytes):
    """A Ctrl-C landing in pwrite after its request was counted and before its tasks were queued (in opening the
    file, in planning the tasks, between two tasks queued) left a request counted that no thread would ever finish:
    close() then waited for ever (a save's exit hung until a second press). Each place a press can land is tried:
    the request is either queued whole and lands, or leaves nothing behind (no count, no reference on its file, the
    engine's lock free); close() returns either way."""
    path, data = tmp_path / "w.bin", payload(nbytes, seed=18)
    skip = test_a_ctrl_c_anywhere_in_a_submit_leaves_close_nothing_to_wait_for.__code__
    pressed = 0
    for n in range(1, 5000):  # bounded: a submit has a few hundred such places
        path.unlink(missing_ok=True)
        eng = IOEngine(IOConfig(threads=1, block_size=4096, direct="off"))
        prof, seen = _press_at(n, skip)
        fut = None
        sys.setprofile(prof)
        try:
            fut = eng.pwrite(data, str(path))
        except KeyboardInterrupt:
            pressed += 1
        finally:
            sys.setprofile(None)
        assert run_bounded(lambda e=eng: _lock_free(e)), n  # another thread: a press left the lock held by this one
        run_bounded(eng.close)
        assert eng._pending == 0 and eng._queued == 0, n
        assert all(h.refs == 0 for h in eng._files._handles.values()), n  # no file left open for a lost request
        if fut is not None:
            assert fut.result(timeout=0) == nbytes, n
        if fut is not None or (path.exists() and path.stat().st_size == nbytes):
            assert path.read_bytes() == data, n
        if seen[0] < n:  # the whole submit ran before the press: every place was tried
            break
    assert 10 < pressed == n - 1


def _fds_naming(path: Path) -> list[str]:
    """This process's descriptors open on ``path`` (a descriptor read while listing is not one of them)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                found.append(fd)
        except OSError:
            pass
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd to list open descriptors")
@pytest.mark.parametrize("direct", ["auto", "off"])
def test_a_ctrl_c_while_a_submit_opens_its_file_leaves_no_descriptor_open(tmp_path, direct):
    """A Ctrl-C landing after the file's first descriptor was opened and before the engine held it (between the
    O_DIRECT open and the buffered one, at the fstat, as the handle was made) left that descriptor open for the rest
    of the process: a program that a user interrupted and resumed ran out of descriptors, and kept deleted files'
    space. Each place a press can land is tried but one (handles.py says why: as os.open returns, before its number
    is kept); once close() returns, no descriptor names the file."""
    path, data = tmp_path / "w.bin", payload(3 * 4096, seed=19)
    path.write_bytes(b"")
    skip = test_a_ctrl_c_while_a_submit_opens_its_file_leaves_no_descriptor_open.__code__
    for n in range(1, 5000):  # bounded: a submit has a few hundred such places
        eng = IOEngine(IOConfig(threads=1, block_size=4096, direct=direct))
        press, seen = _press_at(n, skip)

        def prof(frame, event, arg, press=press):
            if not (event == "c_return" and arg is os.open):
                press(frame, event, arg)

        sys.setprofile(prof)
        try:
            eng.pwrite(data, str(path))
        except KeyboardInterrupt:
            pass
        finally:
            sys.setprofile(None)
        run_bounded(eng.close)
        left = _fds_naming(path)
        for fd in left:  # so that one press's leak does not hide behind the next
            os.close(int(fd))
        assert not left, n
        if seen[0] < n:  # the whole submit ran before the press: every place was tried
            break
    assert seen[0] < n


SUBMITS = ["threads"] if unavailable_reason() else ["threads", "aio"]


@pytest.mark.parametrize("submit", SUBMITS)
def test_a_ctrl_c_while_close_waits_leaves_the_next_close_to_stop_the_workers(tmp_path, stall, submit):
    """A Ctrl-C while close() waited for the writes in flight (a disk that stalls) left the engine reading closed
    with its threads never told to stop: every later close(), the one at exit too, returned at once, and the threads
    ran on for the rest of the process, the writes racing whatever the caller did next. The interrupt still
    propagates at once; the engine refuses new requests, and the next close() waits for the writes and stops the
    threads."""
    stalled, queued = tmp_path / "stalled.bin", tmp_path / "queued.bin"
    stalled.write_bytes(b"\xff" * 4096)
    data = payload(4096, seed=17)
    gate = stall(4096)  # reads as zeros once released
    eng = IOEngine(IOConfig(threads=1, direct="off", submit=submit))
    first = eng.pwrite(gate.mm, str(stalled))  # the only synchronous worker blocks reading the stalled buffer
    second = eng.pwrite(data, str(queued))  # queued behind it
    main = threading.get_ident()

    def press():  # once close() has begun (it then waits for both writes, held by the stalled buffer)
        if wait_until(lambda: eng._closed):
            signal.pthread_kill(main, signal.SIGINT)

    presser = threading.Thread(target=press, daemon=True)
    presser.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            eng.close()
        presser.join(TIMEOUT)
        assert not first.done() and not second.done()
        with pytest.raises(EngineClosedError):
            eng.pwrite(data, str(queued))
    finally:
        gate.release()
    run_bounded(eng.close)
    assert [t.name for t in threading.enumerate() if t in eng._workers] == []
    assert first.result(timeout=0) == 4096 and second.result(timeout=0) == 4096
    assert stalled.read_bytes() == bytes(4096) and queued.read_bytes() == data
    eng.close()  # closing again is harmless


CLOSE_INTERRUPTED = """
import atexit, os, signal, sys, threading
sys.path.insert(0, {tests!r})
from helpers import wait_until
from io_engine import IOConfig, IOEngine

entered, release = threading.Event(), threading.Event()
real_run = IOEngine._run
def stalled_run(self, task):  # the write waits for the script, as on a disk that stalls
    entered.set()
    assert release.wait(60)
    real_run(self, task)
IOEngine._run = stalled_run

eng = IOEngine(IOConfig(threads=2, direct="off"))
fut = eng.pwrite(b"w" * 4096, {path!r})
assert entered.wait(60)
def press():
    if wait_until(lambda: eng._closed):
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
threading.Thread(target=press, daemon=True).start()
try:
    eng.close()
    print("close returned")
except KeyboardInterrupt:
    print("interrupted")
workers = list(eng._workers)
# atexit runs after io_engine's exit hook (at the main thread's end): what that close left running
atexit.register(lambda: print("alive after the exit's close:", sum(t.is_alive() for t in workers)))
release.set()
"""


def test_a_ctrl_c_while_close_waits_leaves_the_exit_to_stop_the_workers(tmp_path):
    """The same Ctrl-C, and the program then ends: the close at exit returned at once (the engine read closed), so
    the threads were never stopped nor the write waited for. Now the exit's close does both."""
    path = tmp_path / "w.bin"
    proc = run_script(CLOSE_INTERRUPTED.format(tests=os.path.join(REPO, "tests"), path=str(path)), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["interrupted", "alive after the exit's close: 0"], proc.stdout + proc.stderr
    assert path.read_bytes() == b"w" * 4096


def test_await_yields_to_the_event_loop(tmp_path, stall):
    path = tmp_path / "src.bin"
    path.write_bytes(payload(4096))
    gate = stall(4096)
    eng = IOEngine(IOConfig(threads=1, direct="off"))
    try:

        async def main():
            fut = eng.pread(gate.mm, str(path))

            async def other():
                await asyncio.sleep(0)
                gate.release()  # runs only if awaiting the future left the loop free
                return "ran"

            return tuple(await asyncio.gather(fut, other()))

        assert run_bounded(lambda: asyncio.run(main())) == (4096, "ran")
    finally:
        gate.release()
        run_bounded(eng.close)


def test_futures_are_awaitable_in_asyncio(tmp_path):
    path = tmp_path / "a.bin"
    chunks = [payload(12345, seed=i) for i in range(8)]
    outs = [bytearray(12345) for _ in range(8)]

    with IOEngine(IOConfig(threads=4)) as eng:

        async def main():
            written = [await eng.pwrite(c, str(path), i * 12345) for i, c in enumerate(chunks)]
            reads = [eng.pread(outs[i], str(path), i * 12345) for i in range(8)]
            gathered = await asyncio.gather(*reads)
            return written, list(gathered)

        written, gathered = asyncio.run(main())
    assert written == [12345] * 8
    assert gathered == [12345] * 8
    assert outs == [bytearray(c) for c in chunks]


def test_awaiting_a_failed_future_raises_in_the_coroutine(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(10))
    with IOEngine(IOConfig(threads=2, direct="off")) as eng:

        async def main():
            with pytest.raises(ShortReadError):
                await eng.pread(bytearray(100), str(path))
            return "ok"

        assert asyncio.run(main()) == "ok"


# -------------------------------------------------------------------------------------------------- stats


@pytest.mark.parametrize("engine_cls", ENGINES)
def test_stats_count_bytes_and_requests(tmp_path, engine_cls):
    path = tmp_path / "s.bin"
    with engine_cls(IOConfig(direct="off", threads=2)) as eng:
        eng.write(payload(10000), str(path))
        eng.write(payload(5000), str(path), 10000)
        eng.read(bytearray(7000), str(path), 1)
        stats = eng.stats()
    assert {"bytes_read", "bytes_written", "requests", "direct_bytes", "buffered_bytes"} <= set(stats)
    assert stats["bytes_written"] == 15000
    assert stats["bytes_read"] == 7000
    assert stats["requests"] >= 3
    assert stats["direct_bytes"] == 0, "direct='off' moves no direct bytes"
    assert stats["buffered_bytes"] == 22000


@pytest.mark.parametrize("direct", ["off", "auto"])
def test_a_held_file_is_read_whatever_is_renamed_over_its_path(tmp_path, direct):
    # A checkpoint's reader holds the files it opened with their manifest: a new file renamed over the path (and the
    # old one unlinked) must not change what it reads, where a path alone is reopened at the new file.
    path, new = tmp_path / "row.bin", tmp_path / "new.bin"
    old_bytes = payload(3 * 4096, seed=1)
    path.write_bytes(old_bytes)
    new.write_bytes(payload(3 * 4096, seed=2))
    fd = os.open(path, os.O_RDONLY)
    old_inode = os.fstat(fd).st_ino
    with IOEngine(IOConfig(threads=2, direct=direct)) as eng:
        eng.hold(str(path), fd)
        os.close(fd)  # the engine keeps its own duplicate
        first = bytearray(4096)
        assert eng.pread(first, str(path), 0).result(timeout=TIMEOUT) == 4096
        os.rename(new, path)  # the old file is unlinked now: only the held descriptors reach it
        rest = bytearray(2 * 4096)
        assert eng.pread(rest, str(path), 4096).result(timeout=TIMEOUT) == 2 * 4096
        assert bytes(first + rest) == old_bytes
    assert old_inode not in _open_inodes()  # close() gave the held descriptors back


def _open_inodes() -> set[int]:
    out = set()
    for f in os.listdir("/proc/self/fd"):
        try:
            out.add(os.stat(f"/proc/self/fd/{f}").st_ino)
        except OSError:
            pass
    return out
