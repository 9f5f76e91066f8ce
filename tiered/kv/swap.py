"""Swapping a sequence off the device and back: its tails stored as records, its pages in host memory checksummed.

``Swapper.out(seq, slots)`` stores each layer's tail (the partial last page) under its page's key (the full pages
are stored already), takes a checksum of its tail and, once each, of its pages in host memory, and drops its device
memory; all or nothing: a store that fails part-way deletes the tails it stored and changes nothing.
``Swapper.back(seq, slots)`` checks them (``SwapIntegrityError``, an ``IntegrityError``, if they differ; pages on
NVMe are checked by the store as they are read) and brings the tails back to the device, deleting their records
once every one is back (a swap_in that fails before changes nothing, and can be run again).

A Ctrl-C. Each is in two parts: the store's work (storing or reading the tails, the checksums), which a Ctrl-C stops
at once, as it does a store call waiting for a stalled disk, and which changes nothing the sequence is read from;
then the change itself (the tails dropped or put back, and the cache's bookkeeping: ``out`` and ``back`` are
context managers, whose block is the cache's part), in one ``deferred_sigint`` block: a press there is raised once
the sequence is wholly swapped. ``free`` does the same (the cache's ``free``, with ``forget`` inside its block).
So an interrupt leaves the sequence either as it was or as the call makes it, never between (a sequence marked on
the device with its tails dropped, whose next forward read zeros; one marked swapped whose tails' records were
gone). The records nothing reads any more (a swap's tails not needed, a freed sequence's pages) are *owed*: deleted
after the change, outside the block (a delete waits for the record's write or read in flight, which a stalled disk
can make last), and where a Ctrl-C stops that, by the next swap, free or forward (``pay``), before any of their keys
is written again (a page that fills takes its tail's key); close() deletes every record anyway.

Call order: the cache checks the sequence may swap and settles its window first (no load or write in flight);
``pay`` at the start of each forward; ``close()`` last. ``counts``: swaps, the seconds spent in them (the cache's,
with its settling) and, within them, in checksums.
"""

from __future__ import annotations

import contextlib
import errno
import time
from collections.abc import Iterator

import torch

from ..interrupts import deferred_sigint
from ..store import TieredStore
from ..store.records import IntegrityError
from .layout import KVLayout, page_key
from .pages import ParallelCrc, Slot, crc_of, page_integrity_error

__all__ = ["Swapper", "SwapIntegrityError"]


class SwapIntegrityError(IntegrityError):
    """A swapped-out sequence's keys and values read back differ from what ``swap_out`` checksummed."""

    def __init__(self, seq: int, layer: int, message: str, path: str) -> None:
        self.message, self.seq, self.layer, self.key, self.path = message, seq, layer, f"sequence {seq}", path
        OSError.__init__(self, errno.EIO, message, path)


class Swapper:
    def __init__(self, store: TieredStore, layout: KVLayout, verify: bool, workdir: str) -> None:
        self.store, self.layout, self.verify, self.workdir = store, layout, verify, workdir
        self.counts: dict[str, float] = {"out": 0, "in": 0, "out_s": 0.0, "in_s": 0.0, "crc_s": 0.0}
        self.owed: list[str] = []  # keys of records to delete (see the module docstring)
        self._crc = ParallelCrc()

    @contextlib.contextmanager
    def out(self, seq: int, slots: list[Slot]) -> Iterator[int]:
        """Store the sequence's tails and checksum it; then, a Ctrl-C held, drop its device memory and run the
        block (yields the tail bytes stored)."""
        self.pay()
        tails = self._store_tails(seq, slots)
        with deferred_sigint():
            stored = {key for key, _, _ in tails.values()}
            self.owed = [key for key in self.owed if key not in stored]
            written = 0
            for slot in slots:
                if slot.layer in tails:
                    _, slot.tail_crc, nbytes = tails[slot.layer]
                    written += nbytes
                slot.tail, slot.dev, slot.dev_n = None, None, 0
            self.counts["out"] += 1
            yield written

    @contextlib.contextmanager
    def back(self, seq: int, slots: list[Slot], device: torch.device | None) -> Iterator[None]:
        """Check the sequence against its checksums and read its tails back to ``device``; then, a Ctrl-C held,
        put them back and run the block; their records deleted last. Nothing changes if a check, a read or a copy
        fails."""
        self.pay()
        if self.verify:
            todo = [(slot.layer, p) for slot in slots for p in slot.pages if p.host is not None and p.crc is not None]
            for (layer, page), crc in zip(todo, self._crcs([p.host for _, p in todo])):  # type: ignore[misc]
                if crc != page.crc:
                    self._integrity(seq, layer, f"page {page.index}", crc, page.crc)
        tails: list[torch.Tensor | None] = []
        for slot in slots:
            n = slot.tail_tokens(self.layout)
            if not n:
                tails.append(None)
                continue
            try:
                t = self.store.get(page_key(seq, slot.layer, slot.full))  # a record on NVMe is checked as it is read
            except IntegrityError as e:  # a damaged file: the fix is the cache's, not the store's
                raise page_integrity_error(e, seq) from e
            if self.verify and crc_of(t[:, :, :n]) != slot.tail_crc:
                self._integrity(seq, slot.layer, "its last page", crc_of(t[:, :, :n]), slot.tail_crc)
            tails.append(t)
        moved = [t.to(device) if t is not None else None for t in tails]  # before any slot changes
        with deferred_sigint():
            for slot, back in zip(slots, moved):
                if back is not None:
                    slot.tail, slot.tail_crc = back, None
                    # The tail lives on the device again: its record would hold host memory (or NVMe) until the page
                    # fills. Deleted only now, so that a swap_in that failed above can be run again.
                    self.owed.append(page_key(seq, slot.layer, slot.full))
            self.counts["in"] += 1
            yield
        self.pay()

    def forget(self, seq: int, slots: list[Slot]) -> None:
        """Sequence ``seq`` is freed (the caller holds a Ctrl-C, and settled the window): its page holds released,
        its records owed."""
        for slot in slots:
            for page in slot.pages:
                page.release()
            # The last one: a partial page stored by swap_out.
            self.owed += [page_key(seq, slot.layer, i) for i in range(slot.full + 1)]

    def pay(self) -> None:
        """Delete the records owed, in order. One whose delete a Ctrl-C stops stays owed; one whose delete fails
        otherwise (gone already, or an I/O error) is left to close()."""
        while self.owed:
            with contextlib.suppress(Exception):
                self.store.delete(self.owed[0])
            del self.owed[0]

    def close(self) -> None:
        self._crc.close()

    def _store_tails(self, seq: int, slots: list[Slot]) -> dict[int, tuple[str, int, int]]:
        """Each layer's tail stored, with its checksum: ``{layer: (key, crc, bytes)}``. What stops it (a full disk, a
        Ctrl-C) leaves the sequence as it was and its tails' records owed, deleted at once where it can."""
        tails = {}
        try:
            for slot in slots:
                n = slot.tail_tokens(self.layout)
                if n and slot.tail is not None:  # the partial page becomes a record of its own, under its page's key
                    key = page_key(seq, slot.layer, slot.full)
                    self.owed.append(key)  # first: a Ctrl-C as the put returns must not leave it unknown
                    self.store.put(key, slot.tail)
                    crc = crc_of(slot.tail[:, :, :n].cpu()) if self.verify else 0
                    tails[slot.layer] = (key, crc, n * self.layout.token_bytes(slot.tail.element_size()))
            if self.verify:  # each page's checksum once: full pages never change
                todo = [p for slot in slots for p in slot.pages if p.host is not None and p.crc is None]
                for page, crc in zip(todo, self._crcs([p.host for p in todo])):  # type: ignore[misc]
                    page.crc = crc
        except BaseException:
            self.pay()  # the tails are still on the device, and nothing else changed
            raise
        return tails

    def _crcs(self, tensors: list[torch.Tensor]) -> list[int]:
        t0 = time.perf_counter()
        try:
            return self._crc(tensors)
        finally:
            self.counts["crc_s"] += time.perf_counter() - t0

    def _integrity(self, seq: int, layer: int, what: str, got: int, want: int | None) -> None:
        msg = (f"swap_in({seq}): layer {layer}'s keys and values ({what}) differ from what swap_out left (crc "
               f"{got:#010x}, expected {want or 0:#010x}) under {self.workdir}; the sequence stays swapped out: "
               "free() it and recompute it")  # fmt: skip
        raise SwapIntegrityError(seq, layer, msg, self.workdir)
