"""A direct write that extends its file allocates the range first (engine.py, posix.allocate): the bytes and the
size of every file stay those the serial twin writes, on a disk, on tmpfs and where nothing can be allocated."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
from helpers import TIMEOUT, small_tmpfs

import io_engine.handles as handles_module
from io_engine import IOConfig, IOEngine, SerialEngine
from io_engine.errors import IOEngineError
from io_engine.posix import allocate

MiB = 2**20

# (bytes already in the file, offset, nbytes): fresh files from the start, at an odd offset, odd sizes, a file
# written past a hole, and writes that overlap the file's end (part overwrite, part extension).
CASES = [
    (None, 0, 4 * MiB),
    (None, 0, 199),
    (None, 5000, 3 * MiB + 17),
    (None, 8192, 4096),
    (None, 2 * MiB, MiB + 4096),
    (6000, 4096, 2 * MiB),
    (3 * MiB, 3 * MiB - 4096, 8192 + 5),
    (MiB, 0, 512 * 1024),
]


def payload(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def allocatable(folder: Path) -> bool:
    probe = folder / ".allocate-probe"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        return allocate(fd, 0, 4096)
    finally:
        os.close(fd)
        probe.unlink()


def write_both(folder: Path, cfg: IOConfig) -> list[tuple[int, int]]:
    """Each case through IOEngine and SerialEngine into files of the same start; their bytes and sizes compared.
    Returns IOEngine's allocated_bytes after each case, and the bytes it wrote direct."""
    out = []
    with IOEngine(cfg) as eng, SerialEngine() as twin:
        for k, (before, offset, n) in enumerate(CASES):
            a, b = folder / f"engine{k}.bin", folder / f"twin{k}.bin"
            if before is not None:
                a.write_bytes(payload(before, seed=100 + k))
                b.write_bytes(payload(before, seed=100 + k))
            data = payload(n, seed=k)
            assert eng.pwrite(data, a, offset).result(timeout=TIMEOUT) == n
            twin.write(data, b, offset)
            eng.flush()
            assert a.stat().st_size == b.stat().st_size == max(before or 0, offset + n), (k, before, offset, n)
            assert a.read_bytes() == b.read_bytes(), f"case {k}: {before=} {offset=} {n=}"
            back = bytearray(n)
            assert eng.read(back, a, offset) == n and bytes(back) == data
            stats = eng.stats()
            out.append((stats["allocated_bytes"], stats["direct_bytes"]))
    return out


def test_extending_direct_writes_allocate_and_match_the_serial_twin(tmp_path):
    counts = write_both(tmp_path, IOConfig(block_size=64 * 1024, threads=8))
    if counts[-1][1] == 0:
        pytest.skip("tmp_path's filesystem refuses O_DIRECT: nothing goes direct, nothing is allocated")
    if allocatable(tmp_path):
        # A fresh 4 MiB file: all of it allocated ahead; a 199-byte file has no direct part, so nothing is.
        assert counts[0][0] == 4 * MiB and counts[1][0] == counts[0][0]
        # The write over the end of a 6000-byte file allocates only what lies past it; one inside, nothing.
        assert counts[5][0] - counts[4][0] == 4096 + 2 * MiB - 6000
        assert counts[7][0] == counts[6][0]
    else:
        assert counts[-1][0] == 0


def test_on_tmpfs_too(tmp_path):
    with small_tmpfs("64m") as folder:
        write_both(Path(folder), IOConfig(block_size=64 * 1024, threads=4))


def test_where_nothing_can_be_allocated_it_writes_as_before_and_asks_once(tmp_path, monkeypatch):
    calls = []

    def refuses(fd: int, offset: int, nbytes: int) -> bool:
        calls.append((offset, nbytes))
        return False  # the filesystem cannot (EOPNOTSUPP): nothing changed

    monkeypatch.setattr(handles_module, "allocate", refuses)
    counts = write_both(tmp_path, IOConfig(block_size=64 * 1024, threads=8))
    if counts[-1][1] == 0:
        pytest.skip("tmp_path's filesystem refuses O_DIRECT")
    assert len(calls) == 1 and counts[-1][0] == 0  # one refusal, then that filesystem is not asked again


def test_a_failed_allocation_fails_the_request_before_any_byte_lands(tmp_path, monkeypatch):
    def full(fd: int, offset: int, nbytes: int) -> bool:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(handles_module, "allocate", full)
    path = tmp_path / "full.bin"
    with IOEngine(IOConfig(block_size=64 * 1024, threads=4, direct="auto")) as eng:
        fut = eng.pwrite(payload(MiB, seed=1), path, 0)
        if eng.stats()["requests"] == 1:  # queued: the filesystem refuses O_DIRECT, no allocation was asked
            fut.result(timeout=TIMEOUT)
            pytest.skip("tmp_path's filesystem refuses O_DIRECT")
        with pytest.raises(IOEngineError) as info:
            fut.result(timeout=TIMEOUT)
        assert info.value.errno == errno.ENOSPC and info.value.path == str(path) and "disk is full" in str(info.value)
        assert path.stat().st_size == 0
        # Nothing was left pending: a buffered-only write (no allocation) and flush go through.
        assert eng.write(b"x" * 100, path, 0) == 100
        eng.flush()
    assert path.read_bytes() == b"x" * 100


def test_allocate_grows_the_file_and_refuses_nothing_it_cannot_do(tmp_path):
    path = tmp_path / "a.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        assert allocate(fd, 0, 0) is False  # nothing to allocate
        done = allocate(fd, 4096, 3 * 4096 + 5)
        assert os.fstat(fd).st_size == (4096 + 3 * 4096 + 5 if done else 0)
    finally:
        os.close(fd)
    if done:
        assert path.read_bytes() == bytes(4096 + 3 * 4096 + 5)  # allocated blocks read as zeros
