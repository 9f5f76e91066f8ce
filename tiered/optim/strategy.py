"""``UpdateStrategy``: what one step's pipeline (pipeline.py) asks of the place chunks update.

The pipeline owns the schedule: which chunk is pinned, updated, staged and retired when, and how far ahead
anything runs. A strategy owns the buffers and CUDA streams of one place an update can run, and does for one
chunk what it is told: ``HostUpdate`` (host_update.py, ``update_on="host"``) or ``DeviceUpdate``
(device_update.py, ``update_on="device"``). The order of the calls is the contract, so it is stated once,
in the class docstring, and tested with a strategy that records them (tests/unit/optim/test_strategy.py).
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from ..layout.chunking import Chunk
from .step_stats import StepClock
from .transfer import ParamCopies, Work

__all__ = ["UpdateStrategy"]


class UpdateStrategy(ParamCopies, abc.ABC):
    """Where chunks update, over the parameters' copies (``ParamCopies``). A step calls, in order:

    1. ``update_resident(chunk, js, state)`` for each chunk the store keeps in HBM (``gpu_budget``), after a
       ``begin_step()``: the update where the record lies, nothing copied. Only where there are such chunks.
    2. ``begin_step()``: the side streams wait for the compute stream (so no copy reads a gradient that
       backward's last kernels are still writing).
    3. ``stage_ahead(work, j)`` for each of the first ``slots`` chunks that stream through host memory: start
       what their updates will need before they are pinned (the host strategy: their gradients' copies down).
    4. For each streamed chunk i, once its record is pinned in host memory as ``state``:

       1. ``update(work, i, state, clock) -> event``: update chunk ``work[i]`` in ``state``, its phases'
          seconds added to ``clock``; after ``event`` (a CUDA event; None: done already) ``state`` may be
          written back and unpinned;
       2. ``stage_ahead(work, i + slots)``, where that chunk exists: chunk i no longer needs what its stage
          holds, so the chunk ``slots`` ahead may take it.

    5. ``end_step()``: the compute stream waits for the side streams, before the next forward. Also on failure.

    Outside the stream of chunks: ``push_params(chunk, master, pieces) -> event`` sets parameters from a pinned
    row (state loads between steps; at ``step()``, the weights of updates kept from under backward). Once, at
    the end: ``close()``.
    """

    on_device = False  # the update runs where the parameters are (the record crosses PCIe, not the weights)
    slots = 1  # chunks that ``stage_ahead`` may hold staged at once
    in_flight = 2  # chunks the pipeline keeps open at once (pinned, their copies queued) when it overlaps them

    @abc.abstractmethod
    def stage_ahead(self, work: Work, j: int) -> None:
        """Start what chunk ``work[j]``'s update will need (a strategy that needs nothing does nothing)."""

    @abc.abstractmethod
    def update(self, work: Work, i: int, state: torch.Tensor, clock: StepClock) -> Any:
        """Update chunk ``work[i]`` in its pinned record ``state``; returns the event after which ``state`` may
        be written back (None: already)."""

    @abc.abstractmethod
    def update_resident(self, chunk: Chunk, js: list[int], state: torch.Tensor) -> None:
        """Update a chunk whose record the store keeps on the parameters' device, where it lies."""

    @abc.abstractmethod
    def push_params(self, chunk: Chunk, master: torch.Tensor, pieces: list[int]) -> Any:
        """Copy a pinned row of ``pieces`` into the parameters, cast; returns the event after which ``master``
        may be reused (None: already)."""

    @abc.abstractmethod
    def begin_step(self) -> None:
        """Order the side streams after the compute stream."""

    @abc.abstractmethod
    def end_step(self) -> None:
        """Order the compute stream after the side streams."""

    @abc.abstractmethod
    def close(self) -> None:
        """Wait for the device and give back what is held."""

    def _streams_wait_for_compute(self, *streams: Any) -> None:
        cur = torch.cuda.current_stream(self.device)
        for s in streams:
            s.wait_stream(cur)

    def _compute_waits_for(self, *streams: Any) -> None:
        cur = torch.cuda.current_stream(self.device)
        for s in streams:
            cur.wait_stream(s)
