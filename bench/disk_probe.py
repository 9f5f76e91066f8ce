"""One call's diagnosis of the disk: DeepSpeed's libaio handle beside io_engine, across what could explain a gap.

    python3 bench/disk_probe.py --dir /root/probe --out $OUT/disk_probe.json [--budget 150] [--size 4GiB]

On the GPU machine, with DeepSpeed importable (carry `.anchors`, made by ../shared/anchors/prepare.sh):

    PYTHONPATH=$PWD bash .anchors/run_on_device.sh ../bench/disk_probe.py --dir /root/probe --out $OUT/disk_probe.json

Everything runs in one process on one file set, so every ratio compares figures measured minutes apart on
the same disk. Each phase is one question; phases run in priority order and one that would end past
`--budget` seconds (DeepSpeed's build included) is skipped and listed as such:

  libaio     DeepSpeed's aio handle (when importable): a fresh write of the big file, then block x queue
             depth x threads configs, each an overwrite then a read of the whole file (ds_aio_bw.py's method;
             no fsync: libaio's sync_pwrite does none), and the fsync after one of them timed on its own
  engine     io_engine on the same file, same method (overwrite, no fsync, read), per config, as one request
             of the whole file and as 64 MiB requests with 1 / 2 / 8 in flight; the fsync timed on its own
  state      a write into a fresh (sparse) file, a fallocated one and an overwrite, big file and 64 MiB chunk
             files (the store's layout): ext4 serializes direct writes that extend a file
  mixed      read one file while overwriting another, on one engine and on two, against the same run's
             read alone + write alone (serial) and max of the two (full overlap)
  step       the step's disk pattern without compute over the chunk files: read-ahead of 8 chunks, each chunk
             written back after it is read; one engine, two engines, and in two phases (all reads, then all
             writes); then the same through a real TieredStore (scan policy, checksums on)
  calib      the telemetry's calibration (tiered.calibration) as the optimizer runs it, and the method by hand
             at 128 MiB .. 2 GiB (one request, and 64 MiB requests 8 in flight)
  grid       threads x block size, overwrite and read, on the first half of the big file
  drift      libaio's best configs and io_engine's default once more, to show the disk's drift

A benchmark: it asserts nothing. It writes one JSON file (--out) and prints a short summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from io_engine import IOConfig, IOEngine, aligned_empty, format_size, parse_size
from tiered.bench.files import direct_supported, filesystem_of
from tiered.bench.workspace import Workspace

MiB = 1 << 20
CHUNK = 64 * MiB  # the optimizer's default chunk_bytes: one store record, one file
LIBAIO = ((1, 32, 1), (1, 32, 8), (8, 8, 4), (8, 32, 8))  # (block MiB, queue depth, threads): ds_aio's best rows
ENGINE = ((32, 1), (16, 8), (64, 1), (8, 8))  # (threads, block MiB): the default first
GRID = ((8, 1), (16, 1), (128, 1), (4, 8), (32, 8), (64, 2), (32, 4), (16, 2))


class Probe:
    def __init__(self, root: Path, size: int, budget: float, pinned: bool):
        self.root, self.size, self.budget = root, size, budget
        self.t0 = time.perf_counter()
        self.rows: list[dict[str, Any]] = []
        self.skipped: list[str] = []
        self.notes: list[str] = []
        self.rate = 1.0e9  # bytes/s assumed until measured: the slower direction, for the phases' estimates
        self.recent: list[float] = []
        if pinned:
            self.buf = torch.empty(size, dtype=torch.uint8).pin_memory()
            self._owner: Any = None
        else:
            view, self._owner = aligned_empty(size)
            self.buf = torch.frombuffer(view, dtype=torch.uint8)
        template = torch.randint(0, 256, (CHUNK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
        for s in range(0, size, CHUNK):
            n = min(CHUNK, size - s)
            self.buf[s : s + n].copy_(template[:n])
        self.big = root / "big.bin"
        self.chunks = [root / f"chunk{i:03d}.bin" for i in range(max(2, min(size, 2 << 30) // CHUNK))]

    # ------------------------------------------------------------------------------ bookkeeping
    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def fits(self, nbytes: float, name: str) -> bool:
        est = nbytes / self.rate
        if est > self.left():
            self.skipped.append(f"{name}: needs about {est:.0f} s, {self.left():.0f} s left")
            log(f"skip {name}: needs about {est:.0f} s, {self.left():.0f} s left")
            return False
        return True

    def row(self, phase: str, name: str, op: str, nbytes: int, seconds: float, **extra: Any) -> dict[str, Any]:
        gbps = nbytes / seconds / 1e9 if seconds > 0 else None
        r = dict(phase=phase, name=name, op=op, bytes=nbytes, seconds=round(seconds, 4),
                 gbps=None if gbps is None else round(gbps, 3), **extra)  # fmt: skip
        self.rows.append(r)
        if op in ("read", "write") and gbps:  # the phases' estimates use the slowest of the recent figures
            self.recent = [*self.recent[-5:], gbps * 1e9]
            self.rate = min(self.recent)
        g = "" if gbps is None else f" {gbps:6.2f} GB/s"
        more = " ".join(f"{k}={v}" for k, v in extra.items() if k not in ("config",))
        log(f"{phase:7s} {name:38s} {op:6s} {format_size(nbytes):>10s} {seconds:7.3f} s{g}  {more}")
        return r


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def engine(threads: int, block_mib: float, direct: bool) -> IOEngine:
    return IOEngine(IOConfig(threads=threads, block_size=int(block_mib * MiB), direct="on" if direct else "off"))


def stream(eng: IOEngine, buf: torch.Tensor, path: Path, size: int, *, write: bool, request: int | None = None,
           inflight: int = 1 << 30) -> float:  # fmt: skip
    """`size` bytes between `buf` and `path` in requests of `request` (None: one request), at most `inflight`
    pending; seconds to the last completion (no fsync)."""
    request = request or size
    pending: deque = deque()
    t0 = time.perf_counter()
    for off in range(0, size, request):
        n = min(request, size - off)
        if len(pending) >= inflight:
            pending.popleft().result()
        op = eng.pwrite if write else eng.pread
        pending.append(op(buf[off : off + n], path, off))
    for f in pending:
        f.result()
    return time.perf_counter() - t0


def files_stream(eng: IOEngine, buf: torch.Tensor, paths: list[Path], *, write: bool, inflight: int) -> float:
    """Each path one CHUNK request (from successive CHUNK slices of `buf`), at most `inflight` pending."""
    pending: deque = deque()
    t0 = time.perf_counter()
    slots = buf.numel() // CHUNK
    for i, p in enumerate(paths):
        if len(pending) >= inflight:
            pending.popleft().result()
        view = buf[(i % slots) * CHUNK : (i % slots + 1) * CHUNK]
        pending.append((eng.pwrite if write else eng.pread)(view, p, 0))
    for f in pending:
        f.result()
    return time.perf_counter() - t0


def timed_fsync(eng: IOEngine, path: Path | None = None) -> float:
    t0 = time.perf_counter()
    eng.flush(path)
    return time.perf_counter() - t0


def step_pattern(read_eng: IOEngine, write_eng: IOEngine, buf: torch.Tensor, paths: list[Path], depth: int) -> float:
    """The step's disk traffic without compute: chunk i+depth read ahead while chunk i is 'updated' (nothing)
    and then written back; the buffer slot is reused once the chunk's write-back has landed."""
    slots = buf.numel() // CHUNK
    n = len(paths)
    if slots < depth + 2:
        raise ValueError("buffer too small for the step pattern")
    reads: dict[int, Any] = {}
    writes: deque = deque()
    t0 = time.perf_counter()

    def view(i: int) -> torch.Tensor:
        return buf[(i % slots) * CHUNK : (i % slots + 1) * CHUNK]

    issued = 0
    for i in range(n):
        while issued < min(n, i + depth + 1):
            while writes and writes[0][0] <= issued - slots:  # the slot's previous chunk must be written first
                writes.popleft()[1].result()
            reads[issued] = read_eng.pread(view(issued), paths[issued], 0)
            issued += 1
        reads.pop(i).result()
        writes.append((i, write_eng.pwrite(view(i), paths[i], 0)))
    for _, f in writes:
        f.result()
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------ phases
def load_libaio(p: Probe) -> Any:
    try:
        t = time.perf_counter()
        from deepspeed.ops.op_builder import AsyncIOBuilder  # type: ignore[import-not-found]

        aio = AsyncIOBuilder().load()
        p.row("libaio", "DeepSpeed AsyncIOBuilder().load()", "setup", 0, time.perf_counter() - t)
        return aio
    except Exception as e:  # noqa: BLE001 - any failure only means no libaio rows
        p.notes.append(f"DeepSpeed's aio handle is not importable here ({type(e).__name__}: {e}): no libaio rows")
        log(p.notes[-1])
        return None


def phase_libaio(p: Probe, aio: Any, configs: tuple[tuple[int, int, int], ...], tag: str = "libaio") -> None:
    size = p.size
    for k, (block, qd, threads) in enumerate(configs):
        if not p.fits(2 * size, f"{tag} {block}MiB qd{qd} t{threads}"):
            return
        h = aio.aio_handle(block * MiB, qd, False, True, threads)
        name = f"block {block} MiB, qd {qd}, {threads} threads"
        fresh = not p.big.exists()
        t = time.perf_counter()
        h.sync_pwrite(p.buf, str(p.big))
        w = time.perf_counter() - t
        p.row(tag, name, "write", size, w, file="fresh" if fresh else "overwrite", block_MiB=block, qd=qd,
              threads=threads)  # fmt: skip
        if fresh:  # the first write laid the file out; time an overwrite as every other config does
            t = time.perf_counter()
            h.sync_pwrite(p.buf, str(p.big))
            p.row(tag, name, "write", size, time.perf_counter() - t, file="overwrite", block_MiB=block, qd=qd,
                  threads=threads)  # fmt: skip
        if k == 0:
            fd = os.open(p.big, os.O_RDONLY)
            t = time.perf_counter()
            os.fsync(fd)
            os.close(fd)
            p.row(tag, name, "fsync", 0, time.perf_counter() - t, note="fsync after libaio's overwrite")
        t = time.perf_counter()
        h.sync_pread(p.buf, str(p.big))
        p.row(tag, name, "read", size, time.perf_counter() - t, block_MiB=block, qd=qd, threads=threads)


def ensure_files(p: Probe, direct: bool) -> None:
    """The big file and the chunk files, written once (timed: they are fresh writes) where a phase before
    did not leave them."""
    with engine(32, 1, direct) as eng:
        if not p.big.exists():
            p.row("layout", "the big file (fresh)", "write", p.size, stream(eng, p.buf, p.big, p.size, write=True),
                  file="fresh", threads=32, block_MiB=1)  # fmt: skip
        if not all(c.exists() for c in p.chunks):
            p.row(
                "layout",
                f"{len(p.chunks)} chunk files (fresh)",
                "write",
                len(p.chunks) * CHUNK,
                files_stream(eng, p.buf, p.chunks, write=True, inflight=8),
                file="fresh",
                threads=32,
                block_MiB=1,
            )
        eng.flush()


def phase_engine(p: Probe, direct: bool, configs: tuple[tuple[int, int], ...] = ENGINE, tag: str = "engine") -> None:
    size = p.size
    for threads, block in configs:
        if not p.fits(2 * size, f"{tag} {threads}x{block}MiB"):
            return
        with engine(threads, block, direct) as eng:
            cfg = dict(threads=threads, block_MiB=block)
            p.row(tag, f"{threads} x {block} MiB, one request", "write", size,
                  stream(eng, p.buf, p.big, size, write=True), file="overwrite", **cfg)  # fmt: skip
            p.row(tag, f"{threads} x {block} MiB", "fsync", 0, timed_fsync(eng, p.big), **cfg)
            p.row(tag, f"{threads} x {block} MiB, one request", "read", size,
                  stream(eng, p.buf, p.big, size, write=False), **cfg)  # fmt: skip
        if tag == "engine" and (threads, block) == configs[0]:
            phase_requests(p, direct, threads, block)


def phase_requests(p: Probe, direct: bool, threads: int, block: int) -> None:
    """Requests in flight: 64 MiB requests, 1 / 2 / 8 at a time (the store's prefetch depth is 8)."""
    size = p.size
    with engine(threads, block, direct) as eng:
        for inflight in (1, 2, 8):
            if not p.fits(2 * size, f"requests x{inflight}"):
                return
            cfg = dict(threads=threads, block_MiB=block, request_MiB=CHUNK // MiB, inflight=inflight)
            p.row("engine", f"{threads} x {block} MiB, 64 MiB requests x{inflight}", "write", size,
                  stream(eng, p.buf, p.big, size, write=True, request=CHUNK, inflight=inflight), **cfg)  # fmt: skip
            p.row("engine", f"{threads} x {block} MiB, 64 MiB requests x{inflight}", "read", size,
                  stream(eng, p.buf, p.big, size, write=False, request=CHUNK, inflight=inflight), **cfg)  # fmt: skip
        eng.flush()


def phase_state(p: Probe, direct: bool) -> None:
    """Fresh (sparse), fallocated and written files: the first write of a state file against the rest."""
    size = min(p.size, 2 << 30)
    for threads, block in ((32, 1), (16, 8)):
        if not p.fits(3 * size + 3 * len(p.chunks) * CHUNK, f"state {threads}x{block}MiB"):
            return
        cfg = dict(threads=threads, block_MiB=block)
        with engine(threads, block, direct) as eng:
            f = p.root / "fresh.bin"
            for kind in ("fresh", "fallocated", "overwrite"):
                if kind == "fresh":
                    f.unlink(missing_ok=True)
                elif kind == "fallocated":
                    f.unlink(missing_ok=True)
                    fd = os.open(f, os.O_WRONLY | os.O_CREAT, 0o644)
                    os.posix_fallocate(fd, 0, size)
                    os.close(fd)
                s = stream(eng, p.buf, f, size, write=True, request=CHUNK, inflight=8)
                p.row("state", f"one file, {threads} x {block} MiB", "write", size, s, file=kind, **cfg)
                p.row("state", f"one file, {threads} x {block} MiB", "fsync", 0, timed_fsync(eng, f), file=kind, **cfg)
            f.unlink()
            n = len(p.chunks) * CHUNK
            for kind in ("fresh", "fallocated", "overwrite"):
                for c in p.chunks:
                    if kind != "overwrite":
                        c.unlink(missing_ok=True)
                    if kind == "fallocated":
                        fd = os.open(c, os.O_WRONLY | os.O_CREAT, 0o644)
                        os.posix_fallocate(fd, 0, CHUNK)
                        os.close(fd)
                s = files_stream(eng, p.buf, p.chunks, write=True, inflight=8)
                p.row("state", f"{len(p.chunks)} chunk files, {threads} x {block} MiB", "write", n, s, file=kind, **cfg)
                p.row("state", f"{len(p.chunks)} chunk files", "fsync", 0, timed_fsync(eng), file=kind, **cfg)
            s = files_stream(eng, p.buf, p.chunks, write=False, inflight=8)
            p.row("state", f"{len(p.chunks)} chunk files, {threads} x {block} MiB", "read", n, s, **cfg)


def phase_mixed(p: Probe, direct: bool) -> None:
    """Read the big file's first half while overwriting the chunk files: one engine, two engines."""
    n = len(p.chunks) * CHUNK
    size = min(p.size, n)
    if not p.fits(6 * n, "mixed"):
        return
    half = p.buf[: p.buf.numel() // 2 // CHUNK * CHUNK] if p.buf.numel() >= 2 * CHUNK else p.buf
    wbuf = p.buf[half.numel() :] if half.numel() < p.buf.numel() else p.buf

    def both(reng: IOEngine, weng: IOEngine) -> tuple[float, float, float]:
        done: dict[str, float] = {}
        th = threading.Thread(target=lambda: done.update(w=files_stream(weng, wbuf, p.chunks, write=True, inflight=8)))
        t0 = time.perf_counter()
        th.start()
        done["r"] = stream(reng, half, p.big, min(size, half.numel()), write=False, request=CHUNK, inflight=8)
        th.join()
        return time.perf_counter() - t0, done["r"], done["w"]

    rbytes = min(size, half.numel())
    with engine(32, 1, direct) as one, engine(32, 1, direct) as other, engine(16, 1, direct) as r16, \
            engine(16, 1, direct) as w16:  # fmt: skip
        r = stream(one, half, p.big, rbytes, write=False, request=CHUNK, inflight=8)
        w = files_stream(one, wbuf, p.chunks, write=True, inflight=8)
        p.row("mixed", "read alone (32 x 1 MiB)", "read", rbytes, r)
        p.row("mixed", "write alone (32 x 1 MiB)", "write", n, w)
        for name, (re, we) in (("one engine 32 x 1 MiB", (one, one)), ("two engines 32 + 32 x 1 MiB", (one, other)),
                               ("two engines 16 + 16 x 1 MiB", (r16, w16))):  # fmt: skip
            m, mr, mw = both(re, we)
            serial, overlap = r + w, max(r, w)
            p.row("mixed", name, "mixed", rbytes + n, m, read_s=round(mr, 3), write_s=round(mw, 3),
                  serial_s=round(serial, 3), full_overlap_s=round(overlap, 3),
                  overlap=round((serial - m) / (serial - overlap), 3) if serial > overlap else None)  # fmt: skip
        one.flush()


def phase_step(p: Probe, direct: bool) -> None:
    """The step's disk pattern against the serial floor at the same config: one engine for both directions, or
    a read engine and a write engine (of other thread counts too), and 32 or 64 threads."""
    n = len(p.chunks) * CHUNK
    if not p.fits(8 * n, "step pattern"):
        return
    depth = min(8, p.buf.numel() // CHUNK - 2)  # the optimizer's prefetch depth, where the buffer holds it
    serial: dict[int, float] = {}
    parts: dict[str, list[float]] = {"r": [], "w": []}
    with engine(32, 1, direct) as e32, engine(32, 1, direct) as w32, engine(64, 1, direct) as e64, \
            engine(16, 1, direct) as w16:  # fmt: skip
        for threads, eng in ((32, e32), (64, e64)):
            if not p.fits(2 * n, f"step serial {threads}"):
                return
            r = files_stream(eng, p.buf, p.chunks, write=False, inflight=8)
            w = files_stream(eng, p.buf, p.chunks, write=True, inflight=8)
            serial[threads] = r + w
            parts["r"].append(r)
            parts["w"].append(w)
            p.row("step", f"serial, {threads} x 1 MiB: all reads, then all writes", "mixed", 2 * n, r + w,
                  read_s=round(r, 3), write_s=round(w, 3), threads=threads)  # fmt: skip
        runs = ((f"one engine 32 x 1 MiB, depth {depth}", e32, e32, 32),
                (f"two engines 32 + 32 x 1 MiB, depth {depth}", e32, w32, 32),
                (f"one engine 64 x 1 MiB, depth {depth}", e64, e64, 64),
                (f"two engines, reads 64, writes 32 x 1 MiB, depth {depth}", e64, w32, 64),
                (f"two engines, reads 64, writes 16 x 1 MiB, depth {depth}", e64, w16, 64),
                (f"one engine 32 x 1 MiB, depth {depth}, again", e32, e32, 32))  # fmt: skip
        for name, re, we, threads in runs:
            if not p.fits(2 * n, f"step {name}"):
                break
            s = step_pattern(re, we, p.buf, p.chunks, depth)
            best = min(parts["r"]) + min(parts["w"])  # each direction at its faster thread count
            p.row("step", name, "mixed", 2 * n, s, over_serial=round(s / serial[threads], 3),
                  over_serial_32=round(s / serial[32], 3), over_serial_best=round(s / best, 3))  # fmt: skip
        for eng in (e32, w32, e64, w16):
            eng.flush()
    phase_store(p, serial[32])


def phase_store(p: Probe, serial_s: float) -> None:
    """The same bytes through a real TieredStore (scan policy, everything streaming, checksums on): on one
    engine, and on a read engine of 64 threads beside a write engine of 32 (io_engine.DuplexEngine), in turn."""
    import shutil

    from io_engine import DuplexEngine
    from tiered.store import TieredStore
    from tiered.store.scan import scan

    n = len(p.chunks)
    depth = 8
    budget = (depth + 3) * CHUNK
    keys = [f"c{i}" for i in range(n)]

    def duplex() -> DuplexEngine:
        return DuplexEngine(IOEngine(IOConfig(threads=64), follow_symlinks=False),
                            IOEngine(IOConfig(threads=32), follow_symlinks=False))  # fmt: skip

    variants = (("one engine 32 x 1 MiB", lambda: None), ("two engines, reads 64 + writes 32 x 1 MiB", duplex),
                ("one engine 32 x 1 MiB, again", lambda: None), ("two engines, again", duplex))  # fmt: skip
    for v, (label, make) in enumerate(variants):
        if not p.fits(5 * n * CHUNK, f"store scan, {label}"):
            return
        folder = p.root / f"store{v}"
        eng = make()
        with TieredStore(str(folder), host_budget=budget, policy="scan", io=eng or IOConfig(),
                         stream_reserve=budget) as store:  # fmt: skip
            t = time.perf_counter()
            for i, k in enumerate(keys):
                store.put(k, p.buf[(i % (p.buf.numel() // CHUNK)) * CHUNK :][:CHUNK])
            store.flush()
            p.row("step", f"store: initial put of fresh records, {label}", "write", n * CHUNK, time.perf_counter() - t)

            def touch(i: int, record: torch.Tensor, store: TieredStore = store) -> None:
                store.mark_dirty(keys[i])

            for rep in range(2):  # the first scan may pay for the initial put's writes still in a cache
                before = store.stats()["nvme"]
                t = time.perf_counter()
                scan(store, keys, depth, touch, writes=True)
                store.flush()
                s = time.perf_counter() - t
                after = store.stats()["nvme"]
                moved = after["bytes_read"] - before["bytes_read"] + after["bytes_written"] - before["bytes_written"]
                p.row("step", f"store scan, depth {depth}, flush included, {label} ({rep})", "mixed", moved, s,
                      over_serial=round(s / serial_s, 3))  # fmt: skip
        if eng is not None:
            eng.close()
        shutil.rmtree(folder, ignore_errors=True)


def phase_calib(p: Probe, direct: bool) -> None:
    from tiered import calibration

    if not p.fits(6 * calibration.CALIBRATE_BYTES, "calib"):  # two calibrations; the sizes by hand check their own
        return
    folder = p.root / "calib"
    folder.mkdir(exist_ok=True)
    for attempt in range(2):  # as the optimizer runs it at its default IOConfig: the floor telemetry divides by
        t = time.perf_counter()
        rate = calibration.calibrate(str(folder), IOConfig())
        s = time.perf_counter() - t
        if rate is not None:
            prov = rate.provenance
            p.row("calib", f"calibration.calibrate, method {prov['method']} ({attempt})", "calib", 0, s,
                  read_gbps=rate.read_gbps, write_gbps=rate.write_gbps, calib_bytes=prov["bytes"],
                  passes=prov["passes"], fsync_s=prov["fsync_s"])  # fmt: skip
    # Its method by hand at several sizes: one request, then 64 MiB requests 8 in flight (the store's);
    # overwrite with the fsync timed apart, then read.
    with engine(32, 1, direct) as eng:
        for size in sorted({min(p.size, x) for x in (128 * MiB, 512 * MiB, 1 << 30, 2 << 30)}):
            if not p.fits(5 * size, f"calib {format_size(size)}"):
                return
            f = folder / f"c{size}.bin"
            stream(eng, p.buf, f, size, write=True)
            eng.flush(f)
            for request, inflight in ((None, 1), (CHUNK, 8)):
                how = "one request" if request is None else "64 MiB x8"
                w = stream(eng, p.buf, f, size, write=True, request=request, inflight=inflight)
                fs = timed_fsync(eng, f)
                r = stream(eng, p.buf, f, size, write=False, request=request, inflight=inflight)
                p.row("calib", f"{format_size(size)} overwrite, {how}", "write", size, w, fsync_s=round(fs, 4),
                      with_fsync_gbps=round(size / (w + fs) / 1e9, 3), size_class=size)  # fmt: skip
                p.row("calib", f"{format_size(size)} read, {how}", "read", size, r, size_class=size)
            f.unlink()


def phase_grid(p: Probe, direct: bool) -> None:
    size = min(p.size, 2 << 30)
    for threads, block in GRID:
        if not p.fits(2 * size, f"grid {threads}x{block}MiB"):
            return
        with engine(threads, block, direct) as eng:
            cfg = dict(threads=threads, block_MiB=block)
            p.row("grid", f"{threads} x {block} MiB", "write", size,
                  stream(eng, p.buf, p.big, size, write=True), **cfg)  # fmt: skip
            p.row("grid", f"{threads} x {block} MiB", "read", size, stream(eng, p.buf, p.big, size, write=False), **cfg)
            eng.flush()


def system_info(root: Path) -> dict[str, Any]:
    info: dict[str, Any] = dict(host=platform.node(), kernel=platform.release(), cpus=os.cpu_count(),
                                filesystem=filesystem_of(root), torch=torch.__version__,
                                cuda=torch.cuda.is_available())  # fmt: skip
    try:
        dev = os.stat(root).st_dev
        sysdev = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
        q = os.path.join(os.path.realpath(sysdev), "..", "queue")
        if not os.path.isdir(q):
            q = os.path.join(os.path.realpath(sysdev), "queue")
        for k in ("scheduler", "nr_requests", "max_sectors_kb", "write_cache", "rotational", "max_hw_sectors_kb"):
            try:
                with open(os.path.join(q, k)) as f:
                    info[f"queue_{k}"] = f.read().strip()
            except OSError:
                pass
        with open("/proc/mounts") as f:
            info["mounts"] = [ln.strip() for ln in f if " / " in ln or str(root).startswith(ln.split()[1] + "/")]
    except (OSError, IndexError):
        pass
    return info


def summarize(p: Probe) -> dict[str, Any]:
    def best(phase: str, op: str, **match: Any) -> float | None:
        vals = [r["gbps"] for r in p.rows if r["phase"] == phase and r["op"] == op and r["gbps"]
                and all(r.get(k) == v for k, v in match.items())]  # fmt: skip
        return max(vals) if vals else None

    s: dict[str, Any] = {}
    s["libaio_read"], s["libaio_write"] = best("libaio", "read"), best("libaio", "write", file="overwrite")
    s["engine_read"], s["engine_write"] = best("engine", "read"), best("engine", "write")
    if s["libaio_read"] and s["engine_read"]:
        s["engine_over_libaio_read"] = round(s["engine_read"] / s["libaio_read"], 3)
    if s["libaio_write"] and s["engine_write"]:
        s["engine_over_libaio_write"] = round(s["engine_write"] / s["libaio_write"], 3)
    for kind in ("fresh", "fallocated", "overwrite"):
        s[f"state_write_{kind}"] = best("state", "write", file=kind)
    s["mixed"] = [dict(name=r["name"], seconds=r["seconds"], serial_s=r["serial_s"], overlap=r["overlap"])
                  for r in p.rows if r["phase"] == "mixed" and r["op"] == "mixed"]  # fmt: skip
    s["step"] = [dict(name=r["name"], seconds=r["seconds"], over_serial=r.get("over_serial"))
                 for r in p.rows if r["phase"] == "step"]  # fmt: skip
    s["calib"] = [dict(name=r["name"], gbps=r.get("gbps"), read=r.get("read_gbps"), write=r.get("write_gbps"))
                  for r in p.rows if r["phase"] == "calib"]  # fmt: skip
    return s


# The phases that take only the probe and whether the disk takes O_DIRECT.
SIMPLE_PHASES = {"engine": phase_engine, "state": phase_state, "mixed": phase_mixed, "step": phase_step,
                 "calib": phase_calib, "grid": phase_grid}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="a folder on the disk to measure (removed after)")
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--size", default="4GiB", help="the big file (ds_aio_bw.py's 4 GiB by default)")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds for everything, DeepSpeed's build included")
    ap.add_argument("--phases", default="libaio,engine,state,step,mixed,calib,drift,grid",
                    help="which phases, in this priority order")  # fmt: skip
    ap.add_argument("--no-libaio", action="store_true", help="do not try DeepSpeed")
    ap.add_argument(
        "--chunk", default="64MiB", help="one store record (the optimizer's chunk_bytes); smaller for a smoke test"
    )
    ap.add_argument("--calib-bytes", default=None, help="the calibration's file (default: its own, 1 GiB); smaller "
                    "for a smoke test")  # fmt: skip
    a = ap.parse_args(argv)
    if a.calib_bytes:
        from tiered import calibration

        calibration.CALIBRATE_BYTES = parse_size(a.calib_bytes)
    global CHUNK
    CHUNK = parse_size(a.chunk)
    size = parse_size(a.size) // CHUNK * CHUNK
    if size < 4 * CHUNK:
        ap.error(f"--size must be at least {format_size(4 * CHUNK)}")
    phases = [x.strip() for x in a.phases.split(",") if x.strip()]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = dict(name="disk_probe", argv=sys.argv[1:], size=size, budget_s=a.budget)
    with Workspace(a.dir) as ws:
        assert ws.dir is not None
        ws.require_free(size + 2 * min(size, 2 << 30) + (2 << 30), "the big file, the chunk files and the store's")
        direct = direct_supported(ws.dir)
        doc["system"] = system_info(ws.dir)
        doc["direct"] = direct
        p = Probe(ws.dir, size, a.budget, pinned=torch.cuda.is_available())
        if not direct:
            p.notes.append("O_DIRECT refused here: buffered I/O measured (memory figures, not the disk's)")
        log(f"disk_probe: {format_size(size)} file in {ws.dir} ({doc['system'].get('filesystem')}), "
            f"O_DIRECT {direct}, budget {a.budget:.0f} s")  # fmt: skip
        aio = None if a.no_libaio or "libaio" not in phases else load_libaio(p)
        for ph in phases:
            try:
                if ph in ("engine", "mixed", "step", "grid", "drift"):
                    ensure_files(p, direct)
                if ph == "libaio" and aio is not None:
                    phase_libaio(p, aio, LIBAIO)
                elif ph in SIMPLE_PHASES:
                    SIMPLE_PHASES[ph](p, direct)
                elif ph == "drift":
                    if aio is not None:
                        best_r = max((r for r in p.rows if r["phase"] == "libaio" and r["op"] == "read"),
                                     key=lambda r: r["gbps"], default=None)  # fmt: skip
                        if best_r is not None:
                            phase_libaio(p, aio, ((best_r["block_MiB"], best_r["qd"], best_r["threads"]),), "drift")
                    phase_engine(p, direct, ENGINE[:1], tag="drift")
            except Exception as e:  # noqa: BLE001 - the other phases and the rows so far still go out
                p.notes.append(f"phase {ph} stopped by {type(e).__name__}: {e}")
                log(p.notes[-1])
        doc.update(rows=p.rows, skipped=p.skipped, notes=p.notes, seconds=round(time.perf_counter() - p.t0, 1))
        doc["summary"] = summarize(p)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, out)
    print(json.dumps(doc["summary"]))
    log(f"disk_probe: {doc['seconds']} s, {len(p.rows)} rows, skipped {len(p.skipped)}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
