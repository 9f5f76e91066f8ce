"""Sequential read/write bandwidth through io_engine: the sweep behind `tiered-bench io` and `tune`.

How one configuration is measured (perf.md, "How to measure"):
- every iteration writes a *fresh* file (preallocated untimed, as fio lays out its files), fsyncs it
  inside the timed region, drops its cached pages, then reads it back; so neither the page cache nor
  an already-warm file can flatter the figure;
- O_DIRECT unless the filesystem refuses it (tmpfs), which the result states in a note;
- `warmup` untimed iterations, then `loops` timed ones: the median and the spread are reported;
- requests of `request_bytes` stream through a ring of reused page-aligned (pinned on CUDA hosts)
  buffers with enough of them in flight to keep every worker thread busy, as the optimizer's
  prefetch pipeline does; the engine splits each request into `block_size` tasks.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from io_engine import IOConfig, IOEngine, PinnedBufferPool, PooledBuffer, format_size

from . import baselines
from .common import BenchFailure, Stat, UsageError, gbps, progress
from .files import direct_supported, drop_cache, filesystem_of, preallocate
from .workspace import Workspace

PAGE = 4096
MIN_REQUEST = 64 << 20  # the optimizer's default chunk: large enough that per-request overhead vanishes
DEFAULT_DIR = "./tiered-bench-data"
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


@dataclass(kw_only=True)
class IoOptions:
    dir: str = DEFAULT_DIR
    size: int = 4 << 30
    block_sizes: tuple[int, ...] = (1 << 20, 4 << 20, 16 << 20)
    threads: tuple[int, ...] = (4, 8, 16)
    # In io_engine, `threads` is the kernel's queue depth (one synchronous call in flight per thread);
    # `queue_depth` only bounds the tasks waiting in the engine, so by default it is not swept.
    depths: tuple[int, ...] = (IOConfig().queue_depth,)
    direct: str = "auto"
    warmup: int = 1
    loops: int = 3
    validate: bool = False
    fio: bool = True
    aiofiles: bool = False
    progress: bool = True

    def configs(self) -> list[IOConfig]:
        """Every configuration of the sweep, validated by IOConfig itself (one boundary)."""
        if self.size < 1 << 20:
            raise UsageError(f"--size must be at least 1 MiB, got {self.size} bytes")
        if self.loops < 1 or self.warmup < 0:
            raise UsageError(f"--loops must be >= 1 and --warmup >= 0, got {self.loops} and {self.warmup}")
        if not (self.block_sizes and self.threads and self.depths):
            raise UsageError("--block-sizes, --threads and --depths each need at least one value")
        out = []
        for b in self.block_sizes:
            for t in self.threads:
                for d in self.depths:
                    try:
                        out.append(IOConfig(block_size=b, threads=t, queue_depth=d, direct=self.direct))
                    except ValueError as e:
                        raise UsageError(f"bad sweep value: {e}") from e
        return out


@dataclass
class SweepRow:
    block_size: int
    threads: int
    queue_depth: int
    read_gbps: Stat
    write_gbps: Stat
    validated: bool | None  # None: --validate was not asked


@dataclass
class Pick:
    """One configuration and its median figures."""

    block_size: int
    threads: int
    queue_depth: int
    read_gbps: float
    write_gbps: float

    @classmethod
    def of(cls, row: SweepRow) -> Pick:
        return cls(row.block_size, row.threads, row.queue_depth, row.read_gbps.median, row.write_gbps.median)


@dataclass
class IoResult:
    dir: str
    filesystem: str
    size_bytes: int
    request_bytes: int
    direct: str  # as asked: auto | on | off
    direct_effective: bool  # whether O_DIRECT was really used
    warmup: int
    loops: int
    sweep: list[SweepRow]
    best_read: Pick
    best_write: Pick
    # The config that reads and then writes the same bytes fastest (min 1/read + 1/write): what an
    # optimizer step does, so this is what `tune` writes and what `optim` computes its floor from.
    best: Pick
    config: dict[str, Any]
    fio: Any = None  # baselines.FioResult | None
    aiofiles: Any = None  # baselines.AiofilesResult | None
    notes: list[str] = field(default_factory=list)

    def best_config(self) -> IOConfig:
        return IOConfig.from_dict(self.config)


class Ring:
    """`slots` reusable request buffers from one pool; write slots hold a known pattern.

    The pattern is a random 1 MiB template repeated, with the first 8 bytes of every 4 KiB page
    stamped with that page's file offset when it is written: a read from a wrong offset, a torn
    block or a stale page all fail validation.
    """

    def __init__(self, pool: PinnedBufferPool, slots: int, request: int, *, pattern: bool):
        self.request = request
        self.buffers: list[PooledBuffer] = []
        try:
            for _ in range(slots):
                self.buffers.append(pool.acquire(request))
        except BaseException:
            self.release()
            raise
        if pattern:
            template = torch.empty(1 << 20, dtype=torch.uint8)
            template.random_(0, 256, generator=torch.Generator().manual_seed(1234))
            for b in self.buffers:
                for s in range(0, request, template.numel()):
                    n = min(template.numel(), request - s)
                    b.tensor[s : s + n].copy_(template[:n])

    def __len__(self) -> int:
        return len(self.buffers)

    def pages(self, slot: int, nbytes: int) -> torch.Tensor:
        return self.buffers[slot].tensor[:nbytes].view(torch.int64).view(-1, PAGE // 8)

    def stamp(self, slot: int, offset: int, nbytes: int) -> None:
        self.pages(slot, nbytes)[:, 0] = torch.arange(offset, offset + nbytes, PAGE, dtype=torch.int64)

    def release(self) -> None:
        # Every buffer must go back before the pool closes: a pinned buffer that is never released stays
        # page-locked, and CUDA refuses to register that address range again once it is reused.
        for b in self.buffers:
            b.release()

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def stream(engine: IOEngine, ring: Ring, path: Path, size: int, *, write: bool) -> float:
    """Move `size` bytes between `path` and the ring; returns seconds (a write includes its fsync)."""
    pending: deque = deque()
    t0 = time.perf_counter()
    for i, offset in enumerate(range(0, size, ring.request)):
        n = min(ring.request, size - offset)
        slot = i % len(ring)
        if len(pending) == len(ring):
            pending.popleft().result()  # the oldest request used this slot: wait before reusing it
        if write:
            ring.stamp(slot, offset, n)
            pending.append(engine.pwrite(ring.buffers[slot].tensor, path, offset, nbytes=n))
        else:
            pending.append(engine.pread(ring.buffers[slot].tensor, path, offset, nbytes=n))
    for fut in pending:
        fut.result()
    if write:
        engine.flush(path)
    return time.perf_counter() - t0


class ValidationError(BenchFailure):
    """Data read back differs from what was written."""


def validate(engine: IOEngine, written: Ring, scratch: PooledBuffer, path: Path, size: int) -> None:
    """Read `path` again (untimed) and compare every page with the pattern `written` put there."""
    for i, offset in enumerate(range(0, size, written.request)):
        n = min(written.request, size - offset)
        engine.read(scratch.tensor, path, offset, nbytes=n)
        got = scratch.tensor[:n].view(torch.int64).view(-1, PAGE // 8)
        want = written.pages(i % len(written), n)
        offsets = torch.arange(offset, offset + n, PAGE, dtype=torch.int64)
        if not (torch.equal(got[:, 0], offsets) and torch.equal(got[:, 1:], want[:, 1:])):
            bad = int(((got[:, 0] != offsets) | (got[:, 1:] != want[:, 1:]).any(dim=1)).nonzero()[0, 0])
            raise ValidationError(
                f"--validate: the data read back from {path} at offset {offset + bad * PAGE} differs from "
                f"what was written (block {engine.config.block_size}, threads {engine.config.threads})"
            )


def ring_shape(cfg: IOConfig, size: int) -> tuple[int, int]:
    """(request bytes, requests in flight): enough in flight that every thread always has a task."""
    request = min(size, max(MIN_REQUEST, cfg.block_size))
    inflight = max(2, math.ceil(cfg.threads * cfg.block_size / request) + 1)
    return request, min(inflight, math.ceil(size / request))


# -------------------------------------------------------------------------------------------- sweep
def measure_config(cfg: IOConfig, ws: Workspace, opts: IoOptions, size: int, tag: str, on_pass: Any = None) -> SweepRow:
    request, inflight = ring_shape(cfg, size)
    reads: list[float] = []
    writes: list[float] = []
    validated: bool | None = None
    # Exits run in reverse: the engine finishes its requests, then the buffers go back, then the pool closes.
    with (
        PinnedBufferPool(request * (2 * inflight + 1)) as pool,
        Ring(pool, inflight, request, pattern=True) as wring,
        Ring(pool, inflight, request, pattern=False) as rring,
        IOEngine(cfg) as engine,
    ):
        for it in range(opts.warmup + opts.loops):
            path = ws.path(f"{tag}-{it}.bin")
            preallocate(path, size)
            tw = stream(engine, wring, path, size, write=True)
            drop_cache(path)
            tr = stream(engine, rring, path, size, write=False)
            if it >= opts.warmup:
                writes.append(gbps(size, tw))
                reads.append(gbps(size, tr))
            if opts.validate and it == opts.warmup + opts.loops - 1:
                with pool.acquire(request) as scratch:
                    validate(engine, wring, scratch, path, size)
                validated = True
            path.unlink()
            if on_pass is not None:
                on_pass(gbps(size, tr), gbps(size, tw))
    return SweepRow(cfg.block_size, cfg.threads, cfg.queue_depth, Stat.of(reads), Stat.of(writes), validated)


def write_reference(cfg: IOConfig, path: Path, size: int) -> None:
    """An untimed file of `size` bytes for the baselines to read."""
    request, inflight = ring_shape(cfg, size)
    with (
        PinnedBufferPool(request * inflight) as pool,
        Ring(pool, inflight, request, pattern=True) as ring,
        IOEngine(cfg) as engine,
    ):
        preallocate(path, size)
        stream(engine, ring, path, size, write=True)
    drop_cache(path)


def run_io(opts: IoOptions, ws: Workspace) -> IoResult:
    """The sweep, then the baselines; `ws` is the caller's so that `optim` can share its folder."""
    configs = opts.configs()
    size = opts.size // PAGE * PAGE  # O_DIRECT wants whole pages; "300MB" is not one
    if opts.fio or opts.aiofiles:  # the baselines read one file while they write a fresh one
        ws.require_free(2 * size, f"two test files of {format_size(size)}: one to read, one fresh to write")
    else:
        ws.require_free(size, f"one test file of {format_size(size)} at a time")
    assert ws.dir is not None
    notes: list[str] = []
    fstype = filesystem_of(ws.dir)
    direct = opts.direct != "off" and direct_supported(ws.dir)
    if opts.direct == "on" and not direct:
        raise UsageError(
            f"--direct on: the {fstype} filesystem of {ws.root} refuses O_DIRECT. "
            "Use --direct auto (buffered fallback) or a folder on a real disk."
        )
    if opts.direct == "auto" and not direct:
        notes.append(f"O_DIRECT is not supported on {fstype} ({ws.root}): buffered I/O was measured")
    if fstype in MEMORY_FILESYSTEMS:
        notes.append(f"{ws.root} is on {fstype}, which keeps files in memory: these are memory figures, not a disk's")
    if opts.direct == "off":
        notes.append("--direct off: buffered I/O; each file's cached pages are dropped before it is read")
    run_cfgs = [c.replace(direct="on" if direct else "off") for c in configs]

    rows: list[SweepRow] = []
    passes = len(run_cfgs) * (opts.warmup + opts.loops)
    with progress(passes, "io sweep", enabled=opts.progress, unit="iter") as bar:
        for k, cfg in enumerate(run_cfgs):
            label = f"block {format_size(cfg.block_size)}, {cfg.threads} threads"
            bar.set_postfix_str(label)

            def on_pass(r: float, w: float, label: str = label) -> None:
                bar.update(1)
                bar.set_postfix_str(f"{label}: read {r:.2f} write {w:.2f} GB/s")

            rows.append(measure_config(cfg, ws, opts, size, f"io{k}", on_pass))

    best_read = max(rows, key=lambda r: r.read_gbps.median)
    best_write = max(rows, key=lambda r: r.write_gbps.median)
    best = min(rows, key=lambda r: 1 / max(r.read_gbps.median, 1e-9) + 1 / max(r.write_gbps.median, 1e-9))
    best_cfg = IOConfig(
        block_size=best.block_size, threads=best.threads, queue_depth=best.queue_depth, direct=opts.direct
    )
    res = IoResult(
        dir=str(ws.root),
        filesystem=fstype,
        size_bytes=size,
        request_bytes=ring_shape(best_cfg, size)[0],
        direct=opts.direct,
        direct_effective=direct,
        warmup=opts.warmup,
        loops=opts.loops,
        sweep=rows,
        best_read=Pick.of(best_read),
        best_write=Pick.of(best_write),
        best=Pick.of(best),
        config=best_cfg.to_dict(),
        notes=notes,
    )
    if opts.fio or opts.aiofiles:
        ref = ws.path("reference.bin")
        write_reference(run_cfgs[rows.index(best)], ref, size)
        try:
            baselines.run_baselines(
                res, ref, loops=opts.loops, fio=opts.fio, aiofiles=opts.aiofiles, ws=ws, show_progress=opts.progress
            )
        finally:
            ref.unlink(missing_ok=True)
    return res
