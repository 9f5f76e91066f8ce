"""``update_on="device"``: each chunk's record goes up, updates where the parameters are, and comes back.

For chunk i, ``update`` queues the pinned record's upload into one of the device records on the upload
stream (``upload``); on the work stream (after that upload): the gradients' gather (cast to fp32), the
update (``adamw``; split chunks: join and split around it) and the new weights' scatter into the parameters;
and the record's download on the download stream, after the update (``download``). It returns the event after
which the pinned record may be written back. The host only moves bytes between NVMe and pinned memory. Nothing
needs staging ahead (``stage_ahead`` does nothing): the record goes up within its own ``update``.

Three streams, three device records (``shares.CHUNKS_IN_FLIGHT``), so that PCIe carries both directions at once
and the GPU computes beside them: chunk i+1 updates while chunk i comes down and chunk i+2 goes up (into the third
record). (With the download on the work stream, chunk i+1's update queued behind chunk i's trip down; with two
records, chunk i+2's upload waited for chunk i's update and download: on an H100, 1.29x and 1.09x the link's floor
for 8-bit and fp32 moments, 1.05x and 1.00x with both changes, bench/RESULTS.md, fortieth session.) An upload into
a record waits for the download that last read it (``_free``). ``push_params`` (state loads,
between steps) uploads through the gradient row on the work stream. On a CPU model the "device" is the host (an
extra copy of each chunk): the same code runs, and is tested, without a GPU. Parameters that FSDP2's CPU offload
keeps in host memory update on the GPU they are streamed to: their new weights come down into pinned memory on
the work stream, and their gradients go up from it on the upload stream beside the record (``_stage_grads``),
into one of as many staging rows in their own dtype: queued on the work stream, the gradients' trip up would
wait behind the chunk before's weights coming down, and PCIe's two directions would take turns.

The update under backward (under_backward/aside.py) runs the same update into another pinned buffer, from
copies of the gradients and parameters that it fingerprints, out of the pieces this module exposes:
``upload``, ``on_stream``, ``work_stream``, ``grad_row``, ``rows16``, ``adamw``, ``download``.
"""

from __future__ import annotations

import contextlib
from typing import Any, cast

import torch

from .. import shares
from ..layout.chunking import Chunk
from .groups import Groups
from .step_stats import StepClock
from .strategy import UpdateStrategy
from .transfer import Work

__all__ = ["DeviceUpdate"]


class DeviceUpdate(UpdateStrategy):
    on_device = True

    def __init__(self, params: list[torch.Tensor], groups: Groups, updater: Any,
                 chunk_numel: int, record_bytes: int, device: torch.device | None = None):  # fmt: skip
        """A device record of ``record_bytes`` (the largest chunk's) and rows of ``chunk_numel`` elements, on
        ``device``: the parameters' (default), or the GPU that parameters kept in host memory are streamed to
        (FSDP2's CPU offload: Shards.compute_device)."""
        super().__init__(params, groups, updater)
        if any(p.device != params[0].device for p in params):
            raise ValueError("update_on='device' needs every parameter on one device")
        device = device or params[0].device
        self.device, self.cuda = device, device.type == "cuda"
        # Parameters in host memory updated here: their gradients go up and the new weights come down, queued
        # (transfer.py); the step waits for the copies down before it returns (end_step).
        self.params_elsewhere = params[0].device != device
        # The work stream: gather, update, scatter, download (CUDA; None on CPU). High priority: under backward
        # (under_backward/overlap.py) the GPU then runs a chunk's small kernels as soon as an SM is free,
        # instead of behind every block of backward's queued GEMMs.
        self.work_stream = torch.cuda.Stream(device, priority=-1) if self.cuda else None
        self._up = torch.cuda.Stream(device, priority=-1) if self.cuda else None  # uploads
        self._down = torch.cuda.Stream(device, priority=-1) if self.cuda else None  # records' downloads
        self.in_flight = self.window()  # the pipeline's window: as many chunks open as there are records
        n = self.in_flight if self.cuda else 1
        self._records = [torch.empty(record_bytes, dtype=torch.uint8, device=device) for _ in range(n)]
        # Per record: the event of the download that read it.
        self._free: list[torch.cuda.Event | None] = [None] * len(self._records)
        self._next = self._last = 0  # the record the next chunk goes up into; the last one that went up
        # A chunk's fp32 gradients, gathered on the work stream (and its fp32 masters in push_params).
        self.grad_row = torch.empty(chunk_numel, dtype=torch.float32, device=device)
        # bf16 scratch on the work stream. Its halves: a split chunk's bf16 parameters in (``_bits``), its new
        # bf16 weights out (``_weights``). The update under backward reads the other chunks' parameters as fp32
        # into the whole of it (aside.py): none uses all three.
        self.rows16 = torch.empty(2 * chunk_numel, dtype=torch.bfloat16, device=device)
        self._bits, self._weights = self.rows16[:chunk_numel], self.rows16[chunk_numel:]
        # Parameters in host memory (CUDA): their gradients' staging rows on the device, one a record (bytes: a gradient
        # has its parameter's dtype), each with the event after which the work stream has read it.
        size = chunk_numel * max((p.element_size() for p in params), default=4)
        n = self.in_flight if self.cuda and self.params_elsewhere else 0
        self._grad_rows = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(n)]
        self._grads_read: list[torch.cuda.Event | None] = [None] * n
        self._next_grads = 0

    @staticmethod
    def window() -> int:
        """The chunks the step's pipeline keeps open with this strategy (``shares.CHUNKS_IN_FLIGHT``), which
        the host budget leaves room for beside the read-ahead (budget.plan_budget)."""
        return shares.CHUNKS_IN_FLIGHT

    def on_stream(self) -> Any:
        """The context the device work runs in: the work stream (CUDA), else nothing."""
        return torch.cuda.stream(self.work_stream) if self.cuda else contextlib.nullcontext()

    def stage_ahead(self, work: Work, j: int) -> None:
        """Nothing: a chunk's record goes up within its ``update``, after the previous one's."""

    def update(self, work: Work, i: int, state: torch.Tensor, clock: StepClock) -> Any:
        """Chunk i's record up, updated, weights scattered, record down into ``state``: all queued on the
        streams. ``update_s`` is the queueing; waiting for it shows in ``h2d_s``."""
        chunk, js = work[i]
        with clock.timed("update_s"):
            return self._update(chunk, js, state)

    def update_resident(self, chunk: Chunk, js: list[int], state: torch.Tensor) -> None:
        """Update a chunk whose record the store keeps on the parameters' device (``gpu_budget``) where it lies,
        queued on the work stream like a streamed chunk's (split chunks included), with no copy of the record.
        ``begin_step`` must have ordered the work stream after the gradients."""
        self._update(chunk, js, state, resident=True)

    def _update(self, chunk: Chunk, js: list[int], state: torch.Tensor, resident: bool = False) -> Any:
        k, staged = self._stage_grads(chunk, js) if self._grad_rows else (None, None)
        record = state if resident else self.upload(state)
        with self.on_stream():
            if not self.cuda:
                grads = self.host_grads(chunk, js)
            else:
                grads = self.gather_grads(chunk, self.grad_row, js, sources=staged)
                if k is not None:  # read: the next staging into that row may go
                    self._grads_read[k] = self._record_event()
            self.scatter(chunk, self.adamw(chunk, js, record, grads), js)
            if resident:
                return None
            return self.download(record, state)

    def _stage_grads(self, chunk: Chunk, js: list[int]) -> tuple[int, list[torch.Tensor]]:
        """Queue the host gradients of ``chunk.pieces[j]`` (j in ``js``) up into the next staging row on the
        upload stream, once the work stream has read what that row held; the work stream waits for them.
        A gradient the clip left on the device (``device_grads``) is read there instead, not sent again.
        Returns the row's index and their device copies (each in its gradient's dtype), for ``gather_grads``'
        ``sources``."""
        k = self._next_grads
        self._next_grads = (k + 1) % len(self._grad_rows)
        up, work = cast(torch.cuda.Stream, self._up), cast(torch.cuda.Stream, self.work_stream)  # made on CUDA
        row, out, at = self._grad_rows[k], [], 0
        with torch.cuda.stream(up):
            read = self._grads_read[k]
            if read is not None:
                up.wait_event(read)
            for j in js:
                pc = chunk.pieces[j]
                kept = self.device_grads.get(pc.param)
                if kept is not None:  # the clip's copy, already on the device: nothing to send
                    out.append(self.grad_of(pc, kept))
                    continue
                src = self.grad_of(pc)
                at = -(-at // src.element_size()) * src.element_size()  # a view of a dtype starts at its size
                size = src.numel() * src.element_size()
                out.append(row[at : at + size].view(src.dtype).copy_(src, non_blocking=True))
                self.link.add(src, out[-1])
                at += size
        work.wait_stream(up)
        return k, out

    def adamw(self, chunk: Chunk, js: list[int], record: torch.Tensor, grads: list[torch.Tensor],
              params: torch.Tensor | None = None, weights: torch.Tensor | None = None,
              group: dict[str, Any] | None = None) -> torch.Tensor:  # fmt: skip
        """AdamW on the pieces ``js`` of a device ``record``, with ``grads`` on the device; call it inside
        ``on_stream()``. ``params``: a row to read the parameters from instead of the parameters (a split
        chunk's bf16 bits, the others' values as fp32: the update under backward's fingerprinted copy);
        ``weights``: a device row for a split chunk's new bf16 weights, else the scratch row; ``group``: the
        hyperparameters to read instead of the chunk's group (the update under backward's copy of them). Returns
        the row that holds the new weights: that one (split), or the record's master row."""
        group = self.param_groups[chunk.group] if group is None else group
        if chunk.split:
            bits = params if params is not None else self.gather_params(chunk, self._bits[: chunk.numel])
            out = weights if weights is not None else self._weights[: chunk.numel]
            self.updater.update_split(chunk, js, record, grads, group, bits, out)
            return out
        self.updater.update(chunk, js, record, grads, group, values=params)
        return record[0, : chunk.numel]

    def upload(self, state: torch.Tensor) -> torch.Tensor:
        """Queue ``state`` (a pinned record) up into the next device record, once the download that last read
        that record is done; the work stream waits for the upload. Returns the device record."""
        k = self._last = self._next
        self._next = (k + 1) % len(self._records)
        record = self._records[k][: state.numel() * state.element_size()].view(state.dtype).view(state.shape)
        if not self.cuda:
            return record.copy_(state)
        up, work = cast(torch.cuda.Stream, self._up), cast(torch.cuda.Stream, self.work_stream)  # made on CUDA
        with torch.cuda.stream(up):
            free = self._free[k]
            if free is not None:
                up.wait_event(free)
            record.copy_(state, non_blocking=True)
        self.link.add(state, record)
        work.wait_stream(up)
        return record

    def download(self, record: torch.Tensor, out: torch.Tensor) -> Any:
        """Queue the device ``record`` that ``upload`` returned last down into ``out`` (pinned, shaped like
        it) on the download stream, after what the work stream has queued (the update); the next upload into
        that record waits for this. Returns the event after which ``out`` holds it (None on CPU: it does).
        Work-stream work queued later does not wait for it: whoever reads ``out`` waits for the event."""
        if not self.cuda:
            out.copy_(record)
            self.link.add(record, out)
            return None
        down = cast(torch.cuda.Stream, self._down)  # made on CUDA
        down.wait_stream(cast(torch.cuda.Stream, self.work_stream))
        with torch.cuda.stream(down):
            out.copy_(record, non_blocking=True)
            self.link.add(record, out)
            event = self._free[self._last] = torch.cuda.Event()
            event.record(down)
        return event

    def push_params(self, chunk: Chunk, master: torch.Tensor, pieces: list[int]) -> Any:
        """Copy a pinned row of ``pieces`` (fp32 masters, or a split chunk's bf16 weights from the update under
        backward) into the parameters (cast), through a row of its dtype on the work stream; returns the event
        after which ``master`` may be reused, or None."""
        with self.on_stream():
            up = (self._weights if master.dtype == torch.bfloat16 else self.grad_row)[: chunk.numel]
            up.copy_(master, non_blocking=True)
            self.link.add(master, up)
            self.scatter(chunk, up, pieces)
            event = self._record_event()
        if self.params_elsewhere and event is not None:  # parameters in host memory: set when this returns
            event.synchronize()
            return None
        return event

    def _record_event(self) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.work_stream)
        return ev

    def begin_step(self) -> None:
        if self.cuda:
            self._streams_wait_for_compute(self.work_stream, self._up)

    def end_step(self) -> None:
        if self.cuda:
            self._compute_waits_for(self.work_stream, self._up, self._down)
            if self.params_elsewhere:  # the new weights in host memory, before anyone reads or streams them
                cast(torch.cuda.Stream, self.work_stream).synchronize()

    def close(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
