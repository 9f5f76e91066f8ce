"""Swapping a sequence off the device and back: its tails stored as records, its pages in host memory checksummed.

``Swapper.out(seq, slots)`` stores each layer's tail (the partial last page) under its page's key (the full pages
are stored already), takes a checksum of its tail and, once each, of its pages in host memory, and drops its device
memory; all or nothing: a store that fails part-way deletes the tails it stored and changes nothing.
``Swapper.back(seq, slots)`` checks them (``SwapIntegrityError``, an ``IntegrityError``, if they differ; pages on
NVMe are checked by the store as they are read) and brings the tails back to the device, deleting their records
once every one is back (a swap_in that fails before changes nothing, and can be run again).

Call order: the cache checks the sequence may swap and settles its window first (no load or write in flight);
``close()`` last. ``counts``: swaps, the seconds spent in them (the cache's, with its settling) and, within them,
in checksums.
"""

from __future__ import annotations

import contextlib
import errno
import time

import torch

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
        self._crc = ParallelCrc()

    def out(self, seq: int, slots: list[Slot]) -> int:
        """Store the sequence's tails and checksum it; its device memory dropped. Returns the tail bytes stored."""
        stored, tails = [], {}
        try:
            for slot in slots:
                n = slot.tail_tokens(self.layout)
                if n and slot.tail is not None:  # the partial page becomes a record of its own, under its page's key
                    key = page_key(seq, slot.layer, slot.full)
                    self.store.put(key, slot.tail)
                    stored.append(key)
                    crc = crc_of(slot.tail[:, :, :n].cpu()) if self.verify else 0
                    tails[slot.layer] = (crc, n * self.layout.token_bytes(slot.tail.element_size()))
            if self.verify:  # each page's checksum once: full pages never change
                todo = [p for slot in slots for p in slot.pages if p.host is not None and p.crc is None]
                for page, crc in zip(todo, self._crcs([p.host for p in todo])):  # type: ignore[misc]
                    page.crc = crc
        except BaseException:
            for key in stored:  # the tails are still on the device, and nothing else changed
                with contextlib.suppress(BaseException):
                    self.store.delete(key)
            raise
        written = 0
        for slot in slots:
            if slot.layer in tails:
                slot.tail_crc, nbytes = tails[slot.layer]
                written += nbytes
            slot.tail, slot.dev, slot.dev_n = None, None, 0
        self.counts["out"] += 1
        return written

    def back(self, seq: int, slots: list[Slot], device: torch.device | None) -> None:
        """Check the sequence against its checksums and bring its tails back to ``device`` (their records deleted);
        nothing changes if a check, a read or a copy fails."""
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
        for slot, back in zip(slots, moved):
            if back is not None:
                slot.tail, slot.tail_crc = back, None
                # The tail lives on the device again: its record would hold host memory (or NVMe) until the page
                # fills. Deleted only now, so that a swap_in that failed above can be run again. A delete that
                # fails leaves the record to the page's write or free(), which replace or delete it.
                with contextlib.suppress(Exception):
                    self.store.delete(page_key(seq, slot.layer, slot.full))
        self.counts["in"] += 1

    def close(self) -> None:
        self._crc.close()

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
