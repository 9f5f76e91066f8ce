"""Sequential read/write bandwidth through io_engine: the sweep behind `tiered-bench io` and `tune`.

How one configuration is measured (README.md, "Reading the figures"):
- one file a configuration, laid out (allocated and written once) untimed; every iteration then overwrites
  it, as an optimizer step overwrites its state files and as DeepSpeed's ds_aio_bw.py overwrites its file:
  the write is timed to the last completion, its fsync apart (`fsync_s`; 0-2 ms on the GPU machine and the
  development VM, bench/disk_probe.py); then the file's cached pages are dropped and it is read back. A
  fresh file's first write is slower on ext4 and XFS (the blocks are converted as they are written: 2.3 GB/s
  into allocated blocks against 3.6 overwriting on the GPU machine), which is not what a step does;
- O_DIRECT unless the filesystem refuses it (tmpfs), which the result states in a note (buffered writes
  are fsynced inside the timed write: there the fsync is what reaches the disk);
- `warmup` untimed iterations, then `loops` timed ones: the median and the spread are reported;
- requests of `request_bytes` stream through a ring of reused page-aligned (pinned on CUDA hosts)
  buffers with enough of them in flight to keep every worker thread busy, as the optimizer's
  prefetch pipeline does (ring.py); the engine splits each request into `block_size` tasks.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from io_engine import IOConfig, IOEngine, PinnedBufferPool, format_size, pool_bytes

from . import baselines
from .common import Stat, SweepProgress, UsageError, gbps
from .files import direct_supported, drop_cache, filesystem_of, preallocate
from .io_types import IoOptions, IoResult, Pick, SweepRow, file_size
from .ring import PAGE, Ring, ring_shape, stream, validate, write_files
from .workspace import Workspace

MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


# -------------------------------------------------------------------------------------------- sweep
def measure_config(
    cfg: IOConfig,
    ws: Workspace,
    opts: IoOptions,
    size: int,
    tag: str,
    on_pass: Callable[[float, float], None] | None = None,
    more: Callable[[], bool] | None = None,
) -> SweepRow:
    """One file laid out, then `opts.warmup` + `opts.loops` times overwritten, evicted and read back at `cfg`;
    `on_pass(read GB/s, write GB/s)` after each. `more()`, asked before each timed pass after the first: False
    ends the row there (a time budget; its figures are those of the passes timed). `size`: whole pages (file_size)."""
    if size <= 0 or size % PAGE:  # the stamps view each page as int64s; callers round with file_size
        raise ValueError(f"measure_config: the file size must be a whole number of {PAGE}-byte pages, got {size}")
    request, inflight = ring_shape(cfg, size)
    reads: list[float] = []
    writes: list[float] = []
    fsyncs: list[float] = []
    validated: bool | None = None
    assert ws.dir is not None
    direct = cfg.direct == "on" or (cfg.direct == "auto" and direct_supported(ws.dir))
    # Exits run in reverse: the engine finishes its requests, then the buffers go back, then the pool closes.
    with (
        # two rings and validate's scratch; each buffer is charged in whole pages, so the pool is sized in them:
        # one sized short of them would leave the second ring waiting for a buffer for ever
        PinnedBufferPool(pool_bytes([request] * (2 * inflight + 1))) as pool,
        Ring(pool, inflight, request, pattern=True) as wring,
        Ring(pool, inflight, request, pattern=False) as rring,
        IOEngine(cfg) as engine,
    ):
        path = ws.path(f"{tag}.bin")
        preallocate(path, size)
        stream(engine, wring, path, size, write=True)  # the layout: what the step's files have had since
        try:
            for it in range(opts.warmup + opts.loops):
                if it > opts.warmup and more is not None and not more():
                    break
                tw = stream(engine, wring, path, size, write=True, fsync=not direct)
                t = time.perf_counter()
                engine.flush(path)
                tf = time.perf_counter() - t
                drop_cache(path)
                tr = stream(engine, rring, path, size, write=False)
                if it >= opts.warmup:
                    writes.append(gbps(size, tw))
                    reads.append(gbps(size, tr))
                    fsyncs.append(tf)
                if opts.validate and it == opts.warmup:  # the first timed pass: one a budget never skips
                    with pool.acquire(request) as scratch:
                        validate(engine, wring, scratch, path, size)
                    validated = True
                if on_pass is not None:
                    on_pass(gbps(size, tr), gbps(size, tw))
        finally:
            path.unlink(missing_ok=True)
    return SweepRow(cfg.block_size, cfg.threads, cfg.queue_depth, Stat.of(reads), Stat.of(writes), validated,
                    Stat.of(fsyncs))  # fmt: skip


def run_io(opts: IoOptions, ws: Workspace) -> IoResult:
    """The sweep, then the baselines; `ws` is the caller's so that `optim` can share its folder."""
    configs = opts.configs()
    size = file_size(opts.size)
    assert ws.dir is not None
    notes: list[str] = []
    fstype = filesystem_of(ws.dir)
    direct = opts.direct != "off" and direct_supported(ws.dir)
    if opts.direct == "on" and not direct:
        raise UsageError(
            f"--direct on: the {fstype} filesystem of {ws.root} refuses O_DIRECT. "
            "Use --direct auto (buffered fallback) or a folder on a real disk."
        )
    blocks = len({c.block_size for c in configs})
    baseline_passes = baselines.passes(fio=opts.fio, aiofiles=opts.aiofiles, direct=direct, loops=opts.loops,
                                       blocks=blocks)  # fmt: skip
    _require_room(ws, opts, size, direct, blocks, baseline_passes)
    if opts.direct == "auto" and not direct:
        notes.append(f"O_DIRECT is not supported on {fstype} ({ws.root}): buffered I/O was measured")
    if fstype in MEMORY_FILESYSTEMS:
        notes.append(f"{ws.root} is on {fstype}, which keeps files in memory: these are memory figures, not a disk's")
    if opts.direct == "off":
        notes.append("--direct off: buffered I/O; each file's cached pages are dropped before it is read")
    run_cfgs = [c.replace(direct="on" if direct else "off") for c in configs]

    rows: list[SweepRow] = []
    baseline_passes += 1 if baseline_passes else 0  # their file, written once
    each = opts.warmup + opts.loops
    # The first configuration's warm-up and first timed pass run whatever the budget (measure_config's `more`).
    bar = SweepProgress("io sweep", len(run_cfgs), each, baseline_passes, enabled=opts.progress,
                        budget_s=opts.budget_s, mandatory=opts.warmup + 1)  # fmt: skip
    cut: list[str] = []  # what the time budget left out
    for k, cfg in enumerate(run_cfgs):
        if not bar.fits(each):  # the first configuration always runs
            cut.append(f"{len(run_cfgs) - k} of {len(run_cfgs)} configurations")
            break
        depth = f", queue depth {cfg.queue_depth}" if len(opts.depths) > 1 else ""
        bar.start(k, f"block {format_size(cfg.block_size)}, {cfg.threads} threads{depth}, {format_size(size)} file")
        rows.append(measure_config(cfg, ws, opts, size, f"io{k}", lambda r, w: bar.passed(), lambda: bar.fits(1)))
        timed = len(rows[-1].read_gbps.samples)
        if timed < opts.loops:
            cut.append(f"{opts.loops - timed} of {opts.loops} timed loops of block {format_size(cfg.block_size)}, "
                       f"{cfg.threads} threads")  # fmt: skip

    best_read = max(rows, key=lambda r: r.read_gbps.median)
    best_write = max(rows, key=lambda r: r.write_gbps.median)
    best = min(rows, key=lambda r: 1 / max(r.read_gbps.median, 1e-9) + 1 / max(r.write_gbps.median, 1e-9))
    best_cfg = IOConfig(
        block_size=best.block_size,
        threads=best.threads,
        queue_depth=best.queue_depth,
        direct=opts.direct,
        submit=opts.submit,
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
    if (opts.fio or opts.aiofiles) and baseline_passes and not bar.fits(baseline_passes):
        cut.append("the fio and aiofiles comparisons" if opts.fio and opts.aiofiles else
                   "the fio comparison" if opts.fio else "the aiofiles comparison")  # fmt: skip
    elif opts.fio or opts.aiofiles:
        ref = ws.path("reference.bin")
        if baseline_passes:  # else each baseline only notes why it is missing
            bar.note("the baselines on one file")
            write_files(run_cfgs[rows.index(best)], [ref], size, evict=True)  # the file the baselines read
        try:
            baselines.run_baselines(
                res, ref, loops=opts.loops, fio=opts.fio, aiofiles=opts.aiofiles, ws=ws, show_progress=opts.progress
            )
        finally:
            ref.unlink(missing_ok=True)
    res.budget_s, res.seconds, res.complete = opts.budget_s, round(bar.elapsed(), 2), not cut
    if cut:
        res.notes.append(f"the time budget ({opts.budget_s:g} s) left out {'; '.join(cut)}: pass --budget with "
                         "more seconds, or --full for the whole grid without one")  # fmt: skip
    return res


def _require_room(ws: Workspace, opts: IoOptions, size: int, direct: bool, blocks: int, baseline_passes: int) -> None:
    """Refuse (UsageError) a folder without room for the run's files: two where a baseline will run (it reads
    one file while it writes a fresh one), else one at a time. A baseline that will not run (fio missing, no
    O_DIRECT) asks for no room: its second file is never written."""
    if not baseline_passes:
        ws.require_free(size, f"one test file of {format_size(size)} at a time")
        return
    running = [(name, flag) for name, flag in (("fio", "--no-fio"), ("aiofiles", "no --aiofiles"))
               if baselines.passes(fio=name == "fio", aiofiles=name == "aiofiles", direct=direct, loops=opts.loops,
                                   blocks=blocks)]  # fmt: skip
    names = " and ".join(name for name, _ in running)
    ws.require_free(
        2 * size,
        f"two test files of {format_size(size)}: one to read, one fresh to write, for the {names} comparison"
        + ("s" if len(running) > 1 else ""),
        or_else=" and ".join(flag for _, flag in running) + " (then one file at a time)",
    )
