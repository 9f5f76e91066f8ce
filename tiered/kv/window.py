"""The window: the device memory of a TieredCache, and the loads and writes that move pages through it.

What it holds (``gpu_budget`` caps the sum, but never below the first two, and the writes' floor below may pass
it): the tails of the sequences not swapped out; a ring of ``prefetch + 1`` preallocated blocks through which the
streaming layers' pages pass (reused from layer to layer and token to token; regrown only when a context outgrows
them); the device pages whose writes are in flight; and, in the first ``resident`` layers, a block per sequence that
keeps its pages from pass to pass. ``begin_pass`` decides ``resident`` from the lengths: all layers when they fit,
else as many as fit beside the rest, and a layer leaving the window just drops its block (every full page is in the
store already). It gives the ring back when no layer streams, and a block larger than the pass needs (sized for a
long sequence since freed) where keeping it would take the window over the budget. The writes in flight get what the
rest leaves (at most 512 MiB), but never less than their floor: the pages two layers' updates fill in the pass (or in
the pass before, where it filled more). Past it the oldest is waited for, and a write that finished drops its device
copy as the next pages are submitted, not only at the next pass. So where the budget leaves the writes nothing
(every layer streams, as under ``gpu_budget=0``) a layer's writes still run during the next layer's compute: a
layer's update waits only for the writes of the layers two or more before it, and a pass that fills fewer pages than
the one before (decode after a prefill) does not wait at its start for that one's last writes. The sum stays within
the budget after each layer's update, but never below the tails and the ring, and past either by at most the writes'
floor; within one, the pages it fills are on the device before they are submitted, as in the serial twin.

A forward pass, layer by layer: ``install`` makes sure the layer's full pages are in a block (a load issued ahead
and still valid, else a load now: ``loads["waited"]``), ``issue_ahead`` issues the loads of the next ``prefetch``
layers (round into the next pass, whose pages are known once this pass's layer has appended), the cache appends
and gathers, ``filled`` writes the pages that filled, and ``consumed`` records that the ring slot may be reused.
On CUDA with ``prefetch`` > 0 no step waits on the host: a load's copies run on the side stream after the event that
freed its ring slot, and the compute stream waits for the event recorded after them; only pages the store must read
(NVMe) go through the mover thread, whose future the layer then waits for. The caller's thread waits for a page
write only past the writes' room above. A Ctrl-C during a wait for a load (a disk that stalls) is raised from it,
a load nobody uses included (dropped as the batch changes, or by ``settle``); the load stays pending, its copies
under way, until the next ``settle`` or pass waits for it. ``prefetch=0`` is the serial twin: every copy and write
in the caller's thread and stream, when needed.

The writes are ``PageWrites``' (writes.py): a write that fails raises its error once, at the start of the next
forward (or ``settle``), before anything of it is appended, so the forward can simply be run again; its pages, and
those of the writes that failed with it (a full disk), keep their device copies, which loads read, and are written
again when it is.
"""

from __future__ import annotations

from typing import Any

import torch

from io_engine import pool_bytes

from ..store import TieredStore
from .layout import KVLayout
from .loads import Load, ReadAhead, copy_all, copy_keyed
from .mover import Mover
from .pages import Page, Slot
from .writes import PageWrites

__all__ = ["Window"]

_GROUP = 16  # store pages pinned at once by a load, at most


class Window:
    def __init__(self, store: TieredStore, layout: KVLayout, gpu_budget: int | None, slots: dict[int, list[Slot]],
                 prefetch: int) -> None:  # fmt: skip
        self.store, self.layout, self.gpu_budget, self.slots = store, layout, gpu_budget, slots
        self.prefetch = min(prefetch, layout.layers - 1)
        self.batch: list[int] = []  # the current forward's rows
        self.resident = layout.layers
        self.peak = 0
        self.loads = {"prefetched": 0, "waited": 0}  # slot loads: (sequence, layer) pairs
        self.moved = {"loaded_bytes": 0, "written_bytes": 0, "page_copies": 0, "host_syncs": 0}
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None
        self.mover: Mover | None = None
        self._ring: list[torch.Tensor | None] = [None] * (self.prefetch + 1)
        self._free: list[torch.cuda.Event | None] = [None] * (self.prefetch + 1)
        self._next = 0
        self._pending: dict[int, Load] = {}
        self._using: int | None = None  # the ring slot the current layer reads
        self.writes = PageWrites(store)
        self._ahead: ReadAhead | None = None
        self._group = 1
        self._fill = 0  # device bytes of the pages each layer's update filled in the last pass

    # ------------------------------------------------------------------------------------------ setup
    @property
    def started(self) -> bool:
        return self.dtype is not None

    @property
    def page_bytes(self) -> int:
        return self.layout.token_bytes(self.dtype.itemsize if self.dtype else 2) * self.layout.page_tokens

    def start(self, k: torch.Tensor) -> None:
        """The first forward fixes the dtype and device; later ones must match."""
        if self.dtype is None:
            self.dtype, self.device = k.dtype, k.device
            if self.prefetch:
                self.mover = self.writes.mover = Mover(k.device)
            # Pages pinned at once by a load, and pages read ahead: in the store's streaming reserve, counted as
            # the pool charges them (whole memory pages), so that a load never waits for room its own pins hold.
            # A reserve of one page leaves no room to read ahead: a page read ahead would only be evicted by the
            # pin or the page write that needs the room first, and read again.
            page = pool_bytes([self.page_bytes])
            self._group = max(1, min(_GROUP, self.store.stream_reserve // page // 2))
            ahead = self.store.stream_reserve // page - self._group
            if self.prefetch and ahead > 0:
                self._ahead = ReadAhead(self.store, ahead)
        elif k.dtype != self.dtype or k.device != self.device:
            raise ValueError(f"key states of {k.dtype} on {k.device}, but this cache holds {self.dtype} on "
                             f"{self.device}: use one cache per model placement")  # fmt: skip

    def _side(self) -> torch.cuda.Stream | None:
        return self.mover.stream if self.mover is not None else None

    def _compute(self) -> torch.cuda.Stream | None:
        cuda = self.device is not None and self.device.type == "cuda"
        return torch.cuda.current_stream(self.device) if cuda else None

    def _event(self, stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        if stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    # ------------------------------------------------------------------------------------------ a pass
    def begin_pass(self, rows: list[int], held: list[int], q: int) -> None:
        """Before layer 0: land finished writes, decide the resident layers and the ring, drop loads issued for
        another batch, and leave the writes in flight the room the rest leaves of ``gpu_budget``."""
        self.settle_writes(wait=False)
        self.batch = list(rows)
        lay, pb = self.layout, self.page_bytes
        need = {s: lay.pages(lay.room(self.slots[s][0].length + (q if s in rows else 0))) for s in held}
        per_layer = max(1, sum(need.values()) * pb)
        tails = len(held) * lay.layers * pb
        block = len(rows) * max((need[s] for s in rows), default=0) * pb  # a ring block this pass, at most
        if self.gpu_budget is None or tails + per_layer * lay.layers <= self.gpu_budget:
            resident = lay.layers
        else:
            ring = len(self._ring) * block
            resident = max(0, min(lay.layers - 1, (self.gpu_budget - tails - ring) // per_layer))
        if resident != self.resident:
            for layer in list(self._pending):
                self._discard(layer)
            for layer in range(resident, self.resident):  # leaving the window: their pages are in the store
                for slots in self.slots.values():
                    slots[layer].dev, slots[layer].dev_n = None, 0
            self.resident = resident
        for layer in list(self._pending):  # a pass starts: only the first layers' loads can be ahead of it
            if layer >= self.prefetch or not self._valid(self._pending[layer]):
                self._discard(layer)
        ring = self._fit_ring(resident < lay.layers, block, tails + resident * per_layer)
        pt = lay.page_tokens
        fill = sum((self.slots[s][0].length + q) // pt - self.slots[s][0].length // pt for s in rows) * pb
        if self.gpu_budget is not None:
            # Whatever the budget leaves them, two layers' pages stay in flight: a layer's writes run during the
            # next layer's compute, instead of each being waited for as it is submitted. The last pass's count
            # too, so that a pass filling fewer pages (decode after a prefill) does not wait for its last writes.
            floor = 2 * max(fill, self._fill)
            self.writes.fit(self.gpu_budget - tails - resident * per_layer - ring, floor)
        self._fill = fill
        if self._ahead is not None:
            self._ahead.reset(self._stream_keys())

    def install(self, layer: int) -> list[tuple[torch.Tensor | None, int]]:
        """The layer's full pages in a block for each row: ``(block, pages loaded in it)``."""
        load = self._pending.get(layer)
        if load is not None and not self._valid(load):
            self._discard(layer)
            load = None
        if load is None:
            load = self._issue(layer, ahead=False)
            if load is not None:
                self._pending[layer] = load
        self._using = None
        if load is not None:
            try:
                self._wait(load)
            finally:  # a Ctrl-C in the wait leaves it pending, its copies under way: the next settle waits for them
                if load.future is None or load.future.done():
                    del self._pending[layer]
            if load.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(load.ready)
            n = sum(c > s for c, s in zip(load.counts, load.starts))
            self.loads["prefetched" if load.ahead else "waited"] += n
            self.moved["loaded_bytes"] += load.host_bytes
            self.moved["page_copies"] += load.copies
            self._using = load.ring
        out: list[tuple[torch.Tensor | None, int]] = []
        for i, seq in enumerate(self.batch):
            slot = self.slots[seq][layer]
            if layer < self.resident:
                if load is not None:
                    slot.dev_n = load.counts[i]
                out.append((slot.dev, slot.dev_n))
            else:
                out.append((load.dst[i], load.counts[i]) if load is not None else (None, 0))
        return out

    def issue_ahead(self, layer: int) -> None:
        """Issue the loads of the next ``prefetch`` layers, round into the next pass."""
        for i in range(1, self.prefetch + 1):
            nxt = (layer + i) % self.layout.layers
            if nxt not in self._pending:
                load = self._issue(nxt, ahead=True)
                if load is not None:
                    self._pending[nxt] = load

    def consumed(self) -> None:
        """The current layer's gather is queued: its ring slot may be refilled once the compute stream is past it."""
        if self._using is not None:
            self._free[self._using] = self._event(self._compute())
            self._using = None

    def filled(self, layer: int, slot: Slot, pages: list[Page]) -> None:
        """Pages this update filled: into the resident block, and written to the store (by the mover, after the
        appends land; in the caller's thread for the serial twin)."""
        if not pages:
            return
        if layer < self.resident:
            dev = self._dev_block(slot, pages[-1].index + 1)
            for page in pages:
                assert page.fresh is not None
                dev[page.index].copy_(page.fresh)
            slot.dev_n = pages[-1].index + 1
        self.moved["written_bytes"] += len(pages) * self.page_bytes
        self.writes.submit(pages)

    # ------------------------------------------------------------------------------------------ loads
    def _valid(self, load: Load) -> bool:
        if tuple(self.batch) != load.rows or (load.ring is None) != (load.layer < self.resident):
            return False
        for i, seq in enumerate(load.rows):
            slot = self.slots.get(seq, [None] * self.layout.layers)[load.layer]
            if slot is None or len(slot.pages) != load.counts[i]:
                return False
            if load.ring is None and (slot.dev is not load.dst[i] or slot.dev_n != load.starts[i]):
                return False
        return True

    def _issue(self, layer: int, *, ahead: bool) -> Load | None:
        slots = [self.slots[s][layer] for s in self.batch]
        counts = [len(s.pages) for s in slots]
        if layer < self.resident:
            starts = [s.dev_n for s in slots]
            if counts == starts:
                return None
            dst, ring = [self._dev_block(s, c) for s, c in zip(slots, counts)], None
            wait = self._event(self._compute()) if self.mover is not None else None
        else:
            if not any(counts):
                return None
            starts, ring = [0] * len(slots), self._next
            self._next = (self._next + 1) % len(self._ring)
            for other in [n for n, ld in self._pending.items() if ld.ring == ring]:
                self._discard(other)  # never two loads in one slot (only after a pass broken off by an error)
            block = self._ring_block(ring, len(slots), max(counts))
            dst, wait = [block[i] for i in range(len(slots))], self._free[ring]
        load = Load(layer, tuple(self.batch), tuple(counts), tuple(starts), dst, ring, ahead)
        dsts, srcs = [], []
        for i, slot in enumerate(slots):
            for j in range(starts[i], counts[i]):
                page, d = slot.pages[j], dst[i][j]
                if page.fresh is not None:
                    dsts.append(d)
                    srcs.append(page.fresh)
                    continue
                load.host_bytes += self.page_bytes
                if page.host is not None:
                    dsts.append(d)
                    srcs.append(page.host)
                else:
                    load.keyed.append((d, page.key))
        load.copies = len(dsts) + len(load.keyed)
        side = self._side()
        if side is not None:
            with torch.cuda.stream(side):
                if wait is not None:
                    side.wait_event(wait)
                for t in {id(d): d for d in dst}.values():  # the allocator must not reuse them under the copies
                    t.record_stream(side)
                for s in srcs:
                    if s.is_cuda:
                        s.record_stream(side)
                copy_all(dsts, srcs)
                if not load.keyed:
                    load.ready = self._event(side)
        else:
            copy_all(dsts, srcs)  # serial twin, or CPU: in the caller's stream / at once
        if load.keyed:
            if self.mover is not None:
                ahead_ = self._ahead if ring is not None else None
                load.future = self.mover.submit(copy_keyed, self.store, load.keyed, self._group, side, ahead_)
            else:
                self.moved["host_syncs"] += copy_keyed(self.store, load.keyed, self._group, self._compute(), None)
        return load

    def _wait(self, load: Load) -> None:
        if load.future is not None:
            syncs = load.future.result()  # a Ctrl-C in the wait leaves the load in flight, as it is
            load.future = None
            self.moved["host_syncs"] += syncs or 0

    def _discard(self, layer: int) -> None:
        """Drop a load nobody will use, once its copies are done (they write into a block that is reused). Its own
        failure is not the caller's; a Ctrl-C in the wait is, and leaves the load pending, for the next settle."""
        load = self._pending[layer]
        fut = load.future
        try:
            self._wait(load)
        except Exception as e:
            if fut is None or not fut.done() or fut.exception() is not e:
                raise
        del self._pending[layer]

    def _fit_ring(self, streams: bool, block: int, rest: int) -> int:
        """Give back the ring blocks this pass should not hold: all of them when no layer streams, and a block
        larger than ``block`` (this pass's, at most) where keeping it would take the window over ``gpu_budget``
        (sized for a long sequence since freed). A block made for these rows is never larger, so none is made
        again from pass to pass. ``rest``: the window's other bytes. Returns the ring's bytes during the pass, at
        most."""
        held = [t.numel() * t.element_size() if t is not None else 0 for t in self._ring]
        over = self.gpu_budget is not None and rest + sum(max(h, block) for h in held) > self.gpu_budget
        for i, h in enumerate(held):
            if h and (not streams or (over and h > block)):
                for layer in [n for n, ld in self._pending.items() if ld.ring == i]:
                    self._discard(layer)
                # On CUDA the allocator keeps the memory from reuse until the side stream's copies into it are
                # done (record_stream) and the compute stream's reads of it are.
                self._ring[i], self._free[i], held[i] = None, None, 0
        return sum(max(h, block) for h in held) if streams else 0

    def _ring_block(self, ring: int, rows: int, pages: int) -> torch.Tensor:
        t = self._ring[ring]
        if t is None or t.shape[0] != rows or t.shape[1] < pages:
            cap = self.layout.pages(self.layout.room(pages * self.layout.page_tokens))
            t = torch.empty((rows, cap, *self.layout.page_shape()), dtype=self.dtype, device=self.device)
            self._ring[ring] = t
            self._free[ring] = self._event(self._compute())  # its memory may have had a life on the compute stream
        return t

    def _dev_block(self, slot: Slot, pages: int) -> torch.Tensor:
        if slot.dev is None or slot.dev.shape[0] < pages:
            cap = self.layout.pages(self.layout.room(pages * self.layout.page_tokens))
            dev = torch.empty((cap, *self.layout.page_shape()), dtype=self.dtype, device=self.device)
            if slot.dev is not None and slot.dev_n:
                dev[: slot.dev_n].copy_(slot.dev[: slot.dev_n])
            slot.dev = dev
        return slot.dev

    def _stream_keys(self) -> list[str]:
        """The keys ring loads read through the store, in the order the loads read them."""
        return [p.key for layer in range(self.resident, self.layout.layers) for s in self.batch
                for p in self.slots[s][layer].pages if p.fresh is None and p.host is None]  # fmt: skip

    # ------------------------------------------------------------------------------------------ writes
    def settle_writes(self, *, wait: bool, check: bool = True) -> None:
        """``PageWrites.settle``: land the writes that finished; with ``check``, raise a failure once, or write
        again the pages whose write failed."""
        self.writes.settle(wait=wait, check=check)

    # ------------------------------------------------------------------------------------------ the rest
    def settle(self, *, check: bool = True) -> None:
        """Nothing in flight: loads dropped (their copies done), writes landed. Before the sequences change.
        ``check``: as ``settle_writes``'s."""
        for layer in list(self._pending):
            self._discard(layer)
        # Copies from held pages may be in flight (on the side stream; the serial twin queues them on the
        # caller's stream): they must end before a hold does and the page's buffer goes back to the pool.
        stream = self._side() or self._compute()
        if stream is not None:
            stream.synchronize()
        self.settle_writes(wait=True, check=check)

    def drop_ring(self) -> None:
        """Give the ring's memory back (after ``settle``): no sequence is left to stream through it."""
        self._ring = [None] * len(self._ring)
        self._free = [None] * len(self._free)

    def bytes_held(self) -> int:
        n = sum(t.numel() * t.element_size() for t in self._ring if t is not None)
        for slots in self.slots.values():
            for s in slots:
                for t in (s.tail, s.dev):
                    if t is not None:
                        n += t.numel() * t.element_size()
        return n + self.writes.nbytes

    def stats(self) -> dict[str, Any]:
        return {"window_bytes": self.bytes_held(), "window_peak": self.peak, "resident": self.resident,
                **self.moved, "loads": dict(self.loads)}  # fmt: skip

    def close(self) -> None:
        if self.mover is not None:
            self.mover.close()
