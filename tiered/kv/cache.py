"""TieredCache: a transformers ``Cache`` whose keys and values live in a TieredStore's tiers.

Where the bytes are. Each (sequence, layer) is a ``Slot`` (pages.py). The *window* (window.py) is the device
memory under ``gpu_budget``: the first ``resident`` layers keep their buffers there from one forward pass to the
next, and the other layers stream through two more layers' worth of room: the layer in use and the next one,
which the mover (mover.py) loads while the current one computes, as ``OffloadedCache`` does. After a streaming
layer's update only its new tokens are written to its pages, and its buffers are dropped. The pages are store
records (layout.py): pinned host memory under ``host_budget`` (the store's "scan" policy keeps the first pages
written there for good and streams the rest), the rest files on NVMe through io_engine, checksummed. A forward
pass in which every layer fits the window moves nothing. The resident count is decided again at the start of
each pass, from the lengths: as a context grows, layers leave the window, and their tokens are written once.

Sequences. ``seq`` is an int id. A fresh cache handed a batch of B rows makes sequences 0..B-1 (the batch rows,
as ``generate`` uses them). ``select(seqs)`` says which sequences the next forward's rows are, in order (new ids
start empty), so a scheduler can run any subset; without it the rows are every sequence not swapped out, in id
order. The rows of one forward must hold equally long sequences (``generate``'s left padding makes them so).
``swap_out(seq)`` writes the sequence's tokens to its pages, checksums them and frees its window buffers;
``swap_in(seq)`` reads every page back, checks the checksum (``SwapIntegrityError``, an ``IntegrityError``, if
it differs) and reloads the resident layers. Between the two the sequence may not be selected.

Lifecycle. The store works in a private folder under ``nvme_path`` (workdir.py, as the optimizer's); ``close()``
deletes the records, closes the store and removes the folder; a cache left open is closed at exit.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterable
from typing import Any

import torch
from transformers.cache_utils import Cache

from io_engine import IOConfig
from io_engine.shutdown import close_at_exit, forget

from ..store import TieredStore
from ..store.records import IntegrityError
from ..store.workdir import default_root, folder_tag, make_workdir, remove_workdir
from .layer import TieredLayer
from .layout import KVLayout, check_budget, layout_from_config
from .pages import Slot, append, digest_buffer, gather
from .window import Window

__all__ = ["TieredCache", "SwapIntegrityError"]


class SwapIntegrityError(IntegrityError):
    """A swapped-out sequence's keys and values read back differ from what ``swap_out`` checksummed."""

    def __init__(self, seq: int, layer: int, message: str, path: str) -> None:
        self.message, self.seq, self.layer, self.key, self.path = message, seq, layer, f"sequence {seq}", path
        OSError.__init__(self, errno.EIO, message, path)


class TieredCache(Cache):
    """A transformers ``Cache`` on GPU / pinned host / NVMe tiers. See the module docstring.

    ``config``: the model's config (``model.config``). ``nvme_path``: root of the NVMe tier (a private folder is
    made under it; default ``$TIERED_NVME_PATH`` or the temp folder). ``host_budget``: pinned host bytes for
    pages. ``gpu_budget``: window bytes on the device (None: no limit, every layer stays). ``page_tokens``:
    tokens a page. ``io``: an ``IOConfig`` or engine for the store. ``verify``: checksum NVMe records.
    """

    def __init__(self, config: Any, nvme_path: str | os.PathLike[str] | None = None, *,
                 host_budget: int | str = "1GiB", gpu_budget: int | str | None = None, page_tokens: int = 256,
                 io: IOConfig | Any | None = None, verify: bool = True) -> None:  # fmt: skip
        self.layout: KVLayout = layout_from_config(config, page_tokens)
        self.gpu_budget = check_budget(gpu_budget, "gpu_budget")
        if nvme_path is not None and not isinstance(nvme_path, (str, os.PathLike)):
            raise TypeError(f"nvme_path must be a folder path (str or os.PathLike), got {type(nvme_path).__name__}")
        root = default_root() if nvme_path is None else os.path.abspath(os.fspath(nvme_path))
        super().__init__(layers=[TieredLayer(self, i) for i in range(self.layout.layers)])
        self._closed = True  # until the store is open: close() on a half-built cache is harmless
        self.workdir = make_workdir(root, folder_tag())
        try:
            self._store = TieredStore(self.workdir, host_budget=host_budget, policy="scan", io=io, verify=verify)
        except BaseException:
            remove_workdir(self.workdir)
            raise
        self._slots: dict[int, list[Slot]] = {}
        self._swapped: dict[int, list[int]] = {}  # seq -> checksum of each layer's tokens at swap_out
        self._selected: list[int] | None = None
        self._win = Window(self._store, self.layout, self.gpu_budget, self._slots)
        self._swaps = {"out": 0, "in": 0}
        self._closed = False
        close_at_exit(self, early=True)  # before its store's own exit close: closing deletes the records

    # ------------------------------------------------------------------------------------------ public
    @property
    def sequences(self) -> list[int]:
        """Every sequence id, swapped out or not."""
        return sorted(self._slots)

    def seq_length(self, seq: int) -> int:
        return self._slots[self._known(seq)][0].length

    def select(self, seqs: Iterable[int] | None) -> None:
        """The sequences the next forward's batch rows are, in order; new ids start empty. None: every
        sequence not swapped out, in id order."""
        self._check_open()
        self._win.settle()
        if seqs is None:
            self._selected = None
            return
        seqs = list(seqs)
        for s in seqs:
            if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                raise ValueError(f"select: sequence ids are ints >= 0, got {s!r}")
            if s in self._swapped:
                raise ValueError(f"select: sequence {s} is swapped out; swap_in({s}) first")
        if len(set(seqs)) != len(seqs) or not seqs:
            raise ValueError(f"select: give each sequence once, at least one, got {seqs}")
        for s in seqs:
            self._slots.setdefault(s, [Slot() for _ in range(self.layout.layers)])
        self._selected = seqs

    def swap_out(self, seq: int) -> None:
        """Move sequence ``seq``'s keys and values to host memory / NVMe and free its window buffers."""
        self._check_open()
        self._known(seq)
        if seq in self._swapped:
            raise ValueError(f"swap_out({seq}): sequence {seq} is already swapped out")
        self._win.settle()
        slots, crcs = self._slots[seq], []
        for layer, slot in enumerate(slots):
            if slot.length == 0:  # an id selected but never run: nothing to move
                crcs.append(0)
                slot.buf = None
            elif slot.buf is not None:
                buf, lo = slot.buf, slot.synced
                slot.synced = slot.length
                mover = self._win.mover  # the write waits for the appends queued on the caller's stream
                mover.submit(self._win.pio.write, seq, layer, buf, lo, slot.length, after=mover.event()).result()
                crcs.append(digest_buffer(self.layout, buf, slot.length))
                slot.buf = None
            else:
                crcs.append(self._win.call(self._win.pio.read, seq, layer, slot.length, 0, load=False, digest=True)[1])
        self._swapped[seq] = crcs
        if self._selected is not None and seq in self._selected:
            self._selected = [s for s in self._selected if s != seq] or None
        self._swaps["out"] += 1

    def swap_in(self, seq: int) -> None:
        """Bring sequence ``seq`` back, bit-exactly (checked), and reload its resident layers into the window.
        It is not added to a ``select``ed batch: select it again."""
        self._check_open()
        self._known(seq)
        if seq not in self._swapped:
            raise ValueError(f"swap_in({seq}): sequence {seq} is not swapped out")
        self._win.settle()
        crcs = self._swapped[seq]
        for layer, slot in enumerate(self._slots[seq]):
            if slot.length == 0:
                continue
            load = layer < self._win.resident
            pages = self.layout.pages(slot.length) + 1
            buf, crc = self._win.call(self._win.pio.read, seq, layer, slot.length, pages, load=load, digest=True)
            if crc != crcs[layer]:
                msg = (f"swap_in({seq}): layer {layer}'s keys and values read back differ from what swap_out wrote "
                       f"(crc {crc:#010x}, expected {crcs[layer]:#010x}) under {self.workdir}; the sequence stays "
                       "swapped out: free() it and recompute it")  # fmt: skip
                raise SwapIntegrityError(seq, layer, msg, self.workdir)
            if load:
                self._win.mover.handed_over(buf)
                slot.buf = buf
        del self._swapped[seq]
        self._swaps["in"] += 1

    def is_swapped(self, seq: int) -> bool:
        return self._known(seq) in self._swapped

    def free(self, seq: int) -> None:
        """Forget sequence ``seq``: its buffers and pages go."""
        self._check_open()
        self._known(seq)
        self._win.settle()
        for layer, slot in enumerate(self._slots.pop(seq)):
            if slot.synced:
                self._win.pio.delete(seq, layer, slot.synced)
        self._swapped.pop(seq, None)
        if self._selected is not None:
            self._selected = [s for s in self._selected if s != seq] or None

    def stats(self) -> dict[str, Any]:
        """What moved where: window bytes now and at peak, bytes loaded into and written out of the window, the
        resident layer count, swaps, slot loads (``prefetched``: started while the layer before computed;
        ``waited``: loaded when needed), and the store's own counters (host hits, NVMe bytes). Waits for the
        write-backs in flight, so the figures are whole."""
        if not self._closed:
            self._win.check(wait=True)
        win = self._win
        pio = win.pio if win.started else None
        return {"window_bytes": win.bytes_held(), "window_peak": win.peak, "resident": win.resident,
                "loaded_bytes": pio.bytes_read if pio else 0, "written_bytes": pio.bytes_written if pio else 0,
                "swaps": dict(self._swaps), "loads": dict(win.loads_count),
                "store": self._store.stats() if not self._closed else {}}  # fmt: skip

    def reset(self) -> None:
        """Forget every sequence (as ``DynamicCache.reset``), keeping the store open."""
        self._check_open()
        self._win.settle()
        for seq in list(self._slots):
            self.free(seq)
        self._selected = None

    def close(self) -> None:
        """Delete every page, close the store and remove the private folder. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            with contextlib.suppress(BaseException):
                self._win.settle()
            self._win.close()
            for key in self._store.keys():
                with contextlib.suppress(KeyError, ValueError):
                    self._store.delete(key)
            self._slots.clear()
            self._store.close()
        finally:
            remove_workdir(self.workdir)
            forget(self)

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._slots)} sequences, {self._win.resident} resident layers"
        return f"TieredCache({self.workdir!r}, {state})"

    # ------------------------------------------------------------------------------- transformers hooks
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._layer_length(layer_idx) if 0 <= layer_idx < len(self.layers) else 0

    def _layer_length(self, layer: int) -> int:
        rows = self._rows()
        return self._slots[rows[0]][layer].length if rows and rows[0] in self._slots else 0

    def _rows(self) -> list[int]:
        if self._selected is not None:
            return self._selected
        return [s for s in sorted(self._slots) if s not in self._swapped]

    def _update_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_open()
        if layer == 0:
            self._begin_pass(k)
        win = self._win
        if k.shape[0] != len(win.batch):
            raise ValueError(f"layer {layer} got {k.shape[0]} rows, layer 0 got {len(win.batch)}")
        q, lay = k.shape[2], self.layout
        if k.shape[1] != lay.kv_heads or k.shape[3] != lay.head_dim or v.shape != k.shape:
            raise ValueError(f"key/value states of shape {tuple(k.shape)}/{tuple(v.shape)} do not match the config's "
                             f"(batch, {lay.kv_heads} kv heads, tokens, {lay.head_dim}): build the cache from "
                             "this model's config")  # fmt: skip
        win.install(layer)
        if layer + 1 < lay.layers or win.resident < lay.layers:
            win.prefetch((layer + 1) % lay.layers)
        length = self._slots[win.batch[0]][layer].length + q
        # Contiguous (batch, heads, tokens, head_dim) tensors, laid out as DynamicCache's: attention kernels pick
        # their path by strides too, and a different path can round differently.
        keys = torch.empty((len(win.batch), lay.kv_heads, length, lay.head_dim), dtype=k.dtype, device=k.device)
        values = torch.empty_like(keys)
        for row, seq in enumerate(win.batch):
            slot = self._slots[seq][layer]
            if slot.buf is None or length > slot.buf.shape[0] * lay.page_tokens:
                win.grow(slot, length, k)
            assert slot.buf is not None  # grow made it: not user input
            append(slot.buf, slot.length, k[row], v[row])
            slot.length = length
            gather(slot.buf, length, keys[row], values[row])
        if layer == lay.layers - 1:  # sampled once a pass: resident layers plus one streaming (a sum over slots)
            win.peak = max(win.peak, win.bytes_held())
        if layer >= win.resident:
            win.write_back(layer)
        return keys, values

    # ------------------------------------------------------------------------------------------ helpers
    def _begin_pass(self, k: torch.Tensor) -> None:
        win = self._win
        win.check()
        win.start(k)
        if not self._slots and self._selected is None:
            for s in range(k.shape[0]):
                self._slots[s] = [Slot() for _ in range(self.layout.layers)]
        rows = self._rows()
        if len(rows) != k.shape[0]:
            raise ValueError(f"the forward has {k.shape[0]} batch rows but the cache's batch is sequences {rows}: "
                             "call cache.select([...]) with one sequence id per row")  # fmt: skip
        lengths = {s: self._slots[s][0].length for s in rows}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"the rows of one forward must hold equally long sequences, got lengths {lengths}: "
                             "select sequences of one length, or pad as generate does")  # fmt: skip
        win.batch = list(rows)
        win.plan([s for s in self._slots if s not in self._swapped], k.shape[2])

    def _known(self, seq: Any) -> int:
        if isinstance(seq, bool) or not isinstance(seq, int) or seq not in self._slots:
            raise ValueError(f"no sequence {seq!r} in this cache (sequences: {sorted(self._slots)}); a sequence "
                             "id is a batch row of the first forward, or an id given to select()")  # fmt: skip
        return seq

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this TieredCache ({self.workdir}) is closed; make a new one")
