"""``update_on="device"``: each chunk's record goes up, updates where the parameters are, and comes back.

For chunk i, ``update`` queues on one side stream: the pinned record's upload to a device copy, the
gradients' gather (cast to fp32), the update (split chunks: join and split around it), the new weights'
scatter into the parameters and the record's download; it returns the event after which the pinned
record may be written back. The host only moves bytes between NVMe and pinned memory.

All of a chunk's device work runs in order on one stream, so chunk i+1's upload queues behind chunk i's
download and one device record serves every chunk. ``push_params`` (state loads, between steps) uploads
through the gradient row, on the same stream. On a CPU model the "device" is the host (an extra copy of
each chunk): the same code runs, and is tested, without a GPU.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from .chunking import Chunk
from .transfer import ParamCopies, Work

__all__ = ["DeviceUpdate"]


class DeviceUpdate(ParamCopies):
    on_device = True

    def __init__(self, params: list[torch.Tensor], param_groups: list[dict[str, Any]], updater: Any,
                 chunk_numel: int, record_bytes: int):  # fmt: skip
        """A device record of ``record_bytes`` (the largest chunk's) and rows of ``chunk_numel`` elements."""
        super().__init__(params, param_groups, updater)
        device = params[0].device
        if any(p.device != device for p in params):
            raise ValueError("update_on='device' needs every parameter on one device")
        self.device = device
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._record = torch.empty(record_bytes, dtype=torch.uint8, device=device)
        self._grads = torch.empty(chunk_numel, dtype=torch.float32, device=device)  # a chunk's fp32 grads
        self._bits = torch.empty(chunk_numel, dtype=torch.bfloat16, device=device)  # split: parameters in
        self._weights = torch.empty(chunk_numel, dtype=torch.bfloat16, device=device)  # split: weights out

    def on_stream(self) -> Any:
        """The context the device work runs in: the side stream (CUDA), else nothing."""
        return torch.cuda.stream(self._stream) if self.cuda else contextlib.nullcontext()

    def update(self, work: Work, i: int, state: torch.Tensor, ph: dict[str, float]) -> Any:
        """Chunk i's record up, updated, weights scattered, record down: all queued on the side stream.
        ``update_s`` is the queueing; waiting for it shows in ``h2d_s``."""
        chunk, js = work[i]
        group = self.param_groups[chunk.group]
        t0 = time.perf_counter()
        with self.on_stream():
            record = self._record[: state.numel() * state.element_size()].view(state.dtype).view(state.shape)
            record.copy_(state, non_blocking=True)
            grads = self.gather_grads(chunk, self._grads, js) if self.cuda else self.host_grads(chunk, js)
            if chunk.split:
                bits = self.gather_params(chunk, self._bits[: chunk.numel])
                weights = self._weights[: chunk.numel]
                self.updater.update_split(chunk, js, record, grads, group, bits, weights)
            else:
                self.updater.update(chunk, js, record, grads, group)
                weights = record[0, : chunk.numel]
            self.scatter(chunk, weights, js)
            state.copy_(record, non_blocking=True)
            event = self._record_event()
        ph["update_s"] += time.perf_counter() - t0
        return event

    def push_params(self, chunk: Chunk, master: torch.Tensor, pieces: list[int]) -> Any:
        """Copy host fp32 masters of ``pieces`` into the parameters (cast), through the gradient row on the
        side stream; returns the event after which ``master`` may be reused, or None."""
        with self.on_stream():
            up = self._grads[: chunk.numel]
            up.copy_(master, non_blocking=True)
            self.scatter(chunk, up, pieces)
            return self._record_event()

    def _record_event(self) -> Any:
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self._stream)
        return ev

    def begin_step(self) -> None:
        if self.cuda:
            self._streams_wait_for_compute(self._stream)

    def end_step(self) -> None:
        if self.cuda:
            self._compute_waits_for(self._stream)

    def close(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
