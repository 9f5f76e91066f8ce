"""Moving gradients to the host and new weights back, with CUDA side streams when the model is on a GPU.

Call order per step: ``begin_step()``; for chunk i: ``launch_grads(chunk, slot)`` a few chunks ahead,
then ``grads(chunk, slot)`` (waits for that chunk's copy only), the update, ``push_params(...)``;
``end_step()`` makes the compute stream wait for both side streams before the next forward.

On a CPU model there is nothing to move: ``grads`` returns fp32 views of ``param.grad`` (a copy only
for low-precision grads) and ``push_params`` copies the master weights into the parameters.

Chunks that split their masters (master_split.py) also need their parameters' bf16 bits on the host,
and send back bf16 weights rather than fp32 masters: ``launch_grads`` copies both, ``param_bits`` hands
them out, and ``push_bf16`` sends the new weights from one of two pinned ``up_buffer``s.

With ``update_on="device"`` the update runs where the parameters are instead: ``upload`` copies a
chunk's pinned state record to a device copy on one side stream, the update and the parameter
writes run on that stream, and ``download`` copies the record back and returns the event after
which the host buffer may be written to NVMe. Gradients never leave the device, nor weights the host.
All of a chunk's device work runs in order on one stream, so one device record serves every chunk.

Why gather and cast on the GPU: a bf16 gradient becomes fp32 at HBM speed there, and one D2H copy of
a contiguous fp32 chunk runs at full PCIe speed, where casting on the host would cost CPU memory
bandwidth that the update needs.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from io_engine import PinnedBufferPool

from .chunking import Chunk


def staging_sizes(chunk_numel: int, slots: int, split: bool, on_device: bool = False) -> list[int]:
    """Pinned buffers a CUDA Transfer takes from its pool: fp32 grads per slot, and with split masters
    bf16 parameter bits per slot plus two bf16 upload buffers. None when the update runs on the device."""
    if on_device:
        return []
    return [chunk_numel * 4] * slots + ([chunk_numel * 2] * (slots + 2) if split else [])


class Transfer:
    def __init__(
        self,
        params: list[torch.Tensor],
        chunk_numel: int,
        slots: int,
        pool: PinnedBufferPool | None,
        *,
        split: bool = False,
        record_bytes: int = 0,
    ):
        """``record_bytes`` > 0: the update runs on the parameters' device (``upload``/``download``), with
        a device record of that many bytes."""
        self.params = params
        self.cuda = any(p.is_cuda for p in params)
        self.slots = slots
        self.split = split
        self.on_device = record_bytes > 0
        self._host16: list = []
        self._up_host: list = []
        self._host: list = []
        if self.on_device:
            self._init_on_device(chunk_numel, record_bytes)
            return
        if split and not self.cuda:  # CPU parameters: gather and hand out in ordinary memory
            self._bits = torch.empty(chunk_numel, dtype=torch.bfloat16)
            self._up_cpu = torch.empty(chunk_numel, dtype=torch.bfloat16)
        if self.cuda:
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

    def _init_on_device(self, chunk_numel: int, record_bytes: int) -> None:
        device = self.params[0].device
        if any(p.device != device for p in self.params):
            raise ValueError("update_on='device' needs every parameter on one device")
        self.device = device
        # One stream for both directions and the update: chunk i+1's upload queues behind chunk i's
        # download, so one device record is never overwritten while it is still being read.
        self._h2d = self._d2h = torch.cuda.Stream(device) if self.cuda else None
        self._record = torch.empty(record_bytes, dtype=torch.uint8, device=device)
        self._dev = [torch.empty(chunk_numel, dtype=torch.float32, device=device)]  # a chunk's fp32 grads
        self._bits = torch.empty(chunk_numel, dtype=torch.bfloat16, device=device)  # split: parameters in
        self._up_dev = torch.empty(chunk_numel, dtype=torch.bfloat16, device=device)  # split: weights out
        # push_params (state loads, between steps) uploads through the grad row: one stream orders them.
        self._up = [self._dev[0], self._dev[0]]
        self._up_turn = 0
        self._up_events = [None, None]

    # ------------------------------------------------------------------------------------ step edges
    def begin_step(self) -> None:
        if self.cuda:
            cur = torch.cuda.current_stream(self.params[0].device)
            self._d2h.wait_stream(cur)
            self._h2d.wait_stream(cur)

    def end_step(self) -> None:
        if self.cuda:
            cur = torch.cuda.current_stream(self.params[0].device)
            cur.wait_stream(self._d2h)
            cur.wait_stream(self._h2d)

    # ------------------------------------------------------------------- the update on the device
    def on_stream(self) -> Any:
        """The context the device update runs in: the side stream (CUDA), else nothing."""
        return torch.cuda.stream(self._h2d) if self.cuda else contextlib.nullcontext()

    def upload(self, state: torch.Tensor) -> torch.Tensor:
        """The device copy of a pinned state record, shaped like it (call inside ``on_stream``)."""
        record = self._record[: state.numel() * state.element_size()].view(state.dtype).view(state.shape)
        return record.copy_(state, non_blocking=True)

    def device_grads(self, chunk: Chunk, pieces: list[int]) -> list[torch.Tensor]:
        """fp32 gradients of ``chunk.pieces[j]`` for j in ``pieces``, on the device (inside ``on_stream``)."""
        if not self.cuda:
            return self.grads(chunk, 0, pieces)
        return self._gather_grads(chunk, self._dev[0], pieces)

    def _gather_grads(self, chunk: Chunk, row: torch.Tensor, pieces: list[int]) -> list[torch.Tensor]:
        """Copy the gradients of ``chunk.pieces[j]`` for j in ``pieces`` into ``row`` (chunk layout, on the
        device, cast to its dtype); returns their views of ``row``."""
        out = []
        for j in pieces:
            pc = chunk.pieces[j]
            dst = row[pc.chunk_start : pc.chunk_start + pc.numel]
            dst.copy_(self.params[pc.param].grad.reshape(-1)[pc.param_start : pc.param_start + pc.numel])
            out.append(dst)
        return out

    def device_bits(self, chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        """A split chunk's bf16 parameters gathered on the device, and a device row for its new weights."""
        return self.gather_params(chunk, self._bits[: chunk.numel]), self._up_dev[: chunk.numel]

    def download(self, record: torch.Tensor, state: torch.Tensor) -> Any:
        """Copy the updated device record back into its pinned host record (inside ``on_stream``);
        returns the event after which the host record may be written, or None (done)."""
        state.copy_(record, non_blocking=True)
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self._h2d)
        return ev

    # ----------------------------------------------------------------------------------------- grads
    def launch_grads(self, chunk: Chunk, slot: int) -> None:
        """Start copying ``chunk``'s gradients (as fp32) into host slot ``slot`` (CUDA only)."""
        if not self.cuda:
            return
        dev = self._dev[slot]
        with torch.cuda.stream(self._d2h):
            with_grad = [j for j, pc in enumerate(chunk.pieces) if self.params[pc.param].grad is not None]
            self._gather_grads(chunk, dev, with_grad)
            host = self._host[slot].view(torch.float32)[: chunk.numel]
            host.copy_(dev[: chunk.numel], non_blocking=True)
            if chunk.split:
                bits = self.gather_params(chunk, self._dev16[slot][: chunk.numel])
                self._host16[slot].view(torch.bfloat16)[: chunk.numel].copy_(bits, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._d2h)
        self._events[slot] = ev

    def grads(self, chunk: Chunk, slot: int, pieces: list[int]) -> list[torch.Tensor]:
        """fp32 host gradients of ``chunk.pieces[j]`` for j in ``pieces``; waits for their copy."""
        out = []
        if self.cuda:
            ev = self._events[slot]
            if ev is not None:
                ev.synchronize()
            host = self._host[slot].view(torch.float32)
            for j in pieces:
                pc = chunk.pieces[j]
                out.append(host[pc.chunk_start : pc.chunk_start + pc.numel])
            return out
        for j in pieces:
            pc = chunk.pieces[j]
            g = self.params[pc.param].grad.reshape(-1)[pc.param_start : pc.param_start + pc.numel]
            out.append(g if g.dtype == torch.float32 else g.float())
        return out

    def param_bits(self, chunk: Chunk, slot: int) -> torch.Tensor:
        """The bf16 parameters of a split chunk, laid out as its state row, on the host. On CUDA the
        copy ``launch_grads`` started (call ``grads`` first: it waits for it); on CPU a gather."""
        if self.cuda:
            return self._host16[slot].view(torch.bfloat16)[: chunk.numel]
        return self.gather_params(chunk, self._bits[: chunk.numel])

    def gather_params(self, chunk: Chunk, out: torch.Tensor) -> torch.Tensor:
        """Copy ``chunk``'s parameter values into ``out`` (its row layout, any device); returns ``out``."""
        for pc in chunk.pieces:
            out[pc.chunk_start : pc.chunk_start + pc.numel].copy_(
                self.params[pc.param].detach().reshape(-1)[pc.param_start : pc.param_start + pc.numel]
            )
        return out

    # ---------------------------------------------------------------------------------------- params
    def up_buffer(self, chunk: Chunk) -> torch.Tensor:
        """A host bf16 buffer for a split chunk's new weights, then sent by ``push_bf16``. On CUDA one of
        two pinned buffers, taken once the upload that last read it has finished."""
        if not self.cuda:
            return self._up_cpu[: chunk.numel]
        ev = self._up_events[self._up_turn]
        if ev is not None:
            ev.synchronize()
        return self._up_host[self._up_turn].view(torch.bfloat16)[: chunk.numel]

    def push_bf16(self, chunk: Chunk, weights: torch.Tensor, pieces: list[int]) -> torch.cuda.Event | None:
        """Copy a split chunk's new bf16 weights (from ``up_buffer``) into the parameters of ``pieces``."""
        return self._push(chunk, weights, pieces, self._up16 if self.cuda else [])

    def push_params(self, chunk: Chunk, master: torch.Tensor, pieces: list[int]) -> torch.cuda.Event | None:
        """Copy the new master weights of ``pieces`` into the parameters, cast to their dtype.

        Returns an event (CUDA) after which ``master`` may be reused, else None.
        """
        return self._push(chunk, master, pieces, self._up if self.cuda else [])

    def _push(self, chunk: Chunk, row: torch.Tensor, pieces: list[int], device_rows: list[torch.Tensor]) -> Any:
        """Host ``row`` -> ``pieces`` of the parameters (cast to their dtype). On CUDA through one of two
        device rows of the row's dtype, on the upload stream; returns the upload's event."""
        if not self.cuda:
            with torch.no_grad():
                self.scatter(chunk, row, pieces)
            return None
        turn = self._up_turn
        self._up_turn ^= 1
        up = device_rows[turn][: chunk.numel]
        with torch.cuda.stream(self._h2d), torch.no_grad():
            up.copy_(row, non_blocking=True)
            self.scatter(chunk, up, pieces)
            ev = torch.cuda.Event()
            ev.record(self._h2d)
        self._up_events[turn] = ev
        return ev

    def scatter(self, chunk: Chunk, row: torch.Tensor, pieces: list[int]) -> None:
        """``row`` (chunk layout, on the parameters' device) -> the parameters of ``pieces``, cast."""
        for j in pieces:
            pc = chunk.pieces[j]
            self.params[pc.param].view(-1)[pc.param_start : pc.param_start + pc.numel].copy_(
                row[pc.chunk_start : pc.chunk_start + pc.numel]
            )

    def close(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.params[0].device)
            for b in (*self._host, *self._host16, *self._up_host):
                b.release()
            self._host, self._dev, self._up, self._host16, self._up_host = [], [], [], [], []
