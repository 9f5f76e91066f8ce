"""TieredCache: a transformers ``Cache`` whose keys and values live in a TieredStore's tiers.

Where the bytes are. Each (sequence, layer) is a ``Slot`` (pages.py): full pages of ``page_tokens`` tokens, each a
store record once written, and the partial last page (the *tail*) on the device. The store keeps pages in pinned
host memory under ``host_budget`` (its "scan" policy keeps the first pages written there for good and streams the
rest) and the rest in files on NVMe through io_engine, checksummed. The *window* (window.py) is the device memory
under ``gpu_budget``: the tails, a ring of blocks the streaming layers' pages pass through (each layer loaded
``prefetch`` layers ahead on a side stream, as ``OffloadedCache`` does), and the blocks of the first ``resident``
layers, which keep their pages from one forward pass to the next. Decoding a token writes nothing but the token
into the tails; a page that fills is written once. A forward pass in which every layer fits the window loads
nothing. The resident count is decided again at the start of each pass, from the lengths.

What attention sees. Each layer's update returns new contiguous ``(batch, kv_heads, length, head_dim)`` keys and
values in the model's dtype, as ``DynamicCache``'s ``torch.cat`` does, holding the same bytes: the kernels the
model picks (they choose by shape, dtype and strides) and so the logits are those of ``DynamicCache``.

Sequences. ``seq`` is an int id. A fresh cache handed a batch of B rows makes sequences 0..B-1 (the batch rows,
as ``generate`` uses them). ``select(seqs)`` says which sequences the next forward's rows are, in order (new ids
start empty), so a scheduler can run any subset; without it the rows are every sequence not swapped out, in id
order. The rows of one forward must hold equally long sequences (``generate``'s left padding makes them so).
``swap_out(seq)`` stores the sequence's tails (the full pages are stored already), takes a checksum of its pages
in host memory and frees its device memory; ``swap_in(seq)`` checks them (``SwapIntegrityError``, an
``IntegrityError``, if they differ; pages on NVMe are checked by the store as they are read) and brings the tails
back. Between the two the sequence may not be selected. A Ctrl-C during a swap or a ``free`` leaves the sequence as
it was or as the call makes it, never between (swap.py).

A forward that raises part-way (a page's load fails at layer k) is taken back (passes.py, undo.py): the tokens it
appended to layers 0..k-1 go, so that once the cause is fixed it runs again exactly. One that raises in the model,
out of the cache's sight, before its last layer's update, is taken back by the next forward, which then raises and
asks to be run again. One that raises after it (lm_head) ran whole and keeps its tokens, as DynamicCache: a forward
run again cannot be told from the next token (the model takes its positions from our length), so the user frees it.

``prefetch``: layers loaded ahead (default 2); 0 is the serial twin: each layer's pages loaded when it is needed
and each page written when it fills, in the caller's thread and stream. Both give the same bytes.

Lifecycle. The store works in a private folder under ``nvme_path`` (workdir.py, as the optimizer's); ``close()``
deletes the records, closes the store and removes the folder (release.py). A cache dropped without ``close()``, as
a ``DynamicCache`` is, is closed when it is collected (its finalizer holds what it releases, never the cache; its
layers refer to it weakly, so dropping it is enough), and one left open is closed at exit. A process forked
after the cache was made releases none of it (store/owner.py): its exit, collection or ``close()`` leave the
pages, threads and folder to the parent, and every other call on its copy raises at once (its lock's refusal).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from transformers.cache_utils import Cache

from io_engine import IOConfig
from io_engine.shutdown import close_at_exit, forget

from ..arguments import folder_path
from ..interrupts import deferred_sigint
from ..store import TieredStore
from ..store.owner import OwnedFinalizer, OwnedLock
from ..store.workdir import default_root, folder_tag, make_workdir, remove_workdir
from .layer import TieredLayer
from .layout import KVLayout, check_budgets, check_page_room, layout_from_config, stream_reserve
from .locking import CLOSE_WAIT_S, locked
from .pages import Slot, append, for_cache_user, gather
from .passes import ForwardPasses
from .release import release
from .swap import SwapIntegrityError, Swapper
from .undo import PassUndo
from .window import Window

__all__ = ["TieredCache", "SwapIntegrityError"]


class TieredCache(Cache):
    """A transformers ``Cache`` on GPU / pinned host / NVMe tiers. See the module docstring.

    ``config``: the model's config (``model.config``). ``nvme_path``: root of the NVMe tier (a private folder is
    made under it; default ``$TIERED_NVME_PATH`` or ``<tempdir>/tiered``). ``host_budget``: pinned host bytes for
    pages. ``gpu_budget``: window bytes on the device (None: no limit, every layer stays). ``page_tokens``:
    tokens a page. ``prefetch``: layers loaded ahead (0: the serial twin). ``io``: an ``IOConfig`` or engine for
    the store. ``verify``: checksum NVMe records and swapped sequences.
    """

    def __init__(self, config: Any, nvme_path: str | os.PathLike[str] | None = None, *,
                 host_budget: int | str = "1GiB", gpu_budget: int | str | None = None, page_tokens: int = 256,
                 prefetch: int = 2, io: IOConfig | Any | None = None, verify: bool = True) -> None:  # fmt: skip
        # See locking.py; first, so that a close() of a half-built cache can take it. In a forked child every call
        # that takes it (a forward's layer updates too) refuses at once: the pages and threads are the parent's.
        self._lock = OwnedLock("TieredCache")
        self.layout: KVLayout = layout_from_config(config, page_tokens)
        self.gpu_budget, self._host_bytes = check_budgets(gpu_budget, host_budget)
        check_page_room(self.layout, self._host_bytes, 2)  # the narrowest keys and values (bf16): checked again
        self._page_room_checked = False  # at the first forward, in the dtype they come in
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0 (layers loaded ahead; 0 loads each when needed), "
                             f"got {prefetch!r}")  # fmt: skip
        root = default_root() if nvme_path is None else folder_path(nvme_path, "nvme_path", "/mnt/nvme")
        super().__init__(layers=[TieredLayer(self, i) for i in range(self.layout.layers)])
        self._closed = True  # until the store is open: close() on a half-built cache is harmless
        self.workdir, lock = make_workdir(root, folder_tag())  # locked until removed (store/workdir.py)
        try:
            reserve = stream_reserve(self.layout, self._host_bytes)  # room the streamed pages always have
            self._store = TieredStore(self.workdir, host_budget=host_budget, policy="scan", io=io, verify=verify,
                                      stream_reserve=reserve, folder_lock=lock)  # fmt: skip
        except BaseException:
            remove_workdir(self.workdir, lock)
            raise
        self.verify = verify
        self._slots: dict[int, list[Slot]] = {}
        self._swapped: set[int] = set()
        self._selected: list[int] | None = None
        self._win = Window(self._store, self.layout, self.gpu_budget, self._slots, prefetch)
        self._swap = Swapper(self._store, self.layout, verify, self.workdir)
        self._passes = ForwardPasses(self._store, self.layout, self._win, self._slots)  # the pass under way (passes.py)
        self._warned_grad = False
        self._closed = False
        # Releases only in this process: a forked child's exit, collection or close() must not delete the live
        # pages and folder nor wait for threads it does not have (store/owner.py).
        self._finalizer = OwnedFinalizer(self, release, self._store, self._win, self._slots, self._swap, lock)
        close_at_exit(self, early=True)  # before its store's own exit close: closing deletes the records

    # ------------------------------------------------------------------------------------------ public
    @property
    def sequences(self) -> list[int]:
        """Every sequence id, swapped out or not."""
        return sorted(self._slots)

    @property
    def prefetch_layers(self) -> int:
        """Layers loaded ahead (the ``prefetch`` argument; 0: the serial twin). Not ``prefetch``: transformers'
        ``Cache.prefetch(layer_idx)`` is the offloading hook of its own caches."""
        return self._win.prefetch

    def seq_length(self, seq: int) -> int:
        return self._slots[self._known(seq)][0].length

    @locked
    def select(self, seqs: Iterable[int] | None) -> None:
        """The sequences the next forward's batch rows are, in order; new ids start empty. None: every
        sequence not swapped out, in id order."""
        self._check_open()
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
        self._selected = seqs  # a new id becomes a sequence at the forward that runs it (one refused leaves none)

    @locked
    def swap_out(self, seq: int) -> None:
        """Move sequence ``seq``'s keys and values to host memory / NVMe and free its device memory. All or nothing:
        a store that fails part-way leaves the sequence as it was, on the device."""
        self._check_open()
        self._known(seq)
        if seq in self._swapped:
            raise ValueError(f"swap_out({seq}): sequence {seq} is already swapped out")
        self._check_between_passes(seq, "swap_out")
        t0 = time.perf_counter()
        self._win.settle()
        with self._swap.out(seq, self._slots[seq]) as written:  # whole, a Ctrl-C held (swap.py)
            self._win.moved["written_bytes"] += written
            self._swapped.add(seq)
            self._passes.swapped(seq)  # its tails stored and checksummed: the forward before leaves it
            self._unselect(seq)
            self._swap.counts["out_s"] += time.perf_counter() - t0
            self._idle()

    @locked
    def swap_in(self, seq: int) -> None:
        """Bring sequence ``seq`` back, bit-exactly (checked). It is not added to a ``select``ed batch: select it
        again. Its resident layers are loaded by the next forward that runs it."""
        self._check_open()
        self._known(seq)
        if seq not in self._swapped:
            raise ValueError(f"swap_in({seq}): sequence {seq} is not swapped out")
        t0 = time.perf_counter()
        self._win.settle()
        with self._swap.back(seq, self._slots[seq], self._win.device):  # whole, a Ctrl-C held (swap.py)
            self._swapped.discard(seq)
            self._swap.counts["in_s"] += time.perf_counter() - t0

    def is_swapped(self, seq: int) -> bool:
        return self._known(seq) in self._swapped

    @locked
    def free(self, seq: int) -> None:
        """Forget sequence ``seq``: its device memory and pages go. Also during a forward pass that raised part-way
        (the way to recompute it); a forward still running over it then stops with an error naming it."""
        self._check_open()
        self._known(seq)
        self._win.settle(check=False)  # an earlier write's failure is the next forward's to raise, if still due
        with deferred_sigint():  # whole, or not at all; its records deleted after (swap.py)
            slots = self._slots.pop(seq)
            self._win.writes.forget([p for slot in slots for p in slot.pages])
            self._swap.forget(seq, slots)
            self._passes.unsaid.discard(seq)  # a new sequence under its id: no pass of it stopped short
            self._swapped.discard(seq)
            self._unselect(seq)
            self._idle()
        self._swap.pay()

    @locked
    def stats(self) -> dict[str, Any]:
        """What moved where: window bytes now and at peak, bytes loaded into the window from host memory and
        written out of it, copy calls and host synchronizations of the loads, the resident layer count, swaps (counts,
        and the seconds spent in ``swap_out``, ``swap_in`` and, within them, checksums),
        slot loads (``prefetched``: issued while earlier layers computed; ``waited``: issued when needed), and the
        store's own counters (host hits, NVMe bytes). Waits for the writes in flight, so the figures are whole;
        a write that failed stays the next forward's error (a monitoring thread must not take it)."""
        if not self._closed:
            self._win.settle_writes(wait=True, check=False)
        return {**self._win.stats(), "swaps": dict(self._swap.counts),
                "store": self._store.stats() if not self._closed else {}}  # fmt: skip

    @locked
    def reset(self) -> None:
        """Forget every sequence (as ``DynamicCache.reset``), keeping the store open."""
        self._check_open()
        for seq in list(self._slots):
            self.free(seq)
        self._selected = None

    def close(self) -> None:
        """Delete every page, close the store and remove the private folder. Idempotent. From another thread during
        a forward: after the layer being updated, and the forward then stops with "closed". In a process forked
        after the cache was made, this copy only reads closed: the pages, threads and folder are the parent's."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None and not finalizer.here:  # without the lock: a parent's thread may have held it
            self._closed = True
            finalizer()
            return
        # Bounded: a layer update takes milliseconds, but a thread stuck in one (a daemon thread at exit) must not
        # keep the program from ending.
        locked = self._lock.acquire(timeout=CLOSE_WAIT_S)
        try:
            self._close()
        finally:
            if locked:
                self._lock.release()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._finalizer()
        finally:
            forget(self)

    def __getstate__(self) -> dict[str, Any]:  # deepcopy, copy, pickle and torch.save all come here
        raise TypeError("a TieredCache cannot be pickled or deep-copied: it owns a store folder, pinned pages and a "
                        "thread. To reuse a prompt's keys and values for several continuations, run each in its own "
                        "sequence (select) or recompute the prompt; to save generate's outputs, drop the cache "
                        "from them first (out['past_key_values'] = None)")  # fmt: skip

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._slots)} sequences, {self._win.resident} resident layers"
        return f"TieredCache({self.workdir!r}, {state})"

    # ------------------------------------------------------------------------------- transformers hooks
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        if not 0 <= layer_idx < len(self.layers):  # transformers' own update: a bare IndexError
            self._refuse_layer(layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @locked
    def _refuse_layer(self, layer: int) -> None:
        refused = (f"the model updated layer {layer}, but this TieredCache was built from a config of "
                   f"{len(self.layers)} layers (config.num_hidden_layers): build it from this model's config, "
                   "TieredCache(model.config, ...)")  # fmt: skip
        raise self._passes.beyond(refused, self._closed)  # layers 0..n-1 stored its tokens: a retry would add them

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._layer_length(layer_idx) if 0 <= layer_idx < len(self.layers) else 0

    def _layer_length(self, layer: int) -> int:
        rows = self._rows()
        return self._slots[rows[0]][layer].length if rows and rows[0] in self._slots else 0

    def _rows(self) -> list[int]:
        if self._selected is not None:
            return self._selected
        return [s for s in sorted(self._slots) if s not in self._swapped]

    @locked
    def _update_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_open()
        if k.requires_grad and torch.is_grad_enabled() and not self._warned_grad:
            self._warned_grad = True
            warnings.warn("TieredCache stores keys and values, not their autograd graph: no gradient flows through "
                          "the cache into k_proj / v_proj. It is for inference: run the model under torch.no_grad() "
                          "(generate does)", UserWarning, stacklevel=4)  # fmt: skip
        # Not grad, and not inference mode either: the cache's tensors outlive this call and are written in place
        # by later ones, which inference tensors refuse outside inference mode (a prefill under
        # torch.inference_mode(), then generate() under no_grad).
        with torch.inference_mode(False), torch.no_grad():
            try:
                return self._update_layer_now(layer, k, v)
            except BaseException as e:
                error = for_cache_user(e)  # a damaged page file: the fix is the cache's, not the store's
                self._passes.take_back_after(error, self._closed, layer)
                if error is e:
                    raise
                raise error from e

    def _update_layer_now(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lay = self.layout
        if k.dim() != 4 or k.shape[1] != lay.kv_heads or k.shape[3] != lay.head_dim or v.shape != k.shape:
            raise ValueError(f"key/value states of shape {tuple(k.shape)}/{tuple(v.shape)} do not match the config's "
                             f"(batch, {lay.kv_heads} kv heads, tokens, {lay.head_dim}): build the cache from this "
                             "model's config; a model whose attention keeps keys and values of other shapes (multi-"
                             "head latent attention) needs DynamicCache")  # fmt: skip
        passes = self._passes
        if layer == 0:
            if passes.at is not None:
                passes.broken_off(set(self._rows()), self._closed)
            self._begin_pass(k)
        elif passes.at != layer:
            raise ValueError(f"layer {layer} updated, but this forward pass is at layer {passes.at} (a pass "
                             "starts at layer 0 and updates each layer once, in order)")  # fmt: skip
        win = self._win
        gone = [s for s in win.batch if s not in self._slots]  # free(); a swap_out is refused mid-pass
        if gone:
            raise ValueError(f"sequences {gone} were freed during this forward pass, at layer {layer}: run the "
                             "forward again")  # fmt: skip
        passes.at = layer + 1  # None once whole(): till then a take-back stopped by a Ctrl-C is the next pass's
        if k.shape[0] != len(win.batch):
            raise ValueError(f"layer {layer} got {k.shape[0]} rows, layer 0 got {len(win.batch)}")
        q, lay = k.shape[2], self.layout
        blocks = win.install(layer)
        win.issue_ahead(layer)
        length = self._slots[win.batch[0]][layer].length + q
        # New contiguous (batch, heads, tokens, head_dim) tensors, as DynamicCache's torch.cat makes: attention
        # kernels pick their path by shape and strides too, and another path can round differently.
        keys = torch.empty((len(win.batch), lay.kv_heads, length, lay.head_dim), dtype=k.dtype, device=k.device)
        values = torch.empty_like(keys)
        for row, seq in enumerate(win.batch):
            slot = self._slots[seq][layer]
            new = append(slot, lay, k[row], v[row])
            if passes.undo is not None:
                passes.undo.note(slot, lay, new)
            block, loaded = blocks[row]
            gather(slot, lay, block, loaded, keys[row], values[row])
            win.filled(layer, slot, new)
        win.consumed()
        if layer == lay.layers - 1:  # sampled once a pass, at its fullest
            win.peak = max(win.peak, win.bytes_held())
            passes.whole()
        return keys, values

    # ------------------------------------------------------------------------------------------ helpers
    def _new_slots(self, seq: int) -> list[Slot]:
        return [Slot(seq, layer) for layer in range(self.layout.layers)]

    def _begin_pass(self, k: torch.Tensor) -> None:
        self._swap.pay()  # records a swap or free left to delete (swap.py): before this pass writes their keys
        if not self._page_room_checked:
            check_page_room(self.layout, self._host_bytes, k.element_size())
            self._page_room_checked = True
        win = self._win
        win.start(k)
        if not self._slots and self._selected is None:
            for s in range(k.shape[0]):
                self._slots[s] = self._new_slots(s)
        rows = self._rows()
        if not rows and self._selected is not None:
            raise ValueError("no sequence is selected: the sequences select() named were swapped out or freed; "
                             "select() the next forward's")  # fmt: skip
        if len(rows) != k.shape[0]:
            raise ValueError(f"the forward has {k.shape[0]} batch rows but the cache's batch is sequences {rows}: "
                             "call cache.select([...]) with one sequence id per row")  # fmt: skip
        lengths = {s: self._slots[s][0].length if s in self._slots else 0 for s in rows}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"the rows of one forward must hold equally long sequences, got lengths {lengths}: "
                             "select sequences of one length, or pad as generate does")  # fmt: skip
        created = {s for s in rows if s not in self._slots or self._slots[s][0].length == 0}
        for s in rows:
            if s not in self._slots:
                self._slots[s] = self._new_slots(s)
        self._passes.begin(PassUndo({s: self._slots[s][0].length for s in rows}, created))
        win.begin_pass(list(rows), [s for s in self._slots if s not in self._swapped], k.shape[2])

    def _unselect(self, seq: int) -> None:
        """``seq`` leaves a ``select``ed batch. A selection it empties stays empty, and the next forward is
        refused, rather than running on every other sequence."""
        if self._selected is not None:
            self._selected = [s for s in self._selected if s != seq]

    def _check_between_passes(self, seq: int, what: str) -> None:
        if self._passes.at is not None and seq in self._win.batch:
            raise ValueError(f"{what}({seq}): sequence {seq} is in a forward pass that has reached layer "
                             f"{self._passes.at} of {self.layout.layers}; {what} between forwards (a forward that "
                             "raised part-way in the model, not in the cache, is taken back by the next one, which "
                             f"then asks to be run again; or free({seq}) and recompute it)")  # fmt: skip

    def _idle(self) -> None:
        if all(s in self._swapped for s in self._slots):  # nothing left on the device: neither is the ring
            self._win.drop_ring()

    def _known(self, seq: Any) -> int:
        if isinstance(seq, bool) or not isinstance(seq, int) or seq not in self._slots:
            raise ValueError(f"no sequence {seq!r} in this cache (sequences: {sorted(self._slots)}); a sequence "
                             "id is a batch row of the first forward, or an id given to select()")  # fmt: skip
        return seq

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this TieredCache ({self.workdir}) is closed; make a new one")
