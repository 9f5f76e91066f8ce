"""Host<->GPU copy bandwidth: pinned and pageable host memory, each way alone and both ways at once.

One-way copies are timed with CUDA events around a single copy on a side stream; "both ways" runs an
H2D copy and a D2H copy of the same size on two streams at once and reports the bytes of both over
the wall time. Without CUDA the result says why and the CLI exits 0: a CPU-only machine is a valid
place to run the rest of tiered.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .common import Stat, UsageError, gbps, progress

KINDS = ("pinned", "pageable")
DIRECTIONS = ("h2d", "d2h", "both")


@dataclass(kw_only=True)
class PcieOptions:
    size: int = 1 << 30
    warmup: int = 1
    loops: int = 5
    device: int = 0
    progress: bool = True

    def check(self) -> None:
        if self.size < 1 << 20:
            raise UsageError(f"--size must be at least 1 MiB, got {self.size} bytes")
        if self.loops < 1 or self.warmup < 0:
            raise UsageError(f"--loops must be >= 1 and --warmup >= 0, got {self.loops} and {self.warmup}")


@dataclass
class PcieRow:
    memory: str  # pinned | pageable
    direction: str  # h2d | d2h | both (GB/s of both copies together)
    gbps: Stat


@dataclass
class PcieResult:
    available: bool
    reason: str | None  # why not, when not available
    device: str | None
    size_bytes: int
    warmup: int
    loops: int
    rows: list[PcieRow] = field(default_factory=list)


def cuda_unavailable_reason() -> str | None:
    if torch.version.cuda is None:
        return f"CUDA is not available: this torch ({torch.__version__}) is a CPU-only build; no PCIe to measure"
    if not torch.cuda.is_available():
        return "CUDA is not available: torch was built with CUDA but sees no GPU (driver missing or no device)"
    return None


def run_pcie(opts: PcieOptions) -> PcieResult:
    opts.check()
    reason = cuda_unavailable_reason()
    if reason is not None:
        return PcieResult(False, reason, None, opts.size, opts.warmup, opts.loops)
    if opts.device >= torch.cuda.device_count():
        raise UsageError(f"--device {opts.device}: only {torch.cuda.device_count()} CUDA device(s) here")
    dev = torch.device("cuda", opts.device)
    torch.cuda.set_device(dev)
    n = opts.size
    rows: list[PcieRow] = []
    gpu_a = torch.empty(n, dtype=torch.uint8, device=dev)
    gpu_b = torch.empty(n, dtype=torch.uint8, device=dev)
    with progress(len(KINDS) * len(DIRECTIONS), "pcie", enabled=opts.progress, unit="test") as bar:
        for kind in KINDS:
            pin = kind == "pinned"
            host_a = torch.empty(n, dtype=torch.uint8, pin_memory=pin).fill_(1)
            host_b = torch.empty(n, dtype=torch.uint8, pin_memory=pin).fill_(2)
            cases = {  # mypy infers no type for a lambda with defaults: the ignore below
                "h2d": lambda a=host_a: _one_way(gpu_a, a),
                "d2h": lambda a=host_a: _one_way(a, gpu_a),
                "both": lambda a=host_a, b=host_b: _both_ways(gpu_a, a, b, gpu_b),  # type: ignore[misc]
            }
            for direction in DIRECTIONS:
                for _ in range(opts.warmup):
                    cases[direction]()
                secs = [cases[direction]() for _ in range(opts.loops)]
                nbytes = 2 * n if direction == "both" else n
                rows.append(PcieRow(kind, direction, Stat.of([gbps(nbytes, s) for s in secs])))
                bar.update(1)
            del host_a, host_b
    return PcieResult(True, None, torch.cuda.get_device_name(dev), n, opts.warmup, opts.loops, rows)


def pinned_rates(result: PcieResult) -> dict[str, float]:
    """The median GB/s of pinned copies, by direction (``h2d``, ``d2h``, ``both``), from a ``run_pcie`` result."""
    return {row.direction: row.gbps.median for row in result.rows if row.memory == "pinned"}


def link_floor_s(up: int, down: int, rates: dict[str, float]) -> float:
    """The least time ``up`` bytes host-to-device and ``down`` device-to-host take on a link of ``rates``
    (``pinned_rates``): each direction at its own rate, and both together at the rate of both at once. What a
    pass that moves them cannot beat, however well its copies hide under its kernels."""
    if up < 0 or down < 0:
        raise ValueError(f"byte counts must be >= 0, got up={up}, down={down}")
    if min(rates[d] for d in DIRECTIONS) <= 0:
        raise ValueError(f"link rates must be > 0 GB/s, got {rates}")
    return max(up / (rates["h2d"] * 1e9), down / (rates["d2h"] * 1e9), (up + down) / (rates["both"] * 1e9))


def _one_way(dst: torch.Tensor, src: torch.Tensor) -> float:
    stream = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _both_ways(gpu_dst: torch.Tensor, host_src: torch.Tensor, host_dst: torch.Tensor, gpu_src: torch.Tensor) -> float:
    # Two streams, so the copy engines can run H2D and D2H at once; wall time covers both.
    up, down = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(up):
        gpu_dst.copy_(host_src, non_blocking=True)
    with torch.cuda.stream(down):
        host_dst.copy_(gpu_src, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0
