"""The io sweep's typed options and results: what `tiered-bench io` is asked, and its stable `--json` output.

`disk.run_io` takes an `IoOptions` and returns an `IoResult`; `baselines` fills the result's `fio` and
`aiofiles` rows. Both import this module and neither imports the other's, so the result types sit below
the code that measures them. The dataclasses are the JSON schema (report.py): renaming a field breaks
users' scripts, and tests/tools/test_cli.py pins the key sets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from io_engine import IOConfig, format_size
from io_engine.config import DirectMode, SubmitMode

from .common import DEFAULT_DIR, Stat, UsageError


@dataclass(frozen=True)
class Grid:
    """The file size and the block sizes x thread counts a sweep measures, unless flags name their own;
    ``first``: (block size, threads) pairs measured first, in that order (the rest follow in grid order)."""

    size: int
    block_sizes: tuple[int, ...]
    threads: tuple[int, ...]
    first: tuple[tuple[int, int], ...] = ()


# `tiered-bench io` by default: two block sizes x three thread counts (the engine's default 32 x 1 MiB among
# them) on a 4 GiB file, as DeepSpeed's ds_aio_bw.py measures, within QUICK_BUDGET_S seconds: on a slower disk
# the sweep measures fewer configurations (or loops) rather than run longer. A 1 GiB file read 1.41-1.82 GB/s
# where the same call's libaio read 2.28 at 4 GiB and the step's own floor (4 GiB) 2.23 (GPU machine, bench/
# RESULTS.md, twelfth session): on a virtualised disk the host still writes back the last overwrite when the
# read begins, a cost a small file does not amortise. So the configurations that won on the GPU machine run
# first (bench/disk_probe.py, 4 GiB: 64 x 1 MiB read 2.31 GB/s against 1.74-1.78 at 32; 32 x 1 MiB wrote
# 3.02-3.12 against 2.62 at 64; 8 x 8 MiB read 1.86 and wrote 2.89, the best of 8 MiB): a budget that runs
# out cuts configurations that lost there. `--full` (and `tune`) sweep the whole grid on the same file size,
# 48 passes (minutes), unbounded unless `--budget` says otherwise.
QUICK_SWEEP = Grid(4 << 30, (1 << 20, 8 << 20), (8, 32, 64), first=((1 << 20, 64), (1 << 20, 32), (8 << 20, 8)))
FULL_SWEEP = Grid(4 << 30, (1 << 20, 4 << 20, 16 << 20), (8, 16, 32, 64), first=((1 << 20, 64), (1 << 20, 32)))
QUICK_BUDGET_S = 50.0  # the sweep and its baselines; with the start (torch's import, the buffers) under 60 s


MIN_FILE_SIZE = 1 << 20  # a measured file: smaller, the figures are the calls' overhead, not the disk's


def file_size(size: int, flag: str = "--size") -> int:
    """The size of a file a disk measurement writes and reads back: refused below 1 MiB (a UsageError naming
    ``flag``), else rounded down to whole pages, which O_DIRECT and the ring's page stamps want ("300MB" is not
    one). Every command that measures a file (io, tour, kv's --disk-size) checks its size here."""
    from .ring import PAGE  # torch, for the ring: only once a command runs

    if size < MIN_FILE_SIZE:
        raise UsageError(f"{flag} must be at least 1 MiB, got {size} bytes")
    return size // PAGE * PAGE


@dataclass(kw_only=True)
class IoOptions:
    dir: str = DEFAULT_DIR
    size: int = FULL_SWEEP.size
    block_sizes: tuple[int, ...] = FULL_SWEEP.block_sizes
    threads: tuple[int, ...] = FULL_SWEEP.threads
    depths: tuple[int, ...] = (IOConfig().queue_depth,)
    direct: DirectMode = "auto"
    submit: SubmitMode = "threads"
    warmup: int = 1
    loops: int = 3
    validate: bool = False
    fio: bool = True
    aiofiles: bool = False
    progress: bool = True
    budget_s: float | None = None  # None: every configuration, every loop; else stop at this many seconds
    first: tuple[tuple[int, int], ...] = ()  # (block size, threads) measured first, in this order (Grid.first)

    def configs(self) -> list[IOConfig]:
        """Every configuration of the sweep, validated by IOConfig itself (one boundary): the pairs of
        ``first`` that the grid holds first, in that order, then the rest in grid order."""
        size = file_size(self.size)
        if self.block_sizes and max(self.block_sizes) > size:  # measured as a block of the file's size, and
            # tune would write it down for every optimizer loading its file to ask buffers for (1TiB for 1MiB)
            raise UsageError(f"--block-sizes: {format_size(max(self.block_sizes))} is larger than the test file; a "
                             f"block is at most the test file's {format_size(size)} (--size)")  # fmt: skip
        if self.budget_s is not None and not self.budget_s > 0:
            raise UsageError(f"--budget must be a number of seconds > 0, got {self.budget_s}")
        if self.loops < 1 or self.warmup < 0:
            raise UsageError(f"--loops must be >= 1 and --warmup >= 0, got {self.loops} and {self.warmup}")
        if not (self.block_sizes and self.threads and self.depths):
            raise UsageError("--block-sizes, --threads and --depths each need at least one value")
        out = []
        for b in self.block_sizes:
            for t in self.threads:
                for d in self.depths:
                    try:
                        cfg = IOConfig(block_size=b, threads=t, queue_depth=d, direct=self.direct, submit=self.submit)
                        out.append(cfg)
                    except ValueError as e:
                        raise UsageError(f"bad sweep value: {e}") from e
        rank = {pair: k for k, pair in enumerate(self.first)}
        return sorted(out, key=lambda c: rank.get((c.block_size, c.threads), len(rank)))  # stable: grid order after


@dataclass
class SweepRow:
    block_size: int
    threads: int
    queue_depth: int
    read_gbps: Stat
    write_gbps: Stat
    validated: bool | None  # None: --validate was not asked
    fsync_s: Stat | None = None  # the fsync after each timed write, timed apart (inside the write when buffered)


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
class FioResult:
    """fio on the sweep's file in the same run: what the disk can do (baselines.py)."""

    version: str
    ioengine: str
    iodepth: int
    read_block_size: int
    read_gbps: Stat
    write_block_size: int
    write_gbps: Stat
    ours_over_fio_read: float
    ours_over_fio_write: float


@dataclass
class AiofilesResult:
    """The usual `await f.read(n)` / `await f.write(b)` loop on the same file (baselines.py)."""

    block_size: int
    read_gbps: Stat
    write_gbps: Stat
    aiofiles_over_ours_read: float
    aiofiles_over_ours_write: float


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
    fio: FioResult | None = None
    aiofiles: AiofilesResult | None = None
    notes: list[str] = field(default_factory=list)
    budget_s: float | None = None  # the time bound asked for (None: none)
    seconds: float = 0.0  # what the sweep and its baselines took
    complete: bool = True  # False: the budget left configurations, loops or baselines out (notes say which)

    def best_config(self) -> IOConfig:
        return IOConfig.from_dict(self.config)
