"""``update_on="host"``: gradients down, torch's fused AdamW on the CPU over the pinned record, weights up.

``slots`` gradient copies are in flight at most, one per pinned slot; the pipeline says which chunk's copy
starts when (``UpdateStrategy``, strategy.py): ``stage_ahead(work, j)`` starts chunk j's into slot
``j % slots``, for the first chunks before the stream and for chunk i + ``slots`` once chunk i's update has
freed that slot. ``update(work, i, record, clock)`` waits for chunk i's gradients only, updates the record in
place and sends its new weights up on a side stream. ``end_step`` makes the compute stream wait for both
side streams before the next forward.

On a CPU model there is nothing to move: the gradients are fp32 views of ``param.grad`` (a copy only for
low-precision grads) and the new weights are copied into the parameters directly.

Chunks that split their masters (master_split.py) also need their parameters' bf16 bits on the host,
and send back bf16 weights rather than fp32 masters: the gradient copy brings both, and the weights go
up from one of two pinned buffers.

Why gather and cast on the GPU: a bf16 gradient becomes fp32 at HBM speed there, and one D2H copy of a
contiguous fp32 chunk runs at full PCIe speed, where casting on the host would cost CPU memory bandwidth
that the update needs.
"""

from __future__ import annotations

from typing import Any

import torch

from io_engine import PinnedBufferPool

from ..layout.chunking import Chunk
from .groups import Groups
from .step_stats import StepClock
from .strategy import UpdateStrategy
from .transfer import Work

__all__ = ["HostUpdate", "staging_sizes"]


def staging_sizes(chunk_numel: int, slots: int, split: bool) -> list[int]:
    """Pinned buffers a CUDA ``HostUpdate`` takes from its pool: fp32 grads per slot, and with split
    masters bf16 parameter bits per slot plus two bf16 upload buffers."""
    return [chunk_numel * 4] * slots + ([chunk_numel * 2] * (slots + 2) if split else [])


class HostUpdate(UpdateStrategy):
    def __init__(self, params: list[torch.Tensor], groups: Groups, updater: Any,
                 chunk_numel: int, slots: int, pool: PinnedBufferPool | None, *, split: bool = False):  # fmt: skip
        """``slots`` gradient copies in flight (prefetch depth + 1), in pinned buffers from ``pool`` (CUDA)."""
        super().__init__(params, groups, updater)
        self.slots = slots
        self._host16: list = []
        self._up_host: list = []
        self._host: list = []
        if split and not self.cuda:  # CPU parameters: gather and hand out in ordinary memory
            self._bits = torch.empty(chunk_numel, dtype=torch.bfloat16)
            self._up_cpu = torch.empty(chunk_numel, dtype=torch.bfloat16)
        if not self.cuda:
            return
        if any(not p.is_cuda for p in params):
            raise ValueError("all parameters must be on one kind of device (all CUDA or all CPU)")
        device = params[0].device
        if pool is None:
            raise ValueError("a pinned pool is needed for CUDA parameters")
        self._d2h = torch.cuda.Stream(device)
        self._h2d = torch.cuda.Stream(device)
        self._host = [pool.acquire(chunk_numel * 4) for _ in range(slots)]
        self._dev = [torch.empty(chunk_numel, dtype=torch.float32, device=device) for _ in range(slots)]
        self._up = [torch.empty(chunk_numel, dtype=torch.float32, device=device) for _ in range(2)]
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._up_turn = 0
        self._up_events: list[torch.cuda.Event | None] = [None, None]  # the last upload from each turn
        if split:
            self._host16 = [pool.acquire(chunk_numel * 2) for _ in range(slots)]
            self._dev16 = [torch.empty(chunk_numel, dtype=torch.bfloat16, device=device) for _ in range(slots)]
            self._up_host = [pool.acquire(chunk_numel * 2) for _ in range(2)]
            self._up16 = [torch.empty(chunk_numel, dtype=torch.bfloat16, device=device) for _ in range(2)]

    # ------------------------------------------------------------------------------------------ a step
    def stage_ahead(self, work: Work, j: int) -> None:
        """Start chunk ``work[j]``'s gradient copy into slot ``j % slots``, which no update reads any more."""
        self.launch_grads(work[j][0], j % self.slots)

    def update(self, work: Work, i: int, state: torch.Tensor, clock: StepClock) -> Any:
        """Fused AdamW on the CPU over chunk i's pinned record; its new weights sent up."""
        chunk, js = work[i]
        group = self.param_groups[chunk.group]
        with clock.timed("grad_d2h_s"):
            grads = self.grads(chunk, i % self.slots, js)
        with clock.timed("update_s"):
            if chunk.split:
                weights = self.up_buffer(chunk)
                bits = self.param_bits(chunk, i % self.slots)
                self.updater.update_split(chunk, js, state, grads, group, bits, weights)
            else:
                self.updater.update(chunk, js, state, grads, group)
        with clock.timed("h2d_s"):
            if chunk.split:
                return self._push(chunk, weights, js, self._up16 if self.cuda else [])
            return self.push_params(chunk, state[0, : chunk.numel], js)

    def update_resident(self, chunk: Chunk, js: list[int], state: torch.Tensor) -> None:
        """Update a chunk whose record the store keeps in HBM (``gpu_budget``) where it lies, on the compute
        stream: gradients and parameters are there already. Such chunks hold whole masters (config.py)."""
        assert not chunk.split, "split masters with gpu_budget need update_on='device'"
        grads = self.host_grads(chunk, js)  # fp32 views of the gradients where they are: the record's device
        self.updater.update(chunk, js, state, grads, self.param_groups[chunk.group])
        self.scatter(chunk, state[0], js)

    def begin_step(self) -> None:
        if self.cuda:
            self._streams_wait_for_compute(self._d2h, self._h2d)

    def end_step(self) -> None:
        if self.cuda:
            self._compute_waits_for(self._d2h, self._h2d)

    # ----------------------------------------------------------------------------------------- grads
    def launch_grads(self, chunk: Chunk, slot: int) -> None:
        """Start copying ``chunk``'s gradients (as fp32) into host slot ``slot`` (CUDA only)."""
        if not self.cuda:
            return
        dev = self._dev[slot]
        with torch.cuda.stream(self._d2h):
            with_grad = [j for j, pc in enumerate(chunk.pieces) if self.params[pc.param].grad is not None]
            self.gather_grads(chunk, dev, with_grad)
            host = self._host[slot].view(torch.float32)[: chunk.numel]
            host.copy_(dev[: chunk.numel], non_blocking=True)
            self.link.add(dev, host)
            if chunk.split:
                bits = self.gather_params(chunk, self._dev16[slot][: chunk.numel])
                host16 = self._host16[slot].view(torch.bfloat16)[: chunk.numel]
                host16.copy_(bits, non_blocking=True)
                self.link.add(bits, host16)
            ev = torch.cuda.Event()
            ev.record(self._d2h)
        self._events[slot] = ev

    def grads(self, chunk: Chunk, slot: int, pieces: list[int]) -> list[torch.Tensor]:
        """fp32 host gradients of ``chunk.pieces[j]`` for j in ``pieces``; waits for their copy."""
        if not self.cuda:
            return self.host_grads(chunk, pieces)
        ev = self._events[slot]
        if ev is not None:
            ev.synchronize()
        host = self._host[slot].view(torch.float32)
        return [host[chunk.pieces[j].in_chunk] for j in pieces]

    def param_bits(self, chunk: Chunk, slot: int) -> torch.Tensor:
        """The bf16 parameters of a split chunk, laid out as its state row, on the host. On CUDA the
        copy ``launch_grads`` started (call ``grads`` first: it waits for it); on CPU a gather."""
        if self.cuda:
            return self._host16[slot].view(torch.bfloat16)[: chunk.numel]
        return self.gather_params(chunk, self._bits[: chunk.numel])

    # ---------------------------------------------------------------------------------------- params
    def up_buffer(self, chunk: Chunk) -> torch.Tensor:
        """A host bf16 buffer for a split chunk's new weights. On CUDA one of two pinned buffers, taken
        once the upload that last read it has finished."""
        if not self.cuda:
            return self._up_cpu[: chunk.numel]
        ev = self._up_events[self._up_turn]
        if ev is not None:
            ev.synchronize()
        return self._up_host[self._up_turn].view(torch.bfloat16)[: chunk.numel]

    def push_params(self, chunk: Chunk, master: torch.Tensor, pieces: list[int]) -> torch.cuda.Event | None:
        """Copy the new master weights of ``pieces`` into the parameters, cast to their dtype.

        Returns an event (CUDA) after which ``master`` may be reused, else None.
        """
        return self._push(chunk, master, pieces, self._up if self.cuda else [])

    def _push(self, chunk: Chunk, row: torch.Tensor, pieces: list[int], device_rows: list[torch.Tensor]) -> Any:
        """Host ``row`` -> ``pieces`` of the parameters (cast to their dtype). On CUDA through one of two
        device rows of the row's dtype, on the upload stream; returns the upload's event."""
        if not self.cuda:
            self.scatter(chunk, row, pieces)
            return None
        turn = self._up_turn
        self._up_turn ^= 1
        up = device_rows[turn][: chunk.numel]
        with torch.cuda.stream(self._h2d):
            up.copy_(row, non_blocking=True)
            self.link.add(row, up)
            self.scatter(chunk, up, pieces)
            ev = torch.cuda.Event()
            ev.record(self._h2d)
        self._up_events[turn] = ev
        return ev

    def close(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.params[0].device)
            for b in (*self._host, *self._host16, *self._up_host):
                b.release()
            self._host, self._dev, self._up, self._host16, self._up_host = [], [], [], [], []
