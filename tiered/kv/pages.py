"""A sequence's keys and values in one layer: full pages in the store, the partial last page on the device.

A ``Slot`` is one (sequence, layer). Its tokens ``[0, length)`` are ``pages`` (each ``page_tokens`` tokens, full,
never written again) and a ``tail``: a device tensor of one page holding the last ``length % page_tokens`` tokens.
The tail lives on the device while the sequence is not swapped out, so decoding a token writes nothing over PCIe;
when it fills it becomes a new ``Page`` whose bytes are still on the device (``fresh``) while its write to the
store is in flight, and a new tail starts. Once the write lands, a page the store keeps in host memory for good
(its resident set) is pinned once and held (``host``): loads copy from it directly, with no store call. A page the
store streams (NVMe) is read through the store when loaded.

``append`` writes new tokens into tails (and pushes the pages they fill); ``gather`` builds what attention reads:
a contiguous ``(heads, length, head_dim)`` for keys and values, laid out as ``DynamicCache`` hands them.
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any

import torch

from io_engine.threadpool import ThreadPool

from ..store.records import IntegrityError
from .layout import KVLayout, page_key, page_seq

__all__ = ["Page", "Slot", "append", "gather", "crc_of", "ParallelCrc", "for_cache_user",
           "page_integrity_error"]  # fmt: skip


class Page:
    """One full page of one (sequence, layer): where its bytes are now."""

    __slots__ = ("index", "key", "fresh", "write", "host", "hold", "crc")

    def __init__(self, index: int, key: str, fresh: torch.Tensor) -> None:
        self.index, self.key = index, key
        self.fresh: torch.Tensor | None = fresh  # device copy while the store's write is in flight
        self.write: Future[None] | None = None  # that write
        self.host: torch.Tensor | None = None  # the store's pinned host tensor, held (resident pages only)
        self.hold: AbstractContextManager[torch.Tensor] | None = None  # the store pin that holds it
        self.crc: int | None = None  # taken at the first swap_out, checked at swap_in

    @property
    def written(self) -> bool:
        return self.fresh is None

    def release(self) -> None:
        """Let go of the store pin (the caller made sure no copy from ``host`` is in flight)."""
        hold, self.hold, self.host = self.hold, None, None
        if hold is not None:
            hold.__exit__(None, None, None)


class Slot:
    """One (sequence, layer): its length, pages, tail, and (resident layers) its device block."""

    __slots__ = ("seq", "layer", "length", "pages", "tail", "tail_crc", "dev", "dev_n")

    def __init__(self, seq: int, layer: int) -> None:
        self.seq, self.layer = seq, layer
        self.length = 0
        self.pages: list[Page] = []
        self.tail: torch.Tensor | None = None  # (2, heads, page_tokens, head_dim) on the device
        self.tail_crc: int | None = None  # of the tail's tokens, while swapped out
        self.dev: torch.Tensor | None = None  # resident layers: (capacity, 2, heads, page_tokens, head_dim)
        self.dev_n = 0  # pages of ``dev`` that hold their page's bytes

    @property
    def full(self) -> int:
        return len(self.pages)

    def tail_tokens(self, layout: KVLayout) -> int:
        return self.length - len(self.pages) * layout.page_tokens


def append(slot: Slot, layout: KVLayout, k: torch.Tensor, v: torch.Tensor) -> list[Page]:
    """Write ``k``, ``v`` (``(heads, q, head_dim)``) after the slot's tokens; returns the pages they filled
    (their bytes are the filled tails, ``fresh``), in order. Two copies a page touched."""
    p, q, done, new = layout.page_tokens, k.shape[1], 0, []
    while done < q:
        off = slot.length % p
        n = min(q - done, p - off)
        if slot.tail is None:  # zeros, not garbage: a partial page stored at swap_out has defined bytes
            slot.tail = torch.zeros(layout.page_shape(), dtype=k.dtype, device=k.device)
        slot.tail[0, :, off : off + n].copy_(k[:, done : done + n])
        slot.tail[1, :, off : off + n].copy_(v[:, done : done + n])
        slot.length += n
        done += n
        if off + n == p:
            page = Page(len(slot.pages), page_key(slot.seq, slot.layer, len(slot.pages)), slot.tail)
            slot.pages.append(page)
            new.append(page)
            slot.tail = None
    return new


def gather(slot: Slot, layout: KVLayout, block: torch.Tensor | None, loaded: int, out_k: torch.Tensor,
           out_v: torch.Tensor) -> None:  # fmt: skip
    """The slot's tokens into ``out_k``, ``out_v`` (``(heads, length, head_dim)``, contiguous): the first
    ``loaded`` pages from ``block`` (one strided copy each for keys and values), the later pages from their device
    copies (pages this very update filled), then the tail."""
    p, heads, d = layout.page_tokens, out_k.shape[0], out_k.shape[2]
    full = len(slot.pages)
    rest = slot.length - full * p
    for row, out in ((0, out_k), (1, out_v)):
        if loaded:
            assert block is not None  # the window hands a block whenever pages were loaded: not user input
            out[:, : loaded * p].view(heads, loaded, p, d).copy_(block[:loaded, row].transpose(0, 1))
        for page in slot.pages[loaded:]:
            assert page.fresh is not None  # pages past the loaded ones are still on the device
            out[:, page.index * p : (page.index + 1) * p].copy_(page.fresh[row])
        if rest:
            assert slot.tail is not None
            out[:, full * p : slot.length].copy_(slot.tail[row, :, :rest])


def crc_of(t: torch.Tensor, crc: int = 0) -> int:
    """CRC-32 of a CPU tensor's bytes (made contiguous first), continuing ``crc``."""
    flat: Any = t.detach().contiguous().view(torch.uint8).reshape(-1).numpy()
    return zlib.crc32(flat.data, crc)


class ParallelCrc:
    """``crc_of`` each tensor, in parallel (zlib releases the GIL): a swapped sequence is gigabytes. The threads
    start at the first call of more than one tensor."""

    def __init__(self) -> None:
        self._pool: ThreadPool | None = None

    def __call__(self, tensors: list[torch.Tensor]) -> list[int]:
        if len(tensors) < 2:
            return [crc_of(t) for t in tensors]
        if self._pool is None:
            self._pool = ThreadPool(min(8, os.cpu_count() or 1), thread_name_prefix="tiered-kv-crc")
        return list(self._pool.map(crc_of, tensors))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


def for_cache_user(error: BaseException) -> BaseException:
    """``error``, or where it is the store's ``IntegrityError`` for a page, a new one with the cache's fix
    (``page_integrity_error``)."""
    seq = page_seq(error.key) if type(error) is IntegrityError else None
    return error if seq is None else page_integrity_error(error, seq)  # type: ignore[arg-type]


def page_integrity_error(error: IntegrityError, seq: int) -> IntegrityError:
    """The store's ``error`` for a page of sequence ``seq``, with the cache's fix: the store's (restore the file, or
    ``store.delete`` the record) is not one a cache user can apply (the store is the cache's own) nor should (a
    sequence with a page gone has a hole). Raise it from ``error``."""
    fix = (f"The cache cannot rebuild sequence {seq} from it: cache.free({seq}) and recompute the sequence (run its "
           "prompt and the tokens generated so far again)")  # fmt: skip
    return IntegrityError(error.key, error.path, error.what, fix)
