"""A layer's load: the copies that put its full pages into a device block, and the store's read-ahead.

A ``Load`` is made when it is issued (``prefetch`` layers ahead, or when the layer is needed): for each batch row,
the pages ``[start, count)`` of the layer go to ``dst[row]`` (a ring slot or the slot's resident block). Each
page's source is fixed then: its device copy (a page whose write is in flight), its held pinned host tensor (a
page the store keeps in host memory), or its store key (a page the store streams, on NVMe or in its reserve).
Device and held sources are copied at once, by the thread that issues the load (on CUDA on the side stream, in
one batched call: ``copy_all``); keyed sources are pinned through the store, in groups that fit the store's
streaming reserve, copied, waited for (the copies read the pins), unpinned and retired, on the mover thread (or
in the caller's thread for the serial twin).

``ReadAhead`` keeps the store reading ahead over the known order of the keyed pages (the streaming layers' pages,
layer by layer, row by row, page by page, and round again into the next forward pass), so that the disk never
waits for the copies: before every group, told where in that order the group starts (``seek``), it asks the
store to prefetch the next pages, as many as its streaming reserve holds beside one group (none when the reserve
holds one page only). Each page is then read from NVMe once a pass, as the serial twin reads it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..store import TieredStore

__all__ = ["Load", "ReadAhead", "copy_all", "copy_keyed"]


@dataclass(eq=False)
class Load:
    layer: int
    rows: tuple[int, ...]  # the sequences, in batch order
    counts: tuple[int, ...]  # full pages of each row when issued
    starts: tuple[int, ...]  # first page loaded (0 into a ring slot; the block's valid pages into a resident one)
    dst: list[torch.Tensor]  # per row: the block the pages go to
    ring: int | None  # the ring slot, None for resident blocks
    ahead: bool  # issued before the layer was needed
    host_bytes: int = 0  # bytes copied from host memory (held pages and keyed ones)
    copies: int = 0  # copy calls: one a page
    ready: torch.cuda.Event | None = None  # recorded after the copies, on the side stream
    future: Future[None] | None = None  # the mover's part (keyed pages), if any
    keyed: list[tuple[torch.Tensor, str]] = field(default_factory=list)


def copy_all(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dst.copy_(src, non_blocking=True)`` for each pair, in one call where torch allows: a layer of a long
    context is hundreds of pages, and a Python call a page would cost more than the copy's issue."""
    if not dsts:
        return
    try:
        torch._foreach_copy_(list(dsts), list(srcs), non_blocking=True)
    except (RuntimeError, TypeError, AttributeError, NotImplementedError):  # pragma: no cover - older torch
        for d, s in zip(dsts, srcs):  # the same copies one by one; any done already are done again, identically
            d.copy_(s, non_blocking=True)


def copy_keyed(store: TieredStore, keyed: list[tuple[torch.Tensor, str]], group: int,
               stream: torch.cuda.Stream | None, ahead: ReadAhead | None) -> int:  # fmt: skip
    """Keyed pages into their destinations, ``group`` at a time: pin (waits only for that page's read), copy,
    wait for the copies on ``stream`` (they read the pinned pages), unpin, retire (the store streams the page
    out again). Returns the host syncs made."""
    syncs = 0
    for start in range(0, len(keyed), group):
        part = keyed[start : start + group]
        if ahead is not None:
            ahead.seek(part[0][1])
            ahead.top_up()
        with contextlib.ExitStack() as pins:
            for dst, key in part:
                dst.copy_(pins.enter_context(store.pin(key, tier="host")), non_blocking=True)
            if stream is not None:
                stream.synchronize()
                syncs += 1
        for _, key in part:
            store.retire(key)
        if ahead is not None:
            ahead.consumed(len(part))
    if ahead is not None:
        ahead.top_up()
    return syncs


class ReadAhead:
    """The store's prefetch kept ``limit`` pages ahead of the pages consumed, over a cyclic order of keys.

    Positions count pages along the order, round after round. Each group of a load says where it is (``seek``, by
    its first key): the loads do not consume the order exactly once a round (a load issued ahead and dropped, for
    another batch or because the pages changed, consumed its pages and the one issued again consumes them again;
    the loads of the next pass's first layers may run before the pass starts and the order is renewed). Counted
    blindly, the position drifted from the pages the loads read, and the store read ahead pages that had been used
    and retired already, then the pages needed without read-ahead: twice the NVMe reads of the serial twin."""

    def __init__(self, store: TieredStore, limit: int) -> None:
        self.store, self.limit = store, max(1, limit)
        self._lock = threading.Lock()  # the window resets it from the caller's thread; the mover advances it
        self.keys: list[str] = []
        self._index: dict[str, int] = {}
        self._pos = 0  # the position of the next page to be consumed
        self._announced: int | None = None  # pages up to here were handed to the store's prefetch (None: unknown)

    def reset(self, keys: list[str]) -> None:
        with self._lock:
            if keys == self.keys:
                return
            self.keys, self._index, self._announced = keys, {k: i for i, k in enumerate(keys)}, None

    def seek(self, key: str) -> None:
        """The next page consumed is ``key`` (one outside the order changes nothing)."""
        with self._lock:
            i, n = self._index.get(key), len(self.keys)
            if i is None:
                return
            base = self._pos - self._pos % n
            self._pos = min((base - n + i, base + i, base + n + i), key=lambda p: abs(p - self._pos))
            if self._announced is None or not self._pos <= self._announced <= self._pos + self.limit:
                self._announced = self._pos  # what was announced is behind us, or was for other positions

    def consumed(self, n: int) -> None:
        with self._lock:
            self._pos += n
            self._announced = max(self._announced or 0, self._pos)

    def top_up(self) -> None:
        with self._lock:
            n = len(self.keys)
            if not n:
                return
            first = self._pos if self._announced is None else self._announced
            last = self._pos + min(self.limit, n)
            want = [self.keys[i % n] for i in range(first, last)]
        if not want:
            return
        try:
            started = len(self.store.prefetch(want))
        except KeyError:  # a page deleted meanwhile (a sequence freed): the next reset brings the new order
            return
        with self._lock:
            if self._announced is None or self._announced == first:
                self._announced = first + started
