"""Where one optimizer step's time and bytes went, for ``TieredOptimizer.stats()`` and the benchmarks; after
each step also its telemetry (telemetry.py: the distance to the disk floor, the bound, the SSD wear).

Under torch.distributed every rank's ``stats()`` names its ``rank`` and ``world_size``, and
``gather_stats(opt)`` collects them on rank 0 (a list in rank order), where the spread between ranks shows.

Call order: ``ph = times.start(store)``; the step adds seconds to ``ph[phase]`` as it goes (the pipeline fills
``read_wait_s``, ``grad_d2h_s``, ``update_s``, ``h2d_s``); ``times.finish(ph, store, streamed_bytes)`` takes
the bytes from the store's counters and closes the step. The store's counters are read once a step, at
its end, so that reads running ahead into the next step count for the next step, where they are used.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..telemetry import DiskRate, Wear, report

if TYPE_CHECKING:
    from .state_chunks import StateChunks

__all__ = ["PHASES", "StepTimes", "rank_and_world", "gather_stats", "optimizer_stats"]

PHASES = ("step_s", "read_wait_s", "grad_d2h_s", "update_s", "h2d_s", "write_wait_s", "drain_s", "settle_s",
          "nvme_read_bytes", "nvme_write_bytes", "host_hit_bytes", "under_backward_bytes")  # fmt: skip


class StepTimes:
    """The last step's phases (``last``) and their sums over all steps (``total``)."""

    def __init__(self, rate: DiskRate | None, wear: Wear, update_on: str) -> None:
        self.last = dict.fromkeys(PHASES, 0.0)
        self.total = dict.fromkeys(PHASES, 0.0)
        self.rate, self.wear, self.update_on = rate, wear, update_on
        self.telemetry: dict[str, Any] = {}  # telemetry.report of the last step, with its wear
        self._mark: dict[str, Any] | None = None  # the store's counters when the last step ended
        self._t0 = 0.0

    def start(self, store: Any) -> dict[str, float]:
        self._t0 = time.perf_counter()
        if self._mark is None:  # the first step: what building the state wrote is not the step's
            self._mark = store.stats()
        return dict.fromkeys(PHASES, 0.0)

    def finish(self, ph: dict[str, float], store: Any, chunk_bytes: int) -> None:
        """Close a step whose chunks hold ``chunk_bytes`` of state, given the store it ran on."""
        after, before = store.stats(), self._mark
        assert before is not None, "finish() before start()"
        ph["nvme_read_bytes"] = _delta(after, before, "nvme", "bytes_read")
        ph["nvme_write_bytes"] = _delta(after, before, "nvme", "bytes_written")
        # Chunk bytes this step found in host memory, i.e. did not have to read from NVMe.
        ph["host_hit_bytes"] = max(0.0, chunk_bytes - ph["nvme_read_bytes"])
        # Within the time pinning blocked, the part spent waiting for room that write-backs free.
        ph["write_wait_s"] = min(ph["read_wait_s"], after["room_wait_s"] - before["room_wait_s"])
        ph["read_wait_s"] -= ph["write_wait_s"]
        self._mark = after
        ph["step_s"] = time.perf_counter() - self._t0
        self.last = ph
        for k, v in ph.items():
            self.total[k] += v
        self.telemetry = report(ph, self.rate, self.update_on)
        self.telemetry["wear"] = self.wear.report(ph["nvme_write_bytes"], after.get("nvme", {}).get("bytes_written", 0))


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


def optimizer_stats(state: StateChunks, state_bytes: int, times: StepTimes, early: Any) -> dict[str, Any]:
    """``TieredOptimizer.stats()``: the layout, the last step's phases and their sums over all steps, its telemetry,
    the update under backward's counts (``early``: the ``UnderBackward``, or None) and the store's."""
    chunks = state.chunks
    return {
        "steps": state.step_count,
        "chunks": len(chunks),
        "chunk_bytes": max((c.nbytes for c in chunks), default=0),
        "state_bytes": state_bytes,
        "split_chunks": sum(c.split for c in chunks),
        "prefetch_depth": state.prefetch_depth,
        "last_step": dict(times.last),
        "total": dict(times.total),
        "telemetry": dict(times.telemetry),
        "under_backward": None if early is None else early.stats(),
        "store": state.store.stats(),
        **rank_and_world(),
    }
