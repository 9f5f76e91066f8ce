"""Which of an offloaded model's gradient sums a backward keeps on the GPU for the optimizer's clip
(tiered.optim.resident_grads), and the room they may take there.

The sums offload/accumulation.py makes on the GPU are, a block at a time, views of FSDP2's flat reduced gradients
of that block. Kept, they hold that memory from backward to the step, so what backward keeps must fit beside what
every later block's backward takes again: the GPU limit less the peak of a pass that kept nothing, less what is
kept already and a margin (``auto_budget.backward_room``).

That peak is measured, not assumed: the first ``MEASURED_PASSES`` backwards, and the first that adds held sums on
the GPU (which copies them up), keep none and record it at their end. A model's first pass is not every pass: it
runs before the optimizer's buffers and without the blocks copied ahead (offload/prefetch.py learns their order in
it). A 12.4B Llama's first backward peaked at 4.39 GiB, its next ones at 5.01 GiB, and with the room measured on
the first it ran out of memory under a 12 GB cap (bench/RESULTS.md, twenty-second session).

What is kept is counted by the memory it holds (``resident_grads.storage_bytes``), sums chosen but not yet offered
by the worker included, and a block's sums are kept all or none: one view keeps the block's whole reduced
gradients, and its norms' weights kept alone, beside none of its matrices, once held 0.38 GiB each uncounted
(twenty-third session: the 12.4B under the 12 GB cap out of memory again).
"""

from __future__ import annotations

import threading
from typing import Any, cast

import torch

from ..auto_budget import backward_room
from ..optim import resident_grads

__all__ = ["CPU_ROOM", "MEASURED_PASSES", "KeptSums"]

# The bytes of sums a backward may keep on the CPU stand-in of the GPU: all of them.
CPU_ROOM = 1 << 62
# Backwards that keep no sums and measure what a pass takes before any keeps some, besides the first that adds
# held sums on the GPU.
MEASURED_PASSES = 2


def _nbytes(tensors: dict[int, torch.Tensor] | None) -> int:
    return resident_grads.storage_bytes((tensors or {}).values())


class KeptSums:
    """One offloaded model's choice of sums to keep: ``choose`` at each block's reduce, ``let_go`` once the
    worker has offered (or dropped) what was chosen, ``end_of_backward`` at each backward's end. ``owner``: whose
    sums resident_grads holds (the model's HostAccumulation)."""

    def __init__(self, owner: Any) -> None:
        self._owner = owner
        self.pass_peak: int | None = None  # the most allocated on the GPU by the end of a measured backward
        self.measured = 0  # backwards measured
        self._measured_adding = False  # whether one of them added held sums on the GPU
        self._measure_pass = False  # whether the backward under way measures
        self._adding = False  # whether the backward under way added held sums on the GPU
        self._device: torch.device | None = None  # the GPU the sums are made on
        # Bytes chosen to keep that the worker has not offered yet (nor let go): they hold GPU memory already, and
        # the room counts them, or backward would keep a few blocks' more than it has.
        self._chosen = 0
        self._lock = threading.Lock()

    def remeasure(self) -> None:
        """What a pass takes has changed (offload/kept_weights.py keeps blocks' weights from now on): the next
        backward keeps no sums and measures again, and so does the next that adds held sums."""
        self.measured, self._measured_adding = MEASURED_PASSES - 1, False

    def note_adding(self) -> None:
        """The backward under way added held sums on the GPU."""
        self._adding = True

    def measuring(self) -> bool:
        """Whether the backward under way keeps no sums and measures what a pass takes."""
        return self.measured < MEASURED_PASSES or (self._adding and not self._measured_adding)

    def choose(self, views: dict[int, torch.Tensor], homed: list[int],
               reduce_output: torch.Tensor) -> dict[int, torch.Tensor] | None:  # fmt: skip
        """Of a block's summed gradients (``views`` of ``reduce_output`` by ``id(param)``), those to keep: the
        ones whose parameter has a home (``homed``), all of them where the GPU has room for what they hold, none
        otherwise (on the CPU stand-in, up to ``CPU_ROOM``)."""
        if not resident_grads.ENABLED:
            return None
        if self.measuring():
            self._measure_pass = True  # this backward keeps none; its end measures it
            self._device = reduce_output.device if reduce_output.is_cuda else None
            return None
        keep = {i: views[i] for i in homed if i in views}
        with self._lock:
            kept = resident_grads.held_bytes(self._owner) + self._chosen
        if reduce_output.is_cuda:
            room = backward_room(reduce_output.device, cast(int, self.pass_peak), kept)
        else:
            room = max(0, CPU_ROOM - kept)
        nbytes = _nbytes(keep)
        if nbytes > room:
            return None
        with self._lock:
            self._chosen += nbytes
        return keep

    def let_go(self, chosen: dict[int, torch.Tensor] | None) -> None:
        """Sums ``choose`` gave that are offered now (held_bytes counts them) or dropped."""
        nbytes = _nbytes(chosen)
        with self._lock:
            self._chosen -= nbytes

    def end_of_backward(self) -> None:
        adding, self._adding = self._adding, False
        measure, self._measure_pass = self._measure_pass, False
        if measure:
            # What a pass takes keeping nothing (forward's and backward's peak, and all before them): the sums
            # later backwards keep must fit above it, since a block's backward takes it again.
            self.measured += 1
            self._measured_adding |= adding
            if self._device is not None:
                self.pass_peak = torch.cuda.max_memory_allocated(self._device)
