"""``update_on="device"``: each chunk's record goes up, updates where the parameters are, and comes back.

For chunk i, ``update`` queues the pinned record's upload into one of two device records on the upload
stream, and on the work stream (after that upload): the gradients' gather (cast to fp32), the update
(split chunks: join and split around it), the new weights' scatter into the parameters and the record's
download. It returns the event after which the pinned record may be written back. The host only moves
bytes between NVMe and pinned memory.

Two streams, two device records, so that PCIe carries both directions at once: chunk i+1's upload (into
the other record) runs while chunk i updates and comes down. An upload into a record waits for the
download that last read it (``_free``). ``push_params`` (state loads, between steps) uploads through the
gradient row on the work stream. ``weights_row`` lends ``update_aside`` a device row for a split chunk's new
weights, so that they need not cross PCIe twice. On a CPU model the "device" is the host (an extra copy of each chunk):
the same code runs, and is tested, without a GPU.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from . import split_kernels
from .chunking import Chunk
from .transfer import ParamCopies, Work

__all__ = ["DeviceUpdate", "grad_fingerprint"]

_ROW_MARGIN = 20  # weights_row leaves free at least 1/20 of the memory the process may use on the device

_WEIGHTS = split_kernels.WEIGHTS  # position weights of the fingerprint's second sum (cycled)


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
        # High priority: under backward (under_backward.py) the GPU then runs a chunk's small kernels as soon as
        # an SM is free, instead of behind every block of backward's queued GEMMs.
        self._stream = torch.cuda.Stream(device, priority=-1) if self.cuda else None  # gather, update, scatter, down
        self._up = torch.cuda.Stream(device, priority=-1) if self.cuda else None  # uploads
        n = 2 if self.cuda else 1
        self._records = [torch.empty(record_bytes, dtype=torch.uint8, device=device) for _ in range(n)]
        self._free: list[Any] = [None] * len(self._records)  # per record: the event of the download that read it
        self._next = self._last = 0  # the record the next chunk goes up into; the last one that went up
        self._grads = torch.empty(chunk_numel, dtype=torch.float32, device=device)  # a chunk's fp32 grads
        self._bits = torch.empty(chunk_numel, dtype=torch.bfloat16, device=device)  # split: parameters in
        self._weights = torch.empty(chunk_numel, dtype=torch.bfloat16, device=device)  # split: weights out
        self._positions: torch.Tensor | None = None  # grad_fingerprint's weights, made on first use

    def on_stream(self) -> Any:
        """The context the device work runs in: the side stream (CUDA), else nothing."""
        return torch.cuda.stream(self._stream) if self.cuda else contextlib.nullcontext()

    def update(self, work: Work, i: int, state: torch.Tensor, ph: dict[str, float]) -> Any:
        """Chunk i's record up, updated, weights scattered, record down into ``state``: all queued on the
        streams. ``update_s`` is the queueing; waiting for it shows in ``h2d_s``."""
        chunk, js = work[i]
        t0 = time.perf_counter()
        event, _ = self._update(chunk, js, state, state, None)
        ph["update_s"] += time.perf_counter() - t0
        return event

    def update_resident(self, chunk: Chunk, js: list[int], state: torch.Tensor) -> None:
        """Update a chunk whose record the store keeps on the parameters' device (``gpu_budget``) where it lies,
        queued on the work stream like a streamed chunk's (split chunks included), with no copy of the record.
        ``begin_step`` must have ordered the work stream after the gradients."""
        self._update(chunk, js, state, state, None, resident=True)

    def update_aside(self, chunk: Chunk, js: list[int], state: torch.Tensor, out: torch.Tensor,
                     weights: torch.Tensor | None, ready: Any = None) -> tuple[Any, torch.Tensor]:  # fmt: skip
        """Chunk's record up and updated as ``update`` does, but the new record comes down into ``out`` (a pinned
        buffer shaped like ``state``, which is left as it was) and the parameters are not touched: a split
        chunk's new bf16 weights go into ``weights`` (a device row from ``weights_row``, or pinned), the
        others' are ``out``'s master row. ``push_rows`` or ``push_params`` put them into the parameters later.
        ``ready``: a CUDA event the gradients are ready after. Returns the event after which ``out`` and
        ``weights`` hold the result, and the fingerprint of the gradients it used (``grad_fingerprint``),
        taken from the very row the update read."""
        if ready is not None:
            self._stream.wait_event(ready)
        event, printed = self._update(chunk, js, state, out, weights)
        assert printed is not None
        return event, printed

    def _update(self, chunk: Chunk, js: list[int], state: torch.Tensor, out: torch.Tensor,
                weights_out: torch.Tensor | None, resident: bool = False,
                ) -> tuple[Any, torch.Tensor | None]:  # fmt: skip
        group = self.param_groups[chunk.group]
        aside = out is not state
        record = state if resident else self.upload(state)
        with self.on_stream():
            if aside or self.cuda:  # aside: a copy, whose bits the fingerprint then tells exactly
                grads = self.gather_grads(chunk, self._grads, js)
            else:
                grads = self.host_grads(chunk, js)
            printed = self._fingerprint(chunk) if aside else None
            direct = weights_out is not None and weights_out.device == self.device  # weights_row's (CPU: any)
            if chunk.split:
                bits = self.gather_params(chunk, self._bits[: chunk.numel])
                weights = weights_out if direct else self._weights[: chunk.numel]
                self.updater.update_split(chunk, js, record, grads, group, bits, weights)
            else:
                self.updater.update(chunk, js, record, grads, group)
                weights = record[0, : chunk.numel]
            if not aside:
                self.scatter(chunk, weights, js)
            elif weights_out is not None and not direct:
                weights_out.copy_(weights, non_blocking=True)
            if resident:
                return None, printed
            out.copy_(record, non_blocking=True)
            event = self._free[self._last] = self._record_event()
        return event, printed

    def fingerprint_grads(self, chunk: Chunk, js: list[int]) -> torch.Tensor:
        """``grad_fingerprint`` of the chunk's gradients as they are now (queued on the work stream)."""
        with self.on_stream():
            self.gather_grads(chunk, self._grads, js)
            return self._fingerprint(chunk)

    def same_fingerprints(self, early: list[tuple[Chunk, list[int], torch.Tensor]]) -> list[bool]:
        """For each (chunk, pieces, fingerprint from ``update_aside``): whether its gradients now have that
        fingerprint. All on the work stream, where the fingerprints were made; one sync for all."""
        with self.on_stream():
            now = torch.stack([self.fingerprint_grads(chunk, js) for chunk, js, _ in early])
            then = torch.stack([printed for _, _, printed in early])
            return (now == then).all(dim=1).tolist()

    def _fingerprint(self, chunk: Chunk) -> torch.Tensor:
        """``grad_fingerprint`` of the gathered gradient row (the chunk's pieces lie end to end in it)."""
        if split_kernels.available(self._grads):  # the same sums in one kernel
            return split_kernels.fingerprint(self._grads[: chunk.numel])
        if self._positions is None:
            n = self._grads.numel()
            self._positions = torch.arange(n, dtype=torch.int32, device=self.device) % _WEIGHTS + 1
        return grad_fingerprint(self._grads[: chunk.numel], self._positions)

    def upload(self, state: torch.Tensor) -> torch.Tensor:
        """Queue ``state`` (a pinned record) up into the next device record, once the download that last read
        that record is done; the work stream waits for the upload. Returns the device record."""
        k = self._last = self._next
        self._next = (k + 1) % len(self._records)
        record = self._records[k][: state.numel() * state.element_size()].view(state.dtype).view(state.shape)
        if not self.cuda:
            return record.copy_(state)
        with torch.cuda.stream(self._up):
            if self._free[k] is not None:
                self._up.wait_event(self._free[k])
            record.copy_(state, non_blocking=True)
        self._stream.wait_stream(self._up)
        return record

    def push_params(self, chunk: Chunk, master: torch.Tensor, pieces: list[int]) -> Any:
        """Copy a pinned row of ``pieces`` (fp32 masters, or a split chunk's bf16 weights from ``update_aside``)
        into the parameters (cast), through a row of its dtype on the work stream; returns the event after
        which ``master`` may be reused, or None."""
        with self.on_stream():
            up = (self._weights if master.dtype == torch.bfloat16 else self._grads)[: chunk.numel]
            up.copy_(master, non_blocking=True)
            self.scatter(chunk, up, pieces)
            return self._record_event()

    def push_rows(self, rows: list[tuple[Chunk, torch.Tensor, list[int]]]) -> None:
        """``push_params`` for rows already on the device (``weights_row``'s), all at once on the work stream."""
        with self.on_stream():
            self.scatter_rows(rows)

    def weights_row(self, n: int) -> torch.Tensor | None:
        """A bf16 row of ``n`` elements on the device, for ``update_aside``'s new weights to wait in until
        ``push_rows``; None without CUDA, or where taking it would leave less than 1/20 of the memory the
        process may use free. It is allocated on the work stream, which alone then uses it: the caching
        allocator gives a stream only blocks freed on that stream, whereas a block backward just freed on the
        compute stream may still be written by kernels queued there before the free."""
        if not self.cuda:
            return None
        room, total = torch.cuda.mem_get_info(self.device)
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(self.device)
        allowed = int(fraction * total)
        if fraction < 1:  # set_per_process_memory_fraction caps the caching allocator below the device
            room = min(room, allowed - torch.cuda.memory_reserved(self.device))  # (memory_stats: slow)
        if room - 2 * n < allowed // _ROW_MARGIN:
            return None
        with self.on_stream():
            return torch.empty(n, dtype=torch.bfloat16, device=self.device)

    def _record_event(self) -> Any:
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self._stream)
        return ev

    def begin_step(self) -> None:
        if self.cuda:
            self._streams_wait_for_compute(self._stream, self._up)

    def end_step(self) -> None:
        if self.cuda:
            self._compute_waits_for(self._stream, self._up)

    def close(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def grad_fingerprint(row: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Two int64 sums over the bits of an fp32 gradient row: of the bits, and of the bits times ``positions``
    (int32 products, wrapping). Integer sums are exact in any order, so the same gradients give the same
    fingerprint on any stream. Scaling gradients by a factor below 1 (clipping, unscaling) lowers the bits of
    every element it changes, so it always changes the first sum; the second catches values moved around."""
    bits = row.view(torch.int32)
    return torch.stack([bits.sum(), (bits * positions[: bits.numel()]).sum()])
