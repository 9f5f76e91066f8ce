"""A sequence's pages in one layer, between the window (a device buffer) and the store (host / NVMe records).

``Slot``: one (sequence, layer): ``length`` tokens held, the first ``synced`` of them also in the store as pages,
and, when the layer is in the window, ``buf``: ``(capacity_pages, 2, kv_heads, page_tokens, head_dim)`` on the
device, each ``buf[i]`` laid out as page record ``i``. So a page moves between the tiers as one contiguous copy,
and a token is appended in place. ``gather`` turns the buffer into the ``(heads, tokens, head_dim)`` keys and
values attention takes, in one copy each (the copy ``DynamicCache``'s ``torch.cat`` makes every step anyway).

``PageIO`` moves a slot's tokens: ``write`` the tokens not yet in the store (the last page is changed in place, a
new page is a new record, so nothing already written is written again), ``read`` every page into a new buffer.
Both run on the cache's mover thread (mover.py). A checksum over the valid bytes, in page order (each page's keys
then values), can be taken along the way, so a swapped sequence is checked when it comes back.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterable

import torch

from io_engine import pool_bytes

from ..store import TieredStore
from .layout import KVLayout, page_key

__all__ = ["Slot", "PageIO", "digest_buffer", "append", "gather"]

_READ_AHEAD = 16  # pages pinned (their copies in flight) at once, at most


class Slot:
    __slots__ = ("length", "synced", "buf")

    def __init__(self) -> None:
        self.length = 0
        self.synced = 0
        self.buf: torch.Tensor | None = None


def new_buffer(layout: KVLayout, pages: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty((pages, *layout.page_shape()), dtype=dtype, device=device)


def append(buf: torch.Tensor, at: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write ``k``, ``v`` (``(heads, q, head_dim)``) at token ``at`` onwards: one copy each per page touched."""
    p, q, done = buf.shape[3], k.shape[1], 0
    while done < q:
        page, off = divmod(at + done, p)
        n = min(q - done, p - off)
        buf[page, 0, :, off : off + n].copy_(k[:, done : done + n])
        buf[page, 1, :, off : off + n].copy_(v[:, done : done + n])
        done += n


def gather(buf: torch.Tensor, length: int, out_k: torch.Tensor, out_v: torch.Tensor) -> None:
    """The first ``length`` tokens into ``out_k``, ``out_v`` (``(heads, length, head_dim)``, contiguous)."""
    p, heads, d = buf.shape[3], buf.shape[2], buf.shape[4]
    full, rest = divmod(length, p)
    for row, out in ((0, out_k), (1, out_v)):
        if full:  # every full page in one strided copy
            out[:, : full * p].view(heads, full, p, d).copy_(buf[:full, row].transpose(0, 1))
        if rest:
            out[:, full * p :].copy_(buf[full, row, :, :rest])


def _crc(crc: int, t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().contiguous().cpu().view(torch.uint8).numpy().data, crc)


def digest_buffer(layout: KVLayout, buf: torch.Tensor, length: int) -> int:
    """The checksum of a slot's first ``length`` tokens, from its window buffer (the order ``read`` uses)."""
    crc, p = 0, layout.page_tokens
    for i in range(layout.pages(length)):
        n = min(p, length - i * p)
        crc = _crc(_crc(crc, buf[i, 0, :, :n]), buf[i, 1, :, :n])
    return crc


class PageIO:
    def __init__(self, store: TieredStore, layout: KVLayout, dtype: torch.dtype, device: torch.device) -> None:
        self.store, self.layout, self.dtype, self.device = store, layout, dtype, device
        # Pages pinned at once while their copies run: half the store's streaming reserve, so that a read never
        # waits for room that only this read's own pins hold (at least one page).
        page = pool_bytes([2 * layout.kv_heads * layout.page_tokens * layout.head_dim * dtype.itemsize])
        self.group = max(1, min(_READ_AHEAD, store.stream_reserve // page // 2))
        self.token_bytes = layout.token_bytes(dtype.itemsize)
        self.bytes_read = 0  # store -> window
        self.bytes_written = 0  # window -> store

    def write(self, seq: int, layer: int, buf: torch.Tensor, lo: int, hi: int) -> None:
        """Tokens ``[lo, hi)`` of the slot, from its buffer into its pages; pages before ``lo`` exist."""
        p, store = self.layout.page_tokens, self.store
        for first in range(lo // p * p, hi, p):
            a, b, i = max(lo, first) - first, min(hi, first + p) - first, first // p
            key = page_key(seq, layer, i)
            if first < lo:  # the page holds earlier tokens: fill it in place
                with store.pin(key, tier="host") as t:
                    t[:, :, a:b].copy_(buf[i, :, :, a:b])
                    store.mark_dirty(key)
            else:
                page = torch.zeros(self.layout.page_shape(), dtype=self.dtype)
                page[:, :, :b].copy_(buf[i, :, :, :b])
                store.put(key, page)
            if b == p:  # full: done with it. A partial last page stays in host memory while the policy lets it,
                store.retire(key)  # since the next token writes it again: a trip to NVMe and back each token
            self.bytes_written += (b - a) * self.token_bytes

    def read(self, seq: int, layer: int, length: int, pages: int, *, load: bool = True,
             digest: bool = False) -> tuple[torch.Tensor | None, int]:  # fmt: skip
        """A new buffer of ``pages`` pages holding the slot's ``length`` tokens, and their checksum if asked.
        ``load=False`` only checks (no buffer). The copies land before a page leaves its pin."""
        lay, p = self.layout, self.layout.page_tokens
        buf = new_buffer(lay, pages, self.dtype, self.device) if load else None
        keys = [page_key(seq, layer, i) for i in range(lay.pages(length))]
        crc, cuda = 0, self.device.type == "cuda"
        g = self.group
        for start in range(0, len(keys), g):
            group = keys[start : start + g]
            self._prefetch(keys[start + g : start + 2 * g])
            with contextlib.ExitStack() as pins:
                for i, key in enumerate(group, start):
                    t = pins.enter_context(self.store.pin(key, tier="host"))
                    if digest:
                        n = min(p, length - i * p)
                        crc = _crc(_crc(crc, t[0, :, :n]), t[1, :, :n])
                    if buf is not None:
                        buf[i].copy_(t, non_blocking=cuda)  # one contiguous copy a page
                if cuda:  # the copies read the pinned pages: they must land before the pins end
                    torch.cuda.current_stream(self.device).synchronize()
            for key in group:
                if key != keys[-1] or length % p == 0:  # the partial last page: see write()
                    self.store.retire(key)
        if load:
            self.bytes_read += length * self.token_bytes
        return buf, crc

    def delete(self, seq: int, layer: int, synced: int) -> None:
        for i in range(self.layout.pages(synced)):
            with contextlib.suppress(KeyError):
                self.store.delete(page_key(seq, layer, i))

    def _prefetch(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        if keys:
            self.store.prefetch(keys)
