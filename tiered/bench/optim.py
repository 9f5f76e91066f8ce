"""One offloaded AdamW step through `tiered.TieredOptimizer`, against the disk floor of the same run.

The floor is what the disk alone forces: the bytes the step read from NVMe over the read bandwidth,
plus the bytes it wrote over the write bandwidth, with both bandwidths measured by the io sweep in
this same run at the configuration the optimizer is then given (only a ratio measured in one run means
anything: README.md, "Reading the figures"). `step_over_floor` near 1 means everything else hid under
the disk. Every byte count (the state, what a step moved) is the optimizer's own (`opt.stats()`): the
state takes 12, 10 and a bit, or 8 bytes a parameter depending on its layout, which only it knows.
"""

from __future__ import annotations

import errno
import statistics
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from io_engine import format_size
from tiered.optim.step_stats import PHASES
from tiered.telemetry import summary_line

from .common import DEVICES, Stat, UsageError, check_device
from .disk import run_io
from .io_types import IoOptions, IoResult
from .steps import DTYPES, synthetic_params, time_steps
from .workspace import Workspace

TIME_PHASES = tuple(k for k in PHASES if k.endswith("_s") and k != "step_s")  # the step's parts, in seconds


@dataclass(kw_only=True)
class OptimOptions:
    params: int = 50_000_000
    host_budget: int = 256 << 20
    gpu_budget: int = 0
    chunk_bytes: int | None = None  # None: the optimizer's default
    steps: int = 3
    warmup: int = 1
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "fp32"  # fp32 | bf16: the parameters' dtype (bf16 gets fp32 masters)
    split_masters: bool | None = None  # bf16 only: TieredOptimizer's split_masters (None: its default)
    update_on: str = "auto"  # TieredOptimizer's update_on
    nproc: int = 1  # ranks (processes) sharing the disk, each with params / nproc of the parameters
    io: IoOptions = field(default_factory=IoOptions)
    progress: bool = True

    def check(self) -> None:
        if self.nproc < 1:
            raise UsageError(f"--nproc must be >= 1, got {self.nproc}")
        if self.nproc > self.params:  # a rank with no parameter has no optimizer to time
            raise UsageError(
                f"--nproc {self.nproc} is more than --params {self.params}: each rank needs a parameter at least"
            )
        if self.steps < 1 or self.warmup < 0:
            raise UsageError(f"--steps must be >= 1 and --warmup >= 0, got {self.steps} and {self.warmup}")
        if self.device not in DEVICES:  # the ranks and the step compare it to "cuda": no GPU index here
            raise UsageError(f"--device must be {', '.join(DEVICES)}, got {self.device!r}")
        check_device(self.device)
        if self.dtype not in DTYPES:
            raise UsageError(f"--dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        self.check_memory()

    def check_memory(self, state: int = 0) -> None:
        """Refuse a run whose host memory cannot fit what is available now: past it the kernel's OOM killer ends
        the run with no word, or ends another process. It holds the synthetic values and gradients of the
        parameters (``synthetic_params``: two tensors of the dtype each; on a GPU they live in HBM, the host holds
        one tensor at a time) and ``state``: the optimizer state all ranks keep in host memory, up to each one's
        host budget (``check_knobs`` counts it from the plan the optimizer would make)."""
        from tiered.checkpoint.convert import available_memory

        on_gpu = self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available())
        tensors = 0 if on_gpu else 2 * self.params * DTYPES[self.dtype].itemsize
        need, free = tensors + state, available_memory()
        if need > free:
            parts = []
            if tensors:
                parts.append(f"the synthetic {self.dtype} parameters and their gradients ({format_size(tensors)})")
            if state:
                ranks = f" of each of {self.nproc} ranks" if self.nproc > 1 else ""
                parts.append(
                    f"the optimizer state kept in memory up to the --host-budget{ranks} ({format_size(state)})"
                )
            fix = "a smaller --params" + (" or --host-budget" if state else "")
            raise UsageError(
                f"--params {self.params:,} needs {format_size(need)} of host memory for {' and '.join(parts)}, "
                f"and {format_size(free)} is available here: use {fix}"
            )


@dataclass
class OptimResult:
    params: int
    dtype: str
    device: str
    host_budget: int
    gpu_budget: int
    state_bytes: int
    chunk_bytes: int
    chunks: int
    warmup: int
    steps: int
    step_s: Stat
    phases_s: dict[str, float]  # median over the timed steps, per phase
    nvme_read_bytes: int  # per step (the last timed one)
    nvme_write_bytes: int
    host_hit_bytes: int
    read_gbps: float  # the io sweep's, at `io_config`
    write_gbps: float
    io_config: dict[str, Any]
    floor_s: float | None  # None when the step touched no NVMe byte
    step_over_floor: float | None
    store: dict[str, Any]  # TieredStore.stats() after the last step, cumulative, as the store reports it
    io: IoResult | None  # the sweep that measured the bandwidth (None inside the tour, which has its own)
    notes: list[str] = field(default_factory=list)
    tier_bytes: dict[str, dict[str, int]] = field(default_factory=dict)  # per tier, the last step only
    ranks: list[RankFigures] = field(default_factory=list)  # with --nproc N > 1: each rank's own figures
    summary: str = ""  # the optimizer's own one-line telemetry of its last step (opt.summary())


def run_optim(
    opts: OptimOptions, ws: Workspace, *, io: IoResult | None = None, optimizer_cls: Any = None
) -> OptimResult:
    """Measure the io sweep (unless `io` is given: the tour's), then time the steps.

    `optimizer_cls` defaults to tiered.TieredOptimizer; tests pass a fake that honours its contract. Before
    the sweep, `opts.check()` refuses parameters and gradients the host memory cannot hold, and `check_knobs`
    what the real optimizer would refuse, a disk too small for its state included (the optimizer checks that
    again once built, and its ENOSPC is a UsageError too).
    """
    opts.check()
    if optimizer_cls is None:
        from tiered import TieredOptimizer as optimizer_cls

        check_knobs(opts, ws)  # before the sweep spends a minute on the disk
    cls = optimizer_cls
    own_io = io is None
    if io is None:
        io = run_io(opts.io, ws)
    cfg = io.best_config()
    cuda = opts.device == "cuda" or (opts.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    if opts.nproc > 1:
        from .ranks import run_ranks

        per_rank = run_ranks(opts, ws.path("optim-state"), cfg)
        stats, lasts = aggregate(per_rank)
        res = summarize(opts, stats, lasts, io, device=str(device), own_io=own_io)
        res.ranks = [RankFigures.of(k, r[1], r[0]) for k, r in enumerate(per_rank)]
        return res
    params = synthetic_params(opts.params, device, DTYPES[opts.dtype])
    try:
        stats, lasts, before = time_steps(opts, cls, params, ws.path("optim-state"), cfg, cuda)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise no_room(ws, e) from e
    res = summarize(opts, stats, lasts, io, device=str(device), own_io=own_io)
    res.tier_bytes = tier_bytes(before.get("store", {}), stats.get("store", {}))
    if stats.get("telemetry"):  # a fake optimizer in the tests may have none
        # Without its ratio to the floor: the report's one ratio is to this run's sweep, not to a rate the
        # optimizer may have read from a cache written by another run under another load.
        res.summary = summary_line(stats["steps"], lasts[-1], stats["telemetry"], floor=False)
    return res


def no_room(ws: Workspace, e: OSError) -> UsageError:
    """The optimizer's ENOSPC (its message: the need, what is free and the host budget that would fit) as a
    usage error naming --dir."""
    return UsageError(f"--dir {ws.root}: {e.strerror or e}")


def check_knobs(opts: OptimOptions, ws: Workspace) -> None:
    """What TieredOptimizer would refuse in these knobs, refused now as a UsageError with its message: each
    knob (``TierConfig``), a host budget that cannot hold one chunk of the layout the optimizer would cut
    (``plan_budget``, as ``assembly.build`` calls it) and a disk under ``ws`` without room for the state beyond
    the host budget (``check_free_space``, as ``build`` calls it; each rank's, with --nproc). Then the host memory
    again (``check_memory``), with the state that plan keeps in memory (every rank's) beside the parameters. The
    parameters are meta tensors: only their sizes and dtype matter."""
    from io_engine import pool_bytes
    from tiered.arguments import check_free_space
    from tiered.config import TierConfig
    from tiered.layout.chunking import Layout
    from tiered.layout.sizes import ROW_ALIGN
    from tiered.optim.budget import budget_for_disk, in_hbm, plan_budget
    from tiered.optim.host_update import staging_sizes
    from tiered.shares import CHUNKS_IN_FLIGHT

    from .steps import TENSOR_NUMEL

    cuda = opts.device == "cuda" or (opts.device == "auto" and torch.cuda.is_available())
    knobs: dict[str, Any] = dict(host_budget=opts.host_budget, gpu_budget=opts.gpu_budget)
    if opts.chunk_bytes is not None:
        knobs["chunk_bytes"] = opts.chunk_bytes
    if opts.split_masters is not None:
        knobs["split_masters"] = opts.split_masters
    if opts.update_on != "auto":
        knobs["update_on"] = opts.update_on
    try:
        config = TierConfig(**knobs).resolve(cuda=cuda)
        n = -(-opts.params // opts.nproc)  # the largest rank's share
        dtype = DTYPES[opts.dtype]
        meta = [torch.empty(min(TENSOR_NUMEL, n - i), dtype=dtype, device="meta") for i in range(0, n, TENSOR_NUMEL)]
        moments = cast(torch.dtype, config.moments_dtype)  # parsed: a dtype, as are the sizes ints
        layout = Layout(int(config.chunk_bytes), moments, bool(config.split_masters), dtype == torch.bfloat16)
        chunks = layout.plan([meta])
        host_cuda = cuda and config.update_on != "device"
        numel = max(c.numel for c in chunks)
        slots = config.prefetch_depth + 1
        staging = pool_bytes(staging_sizes(numel, slots, any(c.split for c in chunks))) if host_cuda else 0
        hbm = in_hbm([c.nbytes for c in chunks], int(config.gpu_budget) if cuda else 0)
        streamed = [c.nbytes for c, h in zip(chunks, hbm) if not h]
        window = CHUNKS_IN_FLIGHT if config.update_on == "device" else 2  # the pipeline's, as build plans it
        plan = plan_budget(streamed, int(config.host_budget), staging, config.prefetch_depth,
                           smallest=numel <= ROW_ALIGN, in_flight=window)  # fmt: skip
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from e
    opts.check_memory(opts.nproc * held_in_memory(plan, streamed))
    what = "the optimizer state" + (f" of {opts.nproc} ranks" if opts.nproc > 1 else "")

    def fitting(free: int) -> int:  # the host budget whose ranks would leave no more than `free` on disk
        return budget_for_disk(streamed, staging, config.prefetch_depth, free // opts.nproc, plan.in_flight)

    try:
        check_free_space(str(ws.path("")), opts.nproc * plan.disk_bytes, what, fitting)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise no_room(ws, e) from e


def held_in_memory(plan: Any, streamed: list[int]) -> int:
    """The host bytes one rank's optimizer state takes under ``plan`` (``plan_budget``'s, for the chunks of
    ``streamed`` bytes): the gradient staging, the chunks resident for good, and the streamed ones in flight at
    once (read-ahead, update, write-back), each in whole pages as the host budget counts it."""
    from io_engine import pool_bytes

    sizes = [pool_bytes([n]) for n in streamed]
    in_flight = min(plan.prefetch_depth + plan.in_flight, len(sizes) - plan.resident) * max(sizes, default=0)
    return plan.staging + sum(sizes[: plan.resident]) + min(in_flight, plan.stream_reserve)


def aggregate(per_rank: list[tuple[dict[str, Any], list[dict[str, float]]]]) -> tuple[dict, list[dict]]:
    """The ranks as one step: each step as slow as its slowest rank, the bytes of all ranks together (they
    share one disk), the state of all ranks."""
    stats = dict(per_rank[0][0])
    stats["state_bytes"] = sum(s["state_bytes"] for s, _ in per_rank)
    stats["chunks"] = sum(s["chunks"] for s, _ in per_rank)
    lasts = []
    for steps in zip(*(lasts for _, lasts in per_rank)):
        lasts.append({k: (sum if "bytes" in k else max)(s[k] for s in steps) for k in steps[0]})
    return stats, lasts


@dataclass
class RankFigures:
    rank: int
    step_s: Stat
    nvme_read_bytes: int  # per step (the last timed one)
    nvme_write_bytes: int
    state_bytes: int

    @classmethod
    def of(cls, rank: int, lasts: list[dict[str, float]], stats: dict[str, Any]) -> RankFigures:
        return cls(rank, Stat.of([s["step_s"] for s in lasts]), int(lasts[-1]["nvme_read_bytes"]),
                   int(lasts[-1]["nvme_write_bytes"]), int(stats["state_bytes"]))  # fmt: skip


def tier_bytes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Bytes each tier moved in the last step: the store's per-tier byte counters, after minus before.

    Only counters named *bytes* in the per-tier sections are taken; gauges (in_use, peak, budget) are not
    counters and a difference of them means nothing.
    """
    out: dict[str, dict[str, int]] = {}
    for tier in ("gpu", "host", "nvme"):
        a, b = after.get(tier), before.get(tier) or {}
        if isinstance(a, dict):
            out[tier] = {k: int(v - b.get(k, 0)) for k, v in a.items() if "bytes" in k and isinstance(v, int | float)}
    return out


def summarize(
    opts: OptimOptions, stats: dict[str, Any], lasts: list[dict[str, float]], io: IoResult, *, device: str, own_io: bool
) -> OptimResult:
    last = lasts[-1]
    r_bytes, w_bytes = int(last["nvme_read_bytes"]), int(last["nvme_write_bytes"])
    read_gbps, write_gbps = io.best.read_gbps, io.best.write_gbps
    notes: list[str] = []
    floor: float | None = r_bytes / (read_gbps * 1e9) + w_bytes / (write_gbps * 1e9)
    step = Stat.of([s["step_s"] for s in lasts])
    if r_bytes + w_bytes == 0:
        floor = None
        notes.append("the state fits the host budget: the step touched no NVMe byte, so there is no disk floor")
    return OptimResult(
        params=opts.params,
        dtype=opts.dtype,
        device=device,
        host_budget=opts.host_budget,
        gpu_budget=opts.gpu_budget,
        state_bytes=int(stats["state_bytes"]),
        chunk_bytes=int(stats["chunk_bytes"]),
        chunks=int(stats["chunks"]),
        warmup=opts.warmup,
        steps=opts.steps,
        step_s=step,
        phases_s={k: round(statistics.median(s[k] for s in lasts), 4) for k in TIME_PHASES},
        nvme_read_bytes=r_bytes,
        nvme_write_bytes=w_bytes,
        host_hit_bytes=int(last["host_hit_bytes"]),
        read_gbps=read_gbps,
        write_gbps=write_gbps,
        io_config=io.config,
        floor_s=None if floor is None else round(floor, 4),
        step_over_floor=None if floor is None else round(step.median / floor, 3),
        store=stats["store"],
        io=io if own_io else None,
        notes=notes,
    )
