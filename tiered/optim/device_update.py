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
weights, so that they need not cross PCIe twice. ``update_aside`` reads the gradients and the parameters
from copies in rows and fingerprints both (``grad_fingerprint``); ``same_fingerprints`` tells, at
``step()``, whether they are still those. On a CPU model the "device" is the host (an extra copy of each chunk):
the same code runs, and is tested, without a GPU.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, cast

import torch

from ..layout import split_kernels
from ..layout.chunking import Chunk, Piece
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
        # High priority: under backward (under_backward/overlap.py) the GPU then runs a chunk's small kernels as
        # soon as an SM is free, instead of behind every block of backward's queued GEMMs.
        self._stream = torch.cuda.Stream(device, priority=-1) if self.cuda else None  # gather, update, scatter, down
        self._up = torch.cuda.Stream(device, priority=-1) if self.cuda else None  # uploads
        n = 2 if self.cuda else 1
        self._records = [torch.empty(record_bytes, dtype=torch.uint8, device=device) for _ in range(n)]
        # Per record: the event of the download that read it.
        self._free: list[torch.cuda.Event | None] = [None] * len(self._records)
        self._next = self._last = 0  # the record the next chunk goes up into; the last one that went up
        self._grads = torch.empty(chunk_numel, dtype=torch.float32, device=device)  # a chunk's fp32 grads
        # Split chunks: their bf16 parameters in, their bf16 weights out. The other chunks' updates under backward
        # read their parameters as fp32 from the same memory (``_values``, ``param_row``): none uses all three.
        rows16 = torch.empty(2 * chunk_numel, dtype=torch.bfloat16, device=device)
        self._bits, self._weights = rows16[:chunk_numel], rows16[chunk_numel:]
        self._values = rows16.view(torch.float32)
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
        ``weights`` hold the result, and the fingerprints (``grad_fingerprint``, int64 [4]) of the gradients
        and of the parameters it used, each taken from the very row the update read (``fingerprints``)."""
        if ready is not None:  # an event: on CUDA, where the work stream is made
            cast(torch.cuda.Stream, self._stream).wait_event(ready)
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
            # Aside, the update reads the parameters from a copy too, fingerprinted: whatever it read of a write
            # (through .data, which no version counter sees), even one racing it, step() compares those bits.
            values = self.param_row(chunk) if aside else None
            printed = self._fingerprints(chunk, values) if values is not None else None  # made aside
            direct = weights_out is not None and weights_out.device == self.device  # weights_row's (CPU: any)
            if chunk.split:
                bits = values if values is not None else self.gather_params(chunk, self._bits[: chunk.numel])
                weights = cast(torch.Tensor, weights_out) if direct else self._weights[: chunk.numel]  # direct: given
                self.updater.update_split(chunk, js, record, grads, group, bits, weights)
            else:
                self.updater.update(chunk, js, record, grads, group, values=values)
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

    def param_row(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's parameters in row layout, on the work stream: a split chunk's bf16 bits (``_bits``), the
        others' values as fp32 (``_values``: exact, and one to one, whatever their dtypes)."""
        row = (self._bits if chunk.split else self._values)[: chunk.numel]
        _copy_pieces(row, [(pc, self.params[pc.param].detach()) for pc in chunk.pieces])
        return row

    def fingerprints(self, chunk: Chunk, js: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """``update_aside``'s fingerprints of the chunk's gradients (pieces ``js``) and parameters as they are now,
        into ``out`` (int64 [4], zeros) if given. On the work stream: call it inside ``on_stream()``."""
        pieces = [chunk.pieces[j] for j in js]
        grads = [(pc, cast(torch.Tensor, self.params[pc.param].grad)) for pc in pieces]  # pieces with gradients
        _copy_pieces(self._grads, grads)  # as gather_grads
        return self._fingerprints(chunk, self.param_row(chunk), out)

    def same_fingerprints(self, early: list[tuple[Chunk, list[int], torch.Tensor]]) -> list[tuple[bool, bool]]:
        """For each (chunk, pieces, fingerprints from ``update_aside``): whether its gradients, and its parameters,
        have those fingerprints now. All on the work stream, where the fingerprints were made, into one tensor;
        one sync for all."""
        with self.on_stream():
            now = torch.zeros(len(early), 4, dtype=torch.int64, device=self.device)
            for i, (chunk, js, _) in enumerate(early):
                self.fingerprints(chunk, js, now[i])
            then = torch.stack([printed for _, _, printed in early])
            same = (now == then).view(len(early), 2, 2).all(dim=2).tolist()
        return [(grads, params) for grads, params in same]

    def _fingerprints(self, chunk: Chunk, params: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """int64 [4]: ``grad_fingerprint`` of the gathered gradient row, then of ``params`` (``param_row``'s),
        into ``out`` (zeros) if given. The chunk's pieces lie end to end in both."""
        grads = self._grads[: chunk.numel]
        if split_kernels.available(grads):  # the same sums, both rows in one kernel
            return split_kernels.fingerprint(grads, params, out)
        if self._positions is None:
            n = self._grads.numel()
            self._positions = torch.arange(n, dtype=torch.int32, device=self.device) % _WEIGHTS + 1
        printed = torch.cat([grad_fingerprint(grads, self._positions), grad_fingerprint(params, self._positions)])
        return printed if out is None else out.copy_(printed)

    def upload(self, state: torch.Tensor) -> torch.Tensor:
        """Queue ``state`` (a pinned record) up into the next device record, once the download that last read
        that record is done; the work stream waits for the upload. Returns the device record."""
        k = self._last = self._next
        self._next = (k + 1) % len(self._records)
        record = self._records[k][: state.numel() * state.element_size()].view(state.dtype).view(state.shape)
        if not self.cuda:
            return record.copy_(state)
        up, work = cast(torch.cuda.Stream, self._up), cast(torch.cuda.Stream, self._stream)  # made on CUDA
        with torch.cuda.stream(up):
            free = self._free[k]
            if free is not None:
                up.wait_event(free)
            record.copy_(state, non_blocking=True)
        work.wait_stream(up)
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

    def _record_event(self) -> torch.cuda.Event | None:
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


def _copy_pieces(row: torch.Tensor, pieces: list[tuple[Piece, torch.Tensor]]) -> None:
    """Each (piece, tensor): the piece's elements of ``tensor`` into its place in ``row``, cast to the row's dtype
    (exact: a wider float, or the same). One multi-tensor copy: a chunk of many small pieces (norms, biases)
    launches a kernel or two, not one a piece (``gather_params`` and ``gather_grads`` copy the same bits)."""
    torch._foreach_copy_(
        [row[pc.chunk_start : pc.chunk_start + pc.numel] for pc, _ in pieces],
        [t.reshape(-1)[pc.param_start : pc.param_start + pc.numel] for pc, t in pieces],
    )


def grad_fingerprint(row: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Two int64 sums over the bits of an fp32 gradient row (or of a bf16 or fp16 row, their 16 bits as signed
    integers): of the bits, and of the bits times ``positions`` (int32 products, wrapping). Integer sums are
    exact in any order, so the same gradients give the same fingerprint on any stream. Scaling gradients by a
    factor below 1 (clipping, unscaling) lowers the bits of every element it changes, so it always changes the
    first sum; so does any change of a single element; the second catches values moved around."""
    bits = row.view(torch.int32 if row.element_size() == 4 else torch.int16)
    return torch.stack([bits.sum(), (bits * positions[: bits.numel()]).sum()])
