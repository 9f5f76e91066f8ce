"""The window: which layers' slots have device buffers, and the loads and write-backs that move them.

Each forward pass, ``plan`` decides how many leading layers stay ``resident`` under ``gpu_budget``: all of them
when they fit, else as many as fit beside two more layers of room, through which the others stream. For a
streaming layer, ``prefetch`` starts its load on the mover while the layer before computes (the first layer's
during the last one's), ``install`` hands the loaded buffers over (or loads now, which ``loads["waited"]``
counts), and after its update ``write_back`` queues its new tokens to the pages and drops the buffers. The mover
runs these in order (mover.py), so a load always follows the write-back of the same layer.

A write-back that fails raises its error from the next forward (or ``settle``); the tokens it carried are lost
with it, so the sequence must be recomputed.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future
from typing import Any

import torch

from ..store import TieredStore
from .layout import KVLayout
from .mover import Mover
from .pages import PageIO, Slot, new_buffer

__all__ = ["Window"]


class Window:
    def __init__(self, store: TieredStore, layout: KVLayout, gpu_budget: int | None,
                 slots: dict[int, list[Slot]]) -> None:  # fmt: skip
        self.store, self.layout, self.gpu_budget, self.slots = store, layout, gpu_budget, slots
        self.batch: list[int] = []  # the current forward's rows
        self.resident = layout.layers
        self.peak = 0
        self.loads_count = {"prefetched": 0, "waited": 0}
        self._pio: PageIO | None = None
        self._mover: Mover | None = None
        self._loads: dict[int, Future[dict[int, tuple[int, torch.Tensor]]]] = {}
        self._writes: list[Future[None]] = []

    @property
    def pio(self) -> PageIO:
        if self._pio is None:
            raise RuntimeError("this TieredCache has not seen a forward pass yet: nothing is stored")
        return self._pio

    @property
    def mover(self) -> Mover:
        if self._mover is None:
            raise RuntimeError("this TieredCache has not seen a forward pass yet: nothing is stored")
        return self._mover

    @property
    def started(self) -> bool:
        return self._pio is not None

    def start(self, k: torch.Tensor) -> None:
        """The first forward fixes the dtype and device; later ones must match."""
        if self._pio is None:
            self._pio = PageIO(self.store, self.layout, k.dtype, k.device)
            self._mover = Mover(k.device)
        elif k.dtype != self._pio.dtype or k.device != self._pio.device:
            raise ValueError(f"key states of {k.dtype} on {k.device}, but this cache holds {self._pio.dtype} on "
                             f"{self._pio.device}: use one cache per model placement")  # fmt: skip

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn`` on the mover, after everything queued there; waits for it."""
        return self.mover.submit(lambda: fn(*args, **kwargs)).result()

    def plan(self, held: list[int], q: int) -> None:
        """How many leading layers stay in the window this pass; ``held``: the sequences not swapped out."""
        lay = self.layout
        es = self._pio.dtype.itemsize if self._pio else 2
        # an upper bound of each slot's buffers this pass: what a load makes (length + a page) or growth makes
        tokens = sum(lay.room(self.slots[s][0].length + (q if s in self.batch else 0)) for s in held)
        per_layer = max(1, tokens * lay.token_bytes(es))
        old = self.resident
        if self.gpu_budget is None or per_layer * lay.layers <= self.gpu_budget:
            self.resident = lay.layers
        else:
            self.resident = max(0, self.gpu_budget // per_layer - 2)
        if self.resident < old:  # layers leaving the window: write the sequences this pass will not touch
            others = [s for s in held if s not in self.batch]
            for layer in range(self.resident, old):
                self.write_back(layer, others)

    def install(self, layer: int) -> None:
        """Make every row's slot in ``layer`` have a buffer: a finished prefetch, else a load now."""
        fut = self._loads.pop(layer, None)
        got = fut.result() if fut is not None else {}
        missing = []
        for seq in self.batch:
            slot = self.slots[seq][layer]
            if slot.buf is not None:
                continue
            loaded = got.get(seq)
            if loaded is not None and loaded[0] == slot.length:
                slot.buf = loaded[1]
                self.mover.handed_over(slot.buf)
                self.loads_count["prefetched"] += 1
            elif slot.length:
                missing.append(seq)
        if missing:
            self.loads_count["waited"] += len(missing)
            got = self.mover.submit(self._load, layer, missing).result()
            for seq in missing:
                slot = self.slots[seq][layer]
                slot.buf = got[seq][1]
                self.mover.handed_over(slot.buf)

    def prefetch(self, layer: int) -> None:
        if layer in self._loads:
            return
        seqs = [s for s in self.batch if self.slots[s][layer].buf is None and self.slots[s][layer].length]
        if seqs:
            self._loads[layer] = self.mover.submit(self._load, layer, seqs)

    def _load(self, layer: int, seqs: list[int]) -> dict[int, tuple[int, torch.Tensor]]:
        """On the mover: each sequence's pages of ``layer`` into a new buffer, with a page of room to grow."""
        out = {}
        for seq in seqs:
            n = self.slots[seq][layer].length
            buf, _ = self.pio.read(seq, layer, n, self.layout.pages(n) + 1)
            if buf is not None:
                out[seq] = (n, buf)
        return out

    def write_back(self, layer: int, seqs: list[int] | None = None) -> None:
        """Queue the new tokens of ``layer``'s slots (the batch's by default) to their pages, then drop the
        buffers: the mover holds them until the copies are done."""
        jobs = []
        for seq in self.batch if seqs is None else seqs:
            slot = self.slots[seq][layer]
            if slot.buf is None:
                continue
            if slot.synced < slot.length:
                jobs.append((seq, slot.buf, slot.synced, slot.length))
                slot.synced = slot.length
            slot.buf = None
        if jobs:
            self._writes.append(self.mover.submit(self._write_all, layer, jobs, after=self.mover.event()))

    def _write_all(self, layer: int, jobs: list[tuple[int, torch.Tensor, int, int]]) -> None:
        for seq, buf, lo, hi in jobs:
            self.pio.write(seq, layer, buf, lo, hi)

    def grow(self, slot: Slot, need: int, like: torch.Tensor) -> None:
        """A bigger buffer for ``slot`` (room for ``need`` tokens and more), its pages copied over."""
        lay = self.layout
        buf = new_buffer(lay, lay.pages(lay.room(need)), like.dtype, like.device)
        if slot.buf is not None and slot.length:
            used = lay.pages(slot.length)
            buf[:used].copy_(slot.buf[:used])
        slot.buf = buf

    def bytes_held(self) -> int:
        return sum(s.buf.numel() * s.buf.element_size() for slots in self.slots.values() for s in slots
                   if s.buf is not None)  # fmt: skip

    def settle(self) -> None:
        """Every write landed (its error raised here) and every prefetch forgotten, before the sequences change."""
        loads, self._loads = list(self._loads.values()), {}
        for fut in loads:
            with contextlib.suppress(BaseException):  # a prefetch nobody will use: its error is not the caller's
                fut.result()
        self.check(wait=True)

    def check(self, wait: bool = False) -> None:
        pending = []
        for fut in self._writes:
            if wait or fut.done():
                fut.result()  # a failed write-back raises here: its tokens would be lost otherwise
            else:
                pending.append(fut)
        self._writes = pending

    def close(self) -> None:
        if self._mover is not None:
            self._mover.close()
