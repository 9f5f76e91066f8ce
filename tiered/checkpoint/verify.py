"""Verifying a checkpoint whole: every file read once, every CRC segment checked, every problem reported.

``verify_files(reader, io)`` reads each file of an opened checkpoint (reader.py) through the descriptors the
reader opened with its manifest, double-buffered: block i+1 is read while block i is checked. Used by
``verify_checkpoint`` and by a load with ``verify="first"``.
"""

from __future__ import annotations

import time
from typing import Any

from io_engine import IOConfig, IOEngine, IOFuture, PinnedBufferPool

from ..store.checksum import Checksummer
from .errors import CheckpointCorruptError
from .reader import CheckpointReader, SegmentChecker, _bytes

__all__ = ["VERIFY_BLOCK", "verify_files"]

VERIFY_BLOCK = 8 << 20  # bytes per read when verifying whole files: two in flight


def _check_file(eng: IOEngine, checker: SegmentChecker, path: str, nbytes: int, bufs: list[Any]) -> str | None:
    """Feed a whole file to ``checker``, double-buffered: block i+1 is read while block i is checked.
    Returns a problem text when the file cannot be read."""
    prev: tuple[int, int, Any, IOFuture] | None = None
    error = None
    for i, off in enumerate(range(0, nbytes, VERIFY_BLOCK)):
        n = min(VERIFY_BLOCK, nbytes - off)
        buf = bufs[i % 2]  # free: the block read into it two steps ago has been checked
        fut = eng.pread(buf.tensor, path, off, nbytes=n)
        if prev is not None:
            error = _check_block(checker, *prev)
        prev = (off, n, buf, fut)
        if error is not None:
            break
    if prev is not None:
        if error is None:
            error = _check_block(checker, *prev)
        else:
            prev[3].exception()  # let the read in flight land before the buffer is reused
    return error


def _check_block(checker: SegmentChecker, off: int, n: int, buf: Any, fut: IOFuture) -> str | None:
    try:
        fut.result()
    except OSError as e:
        return f"cannot be read ({e})"
    checker.add(off, _bytes(buf.tensor[:n]))
    return None


def verify_files(reader: CheckpointReader, io: IOConfig | None = None) -> dict[str, Any]:
    """Read every file of the checkpoint once and check every segment. Returns per-file figures; raises
    CheckpointCorruptError listing every problem found (missing, truncated, corrupted), not just the first."""
    problems = reader.size_problems()
    bad_files = {f for f, _ in problems}
    t0 = time.perf_counter()
    figures: dict[str, Any] = {}
    total = 0
    with (
        Checksummer() as crc,
        IOEngine(io if io is not None else IOConfig.from_env()) as eng,
        PinnedBufferPool(2 * VERIFY_BLOCK, pin=False) as pool,
    ):
        reader.hold(eng)
        bufs = [pool.acquire(VERIFY_BLOCK), pool.acquire(VERIFY_BLOCK)]
        for name, entry in reader.manifest.files.items():
            path = reader.file(name)
            if path in bad_files:
                continue
            checker = SegmentChecker(path, entry, crc)
            t1 = time.perf_counter()
            error = _check_file(eng, checker, path, entry.nbytes, bufs)
            if error is not None:
                problems.append((path, error))
                continue
            problems += checker.finish()
            total += entry.nbytes
            figures[name] = {
                "nbytes": entry.nbytes,
                "crc32": f"{entry.crc32:#010x}",
                "segments": len(entry.segments),
                "seconds": round(time.perf_counter() - t1, 4),
            }
        for b in bufs:
            b.release()
    if problems:
        raise CheckpointCorruptError(reader.path, problems)
    dt = time.perf_counter() - t0
    return {
        "ok": True,
        "path": reader.path,
        "bytes": total,
        "seconds": round(dt, 4),
        "gbps": round(total / max(dt, 1e-9) / 1e9, 3),
        "files": figures,
    }
