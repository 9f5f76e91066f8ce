"""A ring of reusable request buffers, and a file streamed through it: the primitive of every disk figure.

`stream(engine, ring, path, size, write=...)` moves `size` bytes between a file and the ring, keeping
`len(ring)` requests in flight, as the optimizer's read-ahead does; `ring_shape` says how many that takes to
keep every engine thread busy. The io sweep (disk.py), the read/write overlap test (mixed.py) and the
Llama benchmark's disk floor all measure with these. Call order::

    with PinnedBufferPool(...) as pool, Ring(pool, slots, request, pattern=True) as ring, IOEngine(cfg) as eng:
        seconds = stream(eng, ring, path, size, write=True)
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path

import torch

from io_engine import IOConfig, IOEngine, PinnedBufferPool, PooledBuffer

from .common import BenchFailure
from .files import drop_cache, preallocate

PAGE = 4096  # the unit of the write pattern: every 4 KiB page carries its own file offset
MIN_REQUEST = 64 << 20  # the optimizer's default chunk: large enough that per-request overhead vanishes
# Requests in flight at least: the optimizer's default read-ahead (and the calibration's). Two 64 MiB requests
# (what 32 threads x 1 MiB asked for before) let the threads run dry at each request's end.
MIN_IN_FLIGHT = 8


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


def ring_shape(cfg: IOConfig, size: int) -> tuple[int, int]:
    """(request bytes, requests in flight): enough in flight that every thread always has a task."""
    request = min(size, max(MIN_REQUEST, cfg.block_size))
    inflight = max(MIN_IN_FLIGHT, math.ceil(cfg.threads * cfg.block_size / request) + 1)
    return request, min(inflight, math.ceil(size / request))


def stream(engine: IOEngine, ring: Ring, path: Path, size: int, *, write: bool, fsync: bool = True) -> float:
    """Move `size` bytes between `path` and the ring; returns seconds (a write includes its fsync unless
    `fsync=False`, which leaves it to the caller)."""
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
    if write and fsync:
        engine.flush(path)
    return time.perf_counter() - t0


def write_files(cfg: IOConfig, paths: Iterable[Path], size: int, *, evict: bool = False) -> None:
    """Lay out and write each file once, untimed: the file a baseline reads, or the files that timed writes
    then overwrite, as an optimizer step overwrites its state. `evict` drops their cached pages afterwards."""
    request, inflight = ring_shape(cfg, size)
    with (
        PinnedBufferPool(request * inflight) as pool,
        Ring(pool, inflight, request, pattern=True) as ring,
        IOEngine(cfg) as engine,
    ):
        for path in paths:
            preallocate(path, size)
            stream(engine, ring, path, size, write=True)
            if evict:
                drop_cache(path)


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
