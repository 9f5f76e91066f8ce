"""Yardsticks measured in the same run as the io sweep (only a ratio from one run means anything: the
disks we measure drift 20-40 % between runs, README.md "Reading the figures").

- fio: what the disk can do (libaio, O_DIRECT, iodepth 32, each of the sweep's block sizes). Skipped,
  with a note, when fio is not installed or the sweep could not use O_DIRECT.
- aiofiles: what asyncio users reach for: the usual ``await f.read(n)`` / ``await f.write(b)`` loop on
  the same file, n the best block size of our sweep; its writes go through the page cache into a fresh
  file, so their fsync is timed with them (it is what reaches the disk). Asked for with --aiofiles; skipped,
  with a note, when aiofiles is not importable.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from .common import BenchFailure, Stat, gbps, progress
from .files import drop_cache
from .io_types import AiofilesResult, FioResult, IoResult
from .workspace import Workspace

FIO_IODEPTH = 32  # a deep libaio queue: the fio rows of bench/RESULTS.md were measured at 32
FIO_TIMEOUT_S = 600


def run_baselines(
    res: IoResult, ref: Path, *, loops: int, fio: bool, aiofiles: bool, ws: Workspace, show_progress: bool
) -> None:
    """Fill `res.fio` / `res.aiofiles` (or add a note saying why not). `ref` is a file of
    `res.size_bytes` written by the sweep's best configuration, for the read runs."""
    if fio:
        res.fio = _fio_or_note(res, ref, loops, ws, show_progress)
    if aiofiles:
        res.aiofiles = _aiofiles_or_note(res, ref, loops, ws, show_progress)


def passes(*, fio: bool, aiofiles: bool, direct: bool, loops: int, blocks: int) -> int:
    """The file passes (one written and one read) the baselines will run: none for one that is missing or
    cannot apply, so that the sweep neither writes their file nor counts their time for nothing."""
    n = loops * blocks if fio and direct and shutil.which("fio") else 0
    if aiofiles and importlib.util.find_spec("aiofiles") is not None:
        n += loops
    return n


# ---------------------------------------------------------------------------------------------- fio
def _fio_or_note(res: IoResult, ref: Path, loops: int, ws: Workspace, show_progress: bool) -> FioResult | None:
    fio = shutil.which("fio")
    if fio is None:
        res.notes.append("fio not found: install it (e.g. apt-get install fio) for the ours/fio comparison")
        return None
    if not res.direct_effective:
        res.notes.append("fio skipped: the comparison is made with O_DIRECT only, which this folder refuses")
        return None
    version = subprocess.run([fio, "--version"], capture_output=True, text=True).stdout.strip()
    blocks = sorted({row.block_size for row in res.sweep})
    reads: dict[int, Stat] = {}
    writes: dict[int, Stat] = {}
    try:
        with progress(len(blocks) * loops * 2, "fio", enabled=show_progress, unit="run") as bar:
            for bs in blocks:
                r, w = [], []
                for _ in range(loops):
                    r.append(_fio_job(fio, "read", ref, bs, res.size_bytes))
                    bar.update(1)
                    w.append(_fio_job(fio, "write", ref, bs, res.size_bytes))  # an overwrite, like our sweep's
                    bar.update(1)
                reads[bs], writes[bs] = Stat.of(r), Stat.of(w)
    except (BenchFailure, subprocess.TimeoutExpired, ValueError, KeyError) as e:  # ValueError: no JSON out
        res.notes.append(f"no fio row: {e}")  # our own figures stand on their own
        return None
    rb = max(blocks, key=lambda b: reads[b].median)
    wb = max(blocks, key=lambda b: writes[b].median)
    return FioResult(
        version=version,
        ioengine="libaio",
        iodepth=FIO_IODEPTH,
        read_block_size=rb,
        read_gbps=reads[rb],
        write_block_size=wb,
        write_gbps=writes[wb],
        ours_over_fio_read=round(res.best_read.read_gbps / reads[rb].median, 3),
        ours_over_fio_write=round(res.best_write.write_gbps / writes[wb].median, 3),
    )


def _fio_job(fio: str, rw: str, path: Path, bs: int, size: int) -> float:
    """One fio job; GB/s from fio's own bw_bytes. O_DIRECT and no fsync, as our sweep times its writes (it
    times the fsync apart)."""
    cmd = [
        fio, "--name=tiered-bench", f"--filename={path}", f"--rw={rw}", f"--bs={bs}", f"--size={size}",
        "--direct=1", "--ioengine=libaio", f"--iodepth={FIO_IODEPTH}", "--numjobs=1", "--output-format=json",
    ]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=FIO_TIMEOUT_S)
    if p.returncode != 0:
        raise BenchFailure(f"fio failed ({' '.join(cmd)}): {p.stderr.strip()[-500:]}")
    # fio may print warnings before the JSON document
    job = json.loads(p.stdout[p.stdout.index("{") :])["jobs"][0]
    return job[rw]["bw_bytes"] / 1e9


# ----------------------------------------------------------------------------------------- aiofiles
def _aiofiles_or_note(
    res: IoResult, ref: Path, loops: int, ws: Workspace, show_progress: bool
) -> AiofilesResult | None:
    try:
        import aiofiles  # noqa: F401
    except ImportError:
        res.notes.append("aiofiles is not installed (pip install aiofiles): no aiofiles row")
        return None
    bs = res.best_read.block_size
    size = res.size_bytes
    reads, writes = [], []
    with progress(loops * 2, "aiofiles", enabled=show_progress, unit="run") as bar:
        for i in range(loops):
            drop_cache(ref)  # aiofiles goes through the page cache: make it read the disk
            reads.append(gbps(size, asyncio.run(_aio_read(ref, bs))))
            bar.update(1)
            fresh = ws.path(f"aiofiles-{i}.bin")
            try:
                writes.append(gbps(size, asyncio.run(_aio_write(fresh, bs, size))))
            finally:
                fresh.unlink(missing_ok=True)
            bar.update(1)
    r, w = Stat.of(reads), Stat.of(writes)
    return AiofilesResult(
        block_size=bs,
        read_gbps=r,
        write_gbps=w,
        aiofiles_over_ours_read=round(r.median / res.best_read.read_gbps, 3),
        aiofiles_over_ours_write=round(w.median / res.best_write.write_gbps, 3),
    )


async def _aio_read(path: Path, n: int) -> float:
    import aiofiles

    t0 = time.perf_counter()
    async with aiofiles.open(path, "rb") as f:
        while await f.read(n):
            pass
    return time.perf_counter() - t0


async def _aio_write(path: Path, n: int, size: int) -> float:
    import aiofiles

    data = (os.urandom(1 << 20) * (n // (1 << 20) + 1))[:n]  # one n-byte object, reused every call
    t0 = time.perf_counter()
    async with aiofiles.open(path, "wb") as f:
        for off in range(0, size, n):
            await f.write(data if size - off >= n else data[: size - off])
        await f.flush()
        os.fsync(f.fileno())  # our write figure includes the fsync: so must this one
    return time.perf_counter() - t0
