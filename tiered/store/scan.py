"""One pass over a chunked state in a TieredStore: the read-ahead rule, and the simple scan built on it.

Every pass over the chunks (the optimizer's step, ``state_dict``, ``load_state_dict``, a checkpoint's save
and load) reads ahead the same way: ``ReadAhead`` keeps ``depth`` NVMe reads in flight ahead of the chunk
in use, counting only the chunks that must come from disk. Counting positions instead would leave the disk
idle while the resident chunks (which need no read) are used. ``SerialReadAhead`` is its twin for
``depth == 0``: nothing in flight, each chunk read when it is pinned.

Call order: ``reads = read_ahead(store, keys, depth)``; ``reads.through(-1)`` to start; before using chunk
i, ``reads.through(i)``; optionally ``reads.next_step()`` at the end of a step, which starts the next pass's
first reads so that they run during forward and backward.

``spread_disk(store, keys)`` is the order a pass that can choose it (the optimizer's step) takes its chunks in:
those on disk spread evenly among the resident ones, so that the disk reads and writes through the whole pass
rather than idling while the resident chunks come first and working alone after them.

``windowed(n, hold, open_item, close_item, ahead=...)`` is the chunk scan every pass runs: the step's stream
(optim/pipeline.py), a checkpoint's save and load, and ``scan``: items opened in order, each closed once
``hold`` are open (2 lets one chunk's work overlap the last one's copies; 1 is the serial twin), with one
failure path (everything open closed, oldest first, then the error). ``scan(store, keys, depth, fn)`` is the
whole pass for callers that use one chunk at a time: ``fn(i, record)`` with chunk i pinned in host memory,
then ``store.retire`` (it streams out again unless it is resident). A failure in ``fn`` unpins at once (a
``with`` block, not a generator left to the collector).

``pinned_in_host(store, key, writes)`` is how such a pass holds a chunk: pinned where it lies, and a record
kept in HBM stays there. Moving it down (``pin(key, tier="host")``) would leave it in host memory after
the pass, beyond the host budget's plan: a framework's checkpoint every N steps would push the HBM share out
to the host and on to the disk. Such a record is handed over as a host copy, copied back after a pass that
``writes``.
"""

from __future__ import annotations

import bisect
import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

__all__ = ["ReadAhead", "SerialReadAhead", "pinned_in_host", "read_ahead", "scan", "spread_disk", "windowed"]

T = TypeVar("T")


class ReadAhead:
    """``depth`` reads in flight ahead of the chunk in use, over the chunks that live on disk."""

    def __init__(self, store: Any, keys: list[str], depth: int):
        # Resident chunks need no read: the window counts the others. (Asking where a chunk is now would
        # miss those whose write-back is still in flight: in host memory now, on disk when needed.)
        self.store, self.keys, self.depth = store, keys, depth
        self.on_disk = [i for i, key in enumerate(keys) if not store.is_resident(key)]
        self.issued = 0  # reads started, a prefix of on_disk

    def through(self, i: int) -> None:
        """Chunk i is next: have the reads of the next ``depth`` on-disk chunks after it started."""
        want = min(len(self.on_disk), bisect.bisect_right(self.on_disk, i) + self.depth)
        if want > self.issued:
            self.store.prefetch([self.keys[j] for j in self.on_disk[self.issued : want]])
            self.issued = want

    def next_step(self) -> None:
        """Start the next pass's first reads now (they run while the model computes)."""
        if self.on_disk:
            self.store.prefetch([self.keys[j] for j in self.on_disk[: self.depth]])


class SerialReadAhead(ReadAhead):
    """The serial twin: no read runs ahead; each chunk is read when it is pinned."""

    def __init__(self, store: Any, keys: list[str], depth: int = 0):
        super().__init__(store, keys, 0)

    def through(self, i: int) -> None:
        pass

    def next_step(self) -> None:
        pass


def read_ahead(store: Any, keys: list[str], depth: int) -> ReadAhead:
    return ReadAhead(store, keys, depth) if depth > 0 else SerialReadAhead(store, keys)


def spread_disk(store: Any, keys: list[str]) -> list[int]:
    """An order of ``keys`` (indices) with the on-disk chunks spread evenly among the resident ones, each kind in
    its own order, an on-disk chunk first (its read ran ahead under the last forward and backward).

    The resident chunks are the first ones put (the scan policy keeps them), so in put order a step updates them
    all while the disk has only ``depth`` reads to do, then streams the rest with nothing left to overlap: about
    the resident chunks' time plus the disk's. Spread, every resident chunk's update runs beside the reads and
    writes of the disk's: about the larger of the two. The update of each chunk is its own, so any order gives
    the same bits."""
    disk = [i for i, key in enumerate(keys) if not store.is_resident(key)]
    held = [i for i, key in enumerate(keys) if store.is_resident(key)]
    if not disk or not held:
        return list(range(len(keys)))
    # On-disk chunk k at k / len(disk) of the pass, resident chunk k at (k + 1/2) / len(held): a merge by position.
    pos = [(k / len(disk), 0, i) for k, i in enumerate(disk)] + [
        ((k + 0.5) / len(held), 1, i) for k, i in enumerate(held)
    ]
    return [i for _, _, i in sorted(pos)]


def windowed(n: int, hold: int, open_item: Callable[[int], T], close_item: Callable[[int, T, bool], None], *,
             ahead: Callable[[int], None] = lambda i: None) -> None:  # fmt: skip
    """The chunk scan: items ``0 .. n-1`` in order, each opened (``open_item(i)``: pinned, updated, its writes
    or reads started) and closed (``close_item(i, item, failed)``: waited for, unpinned, retired) once ``hold``
    items are open, so that item i's work runs while item i-1's copies or writes land. ``ahead(i)`` runs before
    item i opens (``ahead(-1)`` first): the read-ahead. ``hold == 1`` is the serial twin: each item closed
    before the next opens.

    One failure path for every pass: if opening or closing raises, every item still open is closed, oldest
    first, with ``failed=True`` (wait for what reads its buffers, then unpin; no new work), and the first error
    propagates. Each item is closed exactly once."""
    if hold < 1:
        raise ValueError(f"hold must be >= 1, got {hold}")
    window: deque[tuple[int, T]] = deque()
    try:
        ahead(-1)
        for i in range(n):
            ahead(i)
            window.append((i, open_item(i)))
            if len(window) >= hold:
                close_item(*window.popleft(), False)
        while window:
            close_item(*window.popleft(), False)
    except BaseException:
        while window:
            with contextlib.suppress(Exception):  # the first error is the one to report
                close_item(*window.popleft(), True)
        raise


def scan(store: Any, keys: list[str], depth: int, fn: Callable[[int, torch.Tensor], None], *,
         writes: bool = False) -> None:  # fmt: skip
    """``fn(i, record)`` for each key in turn, its record in host memory (``pinned_in_host``, which ``writes``
    says whether ``fn`` changes it); then it is retired. One chunk held at a time (``windowed(hold=1)``);
    ``depth`` reads run ahead."""
    reads = read_ahead(store, keys, depth)

    def open_item(i: int) -> None:
        with pinned_in_host(store, keys[i], writes) as record:
            fn(i, record)

    def close_item(i: int, _: None, failed: bool) -> None:
        if not failed:
            store.retire(keys[i])

    windowed(len(keys), 1, open_item, close_item, ahead=reads.through)


@contextlib.contextmanager
def pinned_in_host(store: Any, key: str, writes: bool = False) -> Iterator[torch.Tensor]:
    """The record of ``key`` in host memory, pinned for the block: itself (read in from NVMe if it must be), or
    for a record kept in HBM, which stays there, a host copy, copied back into it after the block if
    ``writes`` (the caller marks it dirty as for any record)."""
    with store.pin(key) as record:
        if store.info(key).tier != "gpu":
            yield record
            return
        copy = torch.empty(record.shape, dtype=record.dtype, device="cpu").copy_(record)
        yield copy
        if writes:
            record.copy_(copy)
