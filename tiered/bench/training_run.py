"""A training run's figures, as examples/big_model.py and bench/ds_big.py report them: each step's time split
into forward and backward and the optimizer, its loss, the first step's delay, the peaks of GPU and host memory,
and the link's pinned rates; so that the two runs compare key for key. And the GPU cap both take
(``--gpu-memory-cap``) and the profiled step (``--trace``)."""

from __future__ import annotations

import contextlib
import errno
import math
import os
import resource
import statistics
import sys
from collections.abc import Iterator

import psutil
import torch

from io_engine import format_size, parse_size
from tiered.bench.pcie import PcieOptions, pinned_rates, run_pcie

__all__ = ["Steps", "cap_gpu_memory", "measure_link", "peak_host_bytes", "profiled"]


def cap_gpu_memory(cap: str, device: torch.device) -> int:
    """``--gpu-memory-cap``: the caching allocator's limit on ``device``, in bytes. The CUDA context and
    libraries' workspaces are outside it, so a real GPU of that size has somewhat less room."""
    try:
        n = parse_size(cap, name="--gpu-memory-cap")
    except ValueError as e:
        raise SystemExit(str(e)) from None
    total = torch.cuda.get_device_properties(device).total_memory
    if n == 0:
        raise SystemExit("--gpu-memory-cap must be more than 0 bytes")
    if n > total:
        raise SystemExit(f"--gpu-memory-cap {cap} ({format_size(n)}) is more than the {format_size(total)} of "
                         f"this {torch.cuda.get_device_name(device)}: a cap can only make the GPU smaller")  # fmt: skip
    index = torch.cuda.current_device() if device.index is None else device.index  # "cuda" names no index
    torch.cuda.set_per_process_memory_fraction(n / total, index)
    return n


@contextlib.contextmanager
def profiled(path: str | None, device: torch.device) -> Iterator[None]:
    """Under torch.profiler (CPU, and CUDA where ``device`` is a GPU), labelled "step", with its chrome trace
    written to ``path`` after; nothing where ``path`` is None. A trace that was not written is an OSError:
    torch's export reports a file it cannot open only in a C++ log line, and returns."""
    if path is None:
        yield
        return
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=acts) as prof:
        with torch.profiler.record_function("step"):
            yield
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # an older trace there would pass for this one if the export failed
    prof.export_chrome_trace(path)
    if not os.path.isfile(path):
        raise OSError(errno.ENOENT, "torch.profiler could not write the step's trace (see its log above)", path)
    print(f"  the step's trace: {path} (python bench/step_timeline.py {path} --step step)", flush=True)


def peak_host_bytes() -> int:
    """This process's peak resident memory, pinned buffers and mapped files included: the RSS at the end
    misses a peak that has passed (building the model, pinning the state)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux counts KiB, macOS bytes


def measure_link(device: torch.device) -> dict[str, float]:
    """The link's pinned copy rates (GB/s: h2d, d2h, both at once), measured now with 256 MiB copies, before
    the model takes the GPU; the memory they took goes back and the peak counter restarts."""
    rates = pinned_rates(run_pcie(PcieOptions(size=256 << 20, loops=3, device=device.index or 0, progress=False)))
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    print("link (pinned, measured now): " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in rates.items()), flush=True)
    return rates


class Steps:
    """The steps' times and losses, each step's line printed as it ends, and the run's figures for ``--json``."""

    def __init__(self, tokens: int, start: float) -> None:
        self.tokens, self.start = tokens, start  # tokens a step; when the run started
        self.step_s: list[float] = []
        self.compute_s: list[float] = []
        self.optimizer_s: list[float] = []
        self.losses: list[float] = []
        self.first_step_at = 0.0

    def add(self, loss: float, t0: float, t1: float, t2: float) -> None:
        """A step began at ``t0``, its forward and backward ended at ``t1``, its optimizer step at ``t2``."""
        step = len(self.step_s)
        if not math.isfinite(loss):
            raise SystemExit(f"step {step}: the loss is {loss}; lower --lr")
        print(f"step {step:4d}  loss {loss:.4f}  {t2 - t0:.2f} s (forward+backward {t1 - t0:.2f} s, "
              f"optimizer {t2 - t1:.2f} s)  {self.tokens / (t2 - t0):,.0f} tokens/s", flush=True)  # fmt: skip
        self.step_s.append(t2 - t0)
        self.compute_s.append(t1 - t0)
        self.optimizer_s.append(t2 - t1)
        self.losses.append(loss)
        if step == 0:
            self.first_step_at = t2 - self.start
            print(f"first step done {self.first_step_at:.1f} s after start", flush=True)

    def peaks(self, device: torch.device) -> dict[str, float | None]:
        """Print and return the peak GPU memory (None off CUDA) and the process's peak host memory, in GiB."""
        gpu = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        if gpu is not None:
            print(f"peak GPU memory: {gpu:.1f} GiB")
        host = peak_host_bytes() / 2**30
        print(f"peak host memory (this process): {host:.1f} GiB (ru_maxrss), "
              f"{psutil.Process().memory_info().rss / 2**30:.1f} GiB resident now", flush=True)  # fmt: skip
        return {"peak_gpu_GiB": gpu, "peak_host_GiB": host}

    def figures(self) -> dict[str, object]:
        """tokens/s is the median step's; the first step, which also warms up (kernels, allocator, first
        reads), counts only when it is the only one."""
        return dict(
            tokens_per_step=self.tokens,
            first_step_at_s=self.first_step_at,
            step_s=self.step_s,
            compute_s=self.compute_s,
            optimizer_step_s=self.optimizer_s,
            tokens_per_s=statistics.median(self.tokens / s for s in (self.step_s[1:] or self.step_s)),
        )
