"""The HBM tier of TieredStore: GPU copies of records, counted against ``gpu_budget``.

``GpuTier`` builds on ``HostTier`` (host_tier.py): a record moving down from HBM takes a host buffer, or
is written straight to its file when it is larger than ``host_budget``; one moving up comes from its
host buffer or, likewise, straight from its file. These moves are synchronous (kind "move") and run in
the caller's thread. Without CUDA ``gpu_budget`` is 0 and none of this runs (tests fake the tier with
CPU tensors by setting ``gpu_budget`` and ``_device``).

``_materialize`` lives here too: it is ``pin``'s engine, bringing a pinned record into the tier the caller
asked for, and as the top of the tier stack it is the one place that moves records through either tier.
"""

from __future__ import annotations

from typing import Any

import torch

from io_engine import format_size

from .host_tier import HostTier
from .records import BudgetError, Record, Tier, pending_future

__all__ = ["GpuTier"]


class GpuTier(HostTier):
    """HBM records of a ``TieredStore``: moves up and down, the budget, and pinning into a tier. Not used alone."""

    # Set by TieredStore.__init__. ``_gpu_used`` and ``_gpu_peak`` change only under the store's lock.
    gpu_budget: int  # 0: no HBM tier
    _device: torch.device | None  # where HBM records live
    _side: Any  # the CUDA side stream for copies, made on first use
    _gpu_used: int
    _gpu_peak: int

    # ---------------------------------------------------------------------------------------- pinning
    def _materialize(self, rec: Record, tier: Tier | None) -> torch.Tensor:
        """Pinned ``rec`` -> its tensor in ``tier`` (None: where it is, else host), moving it there."""
        counted = False
        while True:
            with self._lock:
                self._alive(rec)
                target = tier or ("gpu" if rec.gpu is not None else "host")
                if not counted:
                    hit = rec.gpu is not None if target == "gpu" else rec.in_host or rec.kind in ("load", "queued")
                    self._count(target, rec, hit)
                    counted = True
                if rec.kind is None and target == "gpu" and rec.gpu is not None:
                    return rec.gpu
                if rec.kind is None and target == "host" and rec.in_host:
                    return rec.view()
                rec.keep = rec.keep or rec.kind == "write"
                busy = rec.op if rec.kind in ("write", "move") else None
            if busy is not None:
                self._wait(busy, swallow=True)  # someone else's write or move: its owner reports errors
            elif target == "gpu" and rec.gpu is None and (rec.in_host or rec.footprint > self.host_budget):
                self._gpu_up(rec)
            else:
                fut, _ = self._begin_host(rec, block=True)
                if fut is not None:
                    self._wait(fut)  # our read: a corrupt or missing file raises here

    # -------------------------------------------------------------------------------------- GPU moves
    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not (dst.is_cuda or src.is_cuda):
            dst.copy_(src)
            return
        dev = dst.device if dst.is_cuda else src.device
        self._side = self._side or torch.cuda.Stream(device=dev)
        # The side stream first waits for the user's pending kernels on the tensor; we wait for the copy.
        self._side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(self._side):
            dst.copy_(src, non_blocking=True)
        self._side.synchronize()

    def _reserve_gpu(self, rec: Record) -> None:
        """Count ``rec`` against gpu_budget, moving unpinned GPU records down (policy order) for room."""
        while True:
            with self._lock:
                if self._gpu_used + rec.nbytes <= self.gpu_budget:
                    self._gpu_used += rec.nbytes
                    self._gpu_peak = max(self._gpu_peak, self._gpu_used)
                    return
                cands = [k for k, r in self._recs.items() if r.gpu is not None and r.kind is None and not r.pins]
                victims = self._policy.victims(cands, incoming=rec.key, urgent=True)
                if not victims:
                    raise BudgetError(f"gpu_budget {format_size(self.gpu_budget)} cannot make room for record "
                                      f"{rec.key!r} ({format_size(rec.nbytes)}): the GPU tier holds only pinned "
                                      "or moving records. Leave pin blocks sooner, or raise gpu_budget")  # fmt: skip
            self._gpu_down(self._recs[victims[0]])

    def _gpu_down(self, rec: Record) -> None:
        """GPU -> host (-> NVMe when the host budget cannot hold it), synchronously."""
        with self._lock:
            if rec.gpu is None or rec.kind is not None:
                return
            rec.op, rec.kind = pending_future(), "move"
        try:
            buf = None
            if rec.footprint <= self.host_budget:
                buf = self._acquire(rec, urgent=True, block=True, protect=frozenset([rec.key]))
                self._copy(buf.tensor[: rec.nbytes].view(rec.dtype).view(rec.shape), rec.gpu)  # type: ignore[arg-type]
            elif rec.dirty or not rec.on_disk:
                self._write_now(rec, rec.gpu)  # type: ignore[arg-type]
            with self._lock:
                rec.buf, rec.gpu, self._gpu_used = buf, None, self._gpu_used - rec.nbytes
        finally:
            self._finish(rec)

    def _gpu_up(self, rec: Record) -> None:
        """Host (or NVMe, for records the host budget cannot hold) -> GPU, synchronously."""
        with self._lock:
            if rec.gpu is not None or rec.kind is not None:
                return
            rec.op, rec.kind = pending_future(), "move"
        reserved = False
        try:
            self._reserve_gpu(rec)
            reserved = True
            gpu = torch.empty(rec.shape, dtype=rec.dtype, device=self._device)
            if rec.buf is None:
                staging = torch.empty(rec.nbytes, dtype=torch.uint8)
                self._read_now(rec, staging)
            self._copy(gpu, rec.view() if rec.buf is not None else staging.view(rec.dtype).view(rec.shape))
            with self._lock:
                rec.gpu, free, rec.buf, reserved = gpu, rec.buf, None, False
            if free is not None:
                free.release()
                self._drain()
        finally:
            if reserved:
                with self._lock:
                    self._gpu_used -= rec.nbytes
            self._finish(rec)
