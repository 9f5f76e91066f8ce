"""The default run of `tiered-bench`: a small io sweep, the PCIe copies, and one small optimizer step.

It is the README's first command, so it must finish in well under a minute on a 2-core CI machine
and leave nothing behind. The optimizer step reuses this run's io sweep for its floor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .common import UsageError
from .disk import run_io
from .io_types import IoOptions, IoResult, file_size
from .optim import OptimOptions, OptimResult, run_optim
from .pcie import PcieOptions, PcieResult, run_pcie
from .workspace import Workspace

TOUR_SIZE = 256 << 20
TOUR_BLOCKS = (1 << 20, 8 << 20)  # two block sizes x two thread counts: enough to show that the knobs matter
TOUR_MIN_SIZE = max(TOUR_BLOCKS)  # a block is at most the test file (io refuses more, naming its --block-sizes)
TOUR_PARAMS = 4_000_000  # fp32 parameters: 48 MB of state (12 bytes each), most of it beyond the budget below
TOUR_HOST_BUDGET = 16 << 20
TOUR_CHUNK = 3 << 20  # master, exp_avg and exp_avg_sq of 256Ki params: 1 MiB each, page-aligned


@dataclass(kw_only=True)
class TourOptions:
    dir: str
    size: int = TOUR_SIZE
    fio: bool = True
    progress: bool = True


@dataclass
class TourResult:
    io: IoResult
    pcie: PcieResult
    optim: OptimResult | None
    notes: list[str] = field(default_factory=list)


def tour_io_options(opts: TourOptions) -> IoOptions:
    # Quick at 256 MiB.
    return IoOptions(
        dir=opts.dir,
        size=opts.size,
        block_sizes=TOUR_BLOCKS,
        threads=(4, 16),
        warmup=1,
        loops=3,
        fio=opts.fio,
        progress=opts.progress,
    )


def run_tour(opts: TourOptions) -> TourResult:
    file_size(opts.size)
    if opts.size < TOUR_MIN_SIZE:  # before io's check, which names --block-sizes, a flag tour does not have
        raise UsageError(f"tour: --size must be at least {TOUR_MIN_SIZE >> 20} MiB, the largest block it measures; "
                         f"got {opts.size} bytes")  # fmt: skip
    with Workspace(opts.dir) as ws:
        io = run_io(tour_io_options(opts), ws)
        pcie = run_pcie(PcieOptions(size=min(opts.size, TOUR_SIZE), loops=3, progress=opts.progress))
        oo = OptimOptions(
            params=TOUR_PARAMS,
            host_budget=TOUR_HOST_BUDGET,
            chunk_bytes=TOUR_CHUNK,
            steps=3,
            warmup=1,
            progress=opts.progress,
        )
        optim = run_optim(oo, ws, io=io)
    return TourResult(io, pcie, optim)
