"""Moving gradients to the host and new weights back, with CUDA side streams when the model is on a GPU.

Call order per step: ``begin_step()``; for chunk i: ``launch_grads(chunk, slot)`` a few chunks ahead,
then ``grads(chunk, slot)`` (waits for that chunk's copy only), the update, ``push_params(...)``;
``end_step()`` makes the compute stream wait for both side streams before the next forward.

On a CPU model there is nothing to move: ``grads`` returns fp32 views of ``param.grad`` (a copy only
for low-precision grads) and ``push_params`` copies the master weights into the parameters.

Why gather and cast on the GPU: a bf16 gradient becomes fp32 at HBM speed there, and one D2H copy of
a contiguous fp32 chunk runs at full PCIe speed, where casting on the host would cost CPU memory
bandwidth that the update needs.
"""

from __future__ import annotations

import torch

from io_engine import PinnedBufferPool

from .chunking import Chunk


class Transfer:
    def __init__(self, params: list[torch.Tensor], chunk_numel: int, slots: int, pool: PinnedBufferPool | None):
        self.params = params
        self.cuda = any(p.is_cuda for p in params)
        self.slots = slots
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

    # ----------------------------------------------------------------------------------------- grads
    def launch_grads(self, chunk: Chunk, slot: int) -> None:
        """Start copying ``chunk``'s gradients (as fp32) into host slot ``slot`` (CUDA only)."""
        if not self.cuda:
            return
        dev = self._dev[slot]
        with torch.cuda.stream(self._d2h):
            for pc in chunk.pieces:
                g = self.params[pc.param].grad
                if g is not None:
                    dev[pc.chunk_start : pc.chunk_start + pc.numel].copy_(
                        g.reshape(-1)[pc.param_start : pc.param_start + pc.numel]
                    )
            host = self._host[slot].view(torch.float32)[: chunk.numel]
            host.copy_(dev[: chunk.numel], non_blocking=True)
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

    # ---------------------------------------------------------------------------------------- params
    def push_params(self, chunk: Chunk, master: torch.Tensor, pieces: list[int]) -> torch.cuda.Event | None:
        """Copy the new master weights of ``pieces`` into the parameters, cast to their dtype.

        Returns an event (CUDA) after which ``master`` may be reused, else None.
        """
        if not self.cuda:
            with torch.no_grad():
                for j in pieces:
                    pc = chunk.pieces[j]
                    p = self.params[pc.param]
                    p.view(-1)[pc.param_start : pc.param_start + pc.numel].copy_(
                        master[pc.chunk_start : pc.chunk_start + pc.numel]
                    )
            return None
        up = self._up[self._up_turn]
        self._up_turn ^= 1
        with torch.cuda.stream(self._h2d), torch.no_grad():
            up[: chunk.numel].copy_(master, non_blocking=True)
            for j in pieces:
                pc = chunk.pieces[j]
                p = self.params[pc.param]
                p.view(-1)[pc.param_start : pc.param_start + pc.numel].copy_(
                    up[pc.chunk_start : pc.chunk_start + pc.numel]
                )
            ev = torch.cuda.Event()
            ev.record(self._h2d)
        return ev

    def close(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.params[0].device)
            for b in self._host:
                b.release()
            self._host, self._dev, self._up = [], [], []
