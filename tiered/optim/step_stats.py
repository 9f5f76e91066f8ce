"""Where one optimizer step's time and bytes went, for ``TieredOptimizer.stats()`` and the benchmarks; after
each step also its telemetry (telemetry.py: the distance to the disk floor, the bound, the SSD wear).

Under torch.distributed every rank's ``stats()`` names its ``rank`` and ``world_size``, and
``gather_stats(opt)`` collects them on rank 0 (a list in rank order), where the spread between ranks shows.

Call order: ``clock = times.start(store, link)``, a fresh ``StepClock``; the step adds to its phases as it goes
(``clock.add(name, seconds)`` or ``with clock.timed(name):``; the step fills ``clip_s`` (``max_grad_norm``'s
norm and scale), the pipeline and the strategies ``read_wait_s``, ``grad_d2h_s``, ``update_s``, ``h2d_s``, the
update under backward ``drain_s``, ``settle_s`` and ``under_backward_bytes``); ``times.finish(clock, store,
chunk_bytes, link)`` takes the bytes from the store's counters and the optimizer's link counts (optim/link.py:
``link_up_bytes``, ``link_down_bytes``, what its copies moved between host memory and the GPU since the last step
ended, an update under backward's included) and closes the step. The store's counters are read once a step, at
its end, so that reads running ahead into the next step count for the next step, where they are used.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from ..telemetry import DiskRate, Wear, report

__all__ = ["PHASES", "StepClock", "StepTimes", "rank_and_world", "gather_stats", "optimizer_stats"]

PHASES = ("step_s", "clip_s", "read_wait_s", "grad_d2h_s", "update_s", "h2d_s", "write_wait_s", "drain_s", "settle_s",
          "nvme_read_bytes", "nvme_write_bytes", "host_hit_bytes", "under_backward_bytes", "link_up_bytes",
          "link_down_bytes")  # fmt: skip


class StepClock:
    """One step's sums by phase (the names in ``PHASES``): seconds, and the bytes of ``under_backward_bytes``.
    A name outside ``PHASES`` is a KeyError, so that a phase nobody reads cannot be filled by mistake."""

    def __init__(self) -> None:
        self._sums = dict.fromkeys(PHASES, 0.0)

    def add(self, name: str, amount: float) -> None:
        """Add ``amount`` (seconds, or bytes) to phase ``name``."""
        self._sums[name] += amount

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Add the block's wall time (``time.perf_counter``) to phase ``name``, however it ends."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def as_dict(self) -> dict[str, float]:
        """The sums, every phase named (a copy)."""
        return dict(self._sums)


class StepTimes:
    """The last step's phases (``last``) and their sums over all steps (``total``)."""

    def __init__(self, rate: DiskRate | None, wear: Wear, update_on: str, device_type: str) -> None:
        """``device_type``: where a chunk updates with ``update_on="device"`` (the parameters' device type)."""
        self.last = dict.fromkeys(PHASES, 0.0)
        self.total = dict.fromkeys(PHASES, 0.0)
        self.rate, self.wear, self.update_on, self.device_type = rate, wear, update_on, device_type
        self.telemetry: dict[str, Any] = {}  # telemetry.report of the last step, with its wear
        self._mark: dict[str, Any] | None = None  # the store's counters when the last step ended
        self._link_mark: tuple[int, int] | None = None  # the link's (up, down) totals then
        self._t0 = 0.0

    def start(self, store: Any, link: tuple[int, int]) -> StepClock:
        """A step begins: the clock its phases add up on. ``link``: the optimizer's (up, down) link totals."""
        self._t0 = time.perf_counter()
        if self._mark is None:  # the first step: what building the state wrote is not the step's
            self._mark = store.stats()
        if self._link_mark is None:  # nor what loading it moved
            self._link_mark = link
        return StepClock()

    def finish(self, clock: StepClock, store: Any, chunk_bytes: int, link: tuple[int, int]) -> None:
        """Close a step whose chunks hold ``chunk_bytes`` of state, given the clock it ran on, its store and the
        optimizer's (up, down) link totals now."""
        after, before = store.stats(), self._mark
        assert before is not None and self._link_mark is not None, "finish() before start()"
        last = clock.as_dict()
        last["link_up_bytes"], last["link_down_bytes"] = (float(n - m) for n, m in zip(link, self._link_mark))
        self._link_mark = link
        last["nvme_read_bytes"] = _delta(after, before, "nvme", "bytes_read")
        # The writes the step began: its last write-backs land after it returns, and counting them as they land
        # gave a step one or two chunks less, or more, by timing (bench/optim.py's floor and wear read this).
        last["nvme_write_bytes"] = _delta(after, before, "nvme", "write_started_bytes")
        # Chunk bytes this step found in host memory, i.e. did not have to read from NVMe.
        last["host_hit_bytes"] = max(0.0, chunk_bytes - last["nvme_read_bytes"])
        # Within the time pinning blocked, the part spent waiting for room that write-backs free.
        last["write_wait_s"] = min(last["read_wait_s"], after["room_wait_s"] - before["room_wait_s"])
        last["read_wait_s"] -= last["write_wait_s"]
        self._mark = after
        last["step_s"] = time.perf_counter() - self._t0
        self.last = last
        for k, v in last.items():
            self.total[k] += v
        self.telemetry = report(last, self.rate, self.update_on, self.device_type)
        written = after.get("nvme", {}).get("bytes_written", 0)
        self.telemetry["wear"] = self.wear.report(last["nvme_write_bytes"], written)


def _delta(after: dict[str, Any], before: dict[str, Any], tier: str, key: str) -> float:
    return float(after.get(tier, {}).get(key, 0) - before.get(tier, {}).get(key, 0))


def rank_and_world() -> dict[str, int]:
    """``{"rank", "world_size"}`` under an initialized torch.distributed, else ``{}``."""
    import torch.distributed as dist  # here, not at import: torch loads its distributed package lazily

    if dist.is_available() and dist.is_initialized():
        return {"rank": dist.get_rank(), "world_size": dist.get_world_size()}
    return {}


def gather_stats(opt: Any, dst: int = 0) -> list[dict[str, Any]] | None:
    """Every rank's ``opt.stats()`` on rank ``dst``, in rank order; None on the other ranks. Collective: every
    rank calls it. Without torch.distributed: ``[opt.stats()]``."""
    import torch.distributed as dist

    mine = opt.stats()
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(mine, out, dst=dst)
    return out


def optimizer_stats(chunks: list[Any], steps: int, prefetch_depth: int, store: Any, state_bytes: int, times: StepTimes,
                    early: Any, grad_norm: Any = None, grads_kept: int = 0,
                    grads_found: int = 0) -> dict[str, Any]:  # fmt: skip
    """``TieredOptimizer.stats()``: the layout (``chunks``, ``state_bytes``), the steps taken, the last step's phases
    and their sums over all steps, its telemetry, the update under backward's counts (``early``: the
    ``UnderBackward``, or None), the store's, and the global gradient norm ``max_grad_norm``'s clip last measured
    (``grad_norm``, a tensor: a float here; None without a clip), and the bytes of gradient copies that clip left on
    the GPU for the update to read (``grads_kept_bytes``: an offloaded model's, where the GPU had room; of those,
    ``grads_found_bytes`` backward had left there, resident_grads.py)."""
    return {
        "steps": steps,
        "chunks": len(chunks),
        "chunk_bytes": max((c.nbytes for c in chunks), default=0),
        "state_bytes": state_bytes,
        "split_chunks": sum(c.split for c in chunks),
        "prefetch_depth": prefetch_depth,
        "last_step": dict(times.last),
        "total": dict(times.total),
        "telemetry": dict(times.telemetry),
        "under_backward": None if early is None else early.stats(),
        "grad_norm": None if grad_norm is None else float(grad_norm),
        "grads_kept_bytes": grads_kept,
        "grads_found_bytes": grads_found,
        "store": store.stats(),
        **rank_and_world(),
    }
