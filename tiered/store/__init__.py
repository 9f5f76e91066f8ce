"""TieredStore: keyed tensors in three tiers (GPU HBM, pinned host DDR, files on NVMe) under hard budgets.

Call order::

    store = TieredStore(path, host_budget="8GiB", policy="scan", io=IOConfig(...))   # locks the folder
    store.put(key, tensor)                      # copies in; the policy places it
    store.prefetch(keys)                        # async NVMe -> host, in order, while the budget allows
    with store.pin(key, tier="host") as t:      # waits only for that record's read; t is the record itself
        t.add_(1); store.mark_dirty(key)        # in-place change: say so, or it is never written
    store.retire(key)                           # done for this scan: "scan" streams it back out
    store.get(key) / store.evict(key) / store.delete(key)
    store.flush(); store.close()                # dirty records written, fsynced, index saved; then released

A store left open is closed when the main thread ends (io_engine.close_at_exit), so its dirty records are saved.

Concurrency. Any number of threads may call one store at once. One lock (``StoreState.lock``) guards the records'
states and the counters, held only for those few assignments: never across I/O, checksums, copies or pool allocation
(pinning a new block is slow). Each record has at most one movement in flight (``op``, a Future): any other request
on it first waits for that future (outside the lock) and then looks again. A ``put`` installs its (busy) record as
it takes the old one aside, idle (a put of the key meanwhile waits, then replaces it in turn, under a file name no
record set aside still holds; replace.py), and a delete keeps the record busy until its file is unlinked, so a put of
the same key waits rather than lose its new file.
``get``'s own copies are waited for by a ``put``, ``delete`` or ``evict`` of that key (``Record.reading``), and a
flush writes a file that a ``get`` reads directly once that read ends (``Record.file_reads``); a user's ``pin``
block, which only its thread can end, is refused with ``ValueError`` instead. Room held by other threads' pins is
waited for in host memory (only the caller's own pins holding it is a ``BudgetError``); in HBM it is a
``BudgetError``, and a pin holds a record in its tier against eviction, not against another thread's pin or fetch
into the other tier: with an HBM tier, pin a record from one thread at a time. A prefetch queued for room that can
no longer come is dropped (its future resolves; the record is read when used). Flushes save the index one at a time
(``StoreState.index_lock``). ``close()`` is for when the other threads are done with the store; it refuses new
calls and waits for pins and get() copies still under way (lifecycle.py), never unmapping memory in use. I/O runs on
io_engine's threads; their callbacks only hand the finishing step to the mover, a small executor that checksums
(``checksum.py``) and updates state: a read and a write-back overlap, checksums never run on the caller's thread,
and a user's future callback never blocks an I/O thread.

Layout, by composition. ``TieredStore`` (here: the public calls, flush and lifecycle) builds one ``StoreState``
(store/state.py: the lock, the records, the pool, engine, checksummer, mover, policy and the shared counters) and
hands it to the two tiers it owns: a ``HostTier`` (host_tier.py: pinned host buffers under ``host_budget``,
write-back, loading, the prefetch queue) and a ``GpuTier`` (gpu_tier.py: HBM moves and budget, and the moves through
both tiers: a pinned record into a tier, a copy-in, the flush's writes), which is also handed the ``HostTier``.
Calls point down only: store -> GpuTier -> HostTier -> StoreState. ``Record`` and the errors are in records.py, its
movements (``Move``) and their table in record_state.py; the folder's index and file names in store/index.py (its
"Links" says why nothing there is followed through a link). A failed write-back raises ``WriteBackError`` from the
call that needed room (host_tier.py); the record stays in memory, dirty.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

import torch

from io_engine import IOConfig, PooledBuffer, format_size
from io_engine.shutdown import close_at_exit, forget

from ..interrupts import deferred_sigint
from ..policy import Policy, make_policy
from .gpu_tier import GpuTier, PinBlock
from .host_tier import HostTier
from .index import StoreFolderError, prepare_folder, read_index, reclaim_leftovers, record_path, save_index
from .lifecycle import close_whole, shutdown
from .lock import FolderLock, StoreLockedError
from .record_state import Move
from .records import (
    TIERS,
    BudgetError,
    IntegrityError,
    Record,
    RecordInfo,
    Tier,
    WriteBackError,
    check_key,
    done_future,
)
from .replace import put_record
from .state import StoreState, check_arguments

__all__ = ["TieredStore", "RecordInfo", "StoreLockedError", "IntegrityError", "BudgetError", "WriteBackError",
           "StoreFolderError"]  # fmt: skip


class TieredStore:
    """Keyed tensor records in GPU / host / NVMe tiers. See the module docstring for the call order.

    ``io``: an ``IOConfig``, an engine to share (``IOEngine`` or ``SerialEngine``, not closed by the store;
    make it with ``follow_symlinks=False``, as the store makes its own) or None (``IOConfig.from_env()``).
    ``nvme_path``: a new or empty folder, or one a store used before (store/index.py's "Links" says why).
    ``policy``: "lru", "scan" or a ``tiered.policy.Policy``.
    ``stream_reserve`` (policy "scan"): host bytes kept out of the resident set for records streaming
    through (prefetched, being updated, being written back); default a quarter of ``host_budget``.
    ``folder_lock``: the folder's ``FolderLock``, already held by the caller, who keeps it: the store takes
    none of its own and leaves this one held at close (an optimizer's private folder stays locked between the
    stores it builds there, so no sibling takes it for a dead run's meanwhile). None: the store locks the folder.
    """

    def __init__(self, nvme_path: str | os.PathLike[str], *, gpu_budget: int | str = 0,
                 host_budget: int | str = "1GiB", io: IOConfig | Any | None = None,
                 policy: str | Policy = "lru", verify: bool = True, stream_reserve: int | str | None = None,
                 mover_threads: int = 4, folder_lock: FolderLock | None = None) -> None:  # fmt: skip
        path, host_bytes, gpu_bytes, reserve = check_arguments(nvme_path, gpu_budget, host_budget, io, verify,
                                                               stream_reserve, mover_threads)  # fmt: skip
        self.path, self.stream_reserve = path, reserve
        pol = make_policy(policy)
        if folder_lock is not None:
            folder_lock.check_holds(path)
        prepare_folder(path)  # refuses links and other people's files
        # Before reading the index: another process may be writing it. A lock handed in stays its holder's.
        self._flock = FolderLock(path) if folder_lock is None else None
        try:
            self._state = StoreState.open(path, host_bytes, verify, io, mover_threads, pol)  # closed until built
            self._host = HostTier(self._state)
            device = torch.device("cuda", torch.cuda.current_device()) if gpu_bytes else None
            self._gpu = GpuTier(self._state, self._host, budget=gpu_bytes, device=device)
            pol.bind(host_budget=host_bytes, stream_reserve=reserve)
            for rec in read_index(path):
                self._state.recs[rec.key] = rec
                pol.insert(rec.key, rec.footprint)
            reclaim_leftovers(path, {rec.path for rec in self._state.recs.values()})  # a killed run's, unflushed
        except BaseException:
            if self._flock is not None:
                self._flock.release()
            raise
        self._state.closed = False
        close_at_exit(self, early=True)  # before the engines: closing flushes through one

    @property  # the configuration, read from the parts that use it
    def host_budget(self) -> int:
        return self._state.host_budget

    @property
    def verify(self) -> bool:
        return self._state.verify

    @property  # gpu_budget and _device may be set: tests give a CPU-only store a stand-in HBM tier that way
    def gpu_budget(self) -> int:
        return self._gpu.budget

    @gpu_budget.setter
    def gpu_budget(self, value: int) -> None:
        self._gpu.budget = value

    @property
    def _device(self) -> torch.device | None:
        return self._gpu.device

    @_device.setter
    def _device(self, value: torch.device | None) -> None:
        self._gpu.device = value

    @property
    def _closed(self) -> bool:  # also before the store is built: close() on a half-built one is harmless
        return "_state" not in self.__dict__ or self._state.closed

    # ------------------------------------------------------------------------------------------ public
    def put(self, key: str, tensor: torch.Tensor, *, tier: Tier | None = None, zeros: bool = False) -> None:
        """Copy ``tensor`` in as record ``key``, replacing any record of that key.

        ``tier=None``: the highest tier with room, as the policy says ("scan" streams records outside its
        resident set to NVMe, asynchronously). ``tier="nvme"`` returns once the file is written. A tensor
        larger than every budget is written to NVMe straight from ``tensor``.

        ``zeros=True``: ``tensor``'s bytes are all zero (checked first unless ``tier`` is "host" or "gpu"; ValueError if
        not, and the record it would replace is kept): a record
        placed there has its file allocated, not written (a new optimizer's first records: about 20 s of a 12B's).
        """
        self._check_open()
        key = check_key(key)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"put({key!r}, ...) needs a torch.Tensor, got {type(tensor).__name__}")
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.device.type not in ("cpu", "cuda"):
            raise TypeError(f"put({key!r}, ...): only dense CPU or CUDA tensors can be stored, got layout "
                            f"{tensor.layout} on {tensor.device}; convert with .to_dense() / .cpu()")  # fmt: skip
        if tier is not None and tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS} or None, got {tier!r}")
        nbytes = tensor.numel() * tensor.element_size()
        rec = Record(key, record_path(self.path, key), tuple(tensor.shape), tensor.dtype, nbytes)
        budget = {"gpu": self.gpu_budget, "host": self.host_budget}.get(tier or "", -1)
        if budget >= 0 and (need := rec.footprint if tier == "host" else nbytes) > budget:  # host: whole pages
            why = "there is no HBM tier (gpu_budget is 0 or CUDA is missing)" if budget == 0 else "it does not fit"
            raise ValueError(f"put({key!r}, tier={tier!r}): {format_size(need)} ({need} B) exceeds {tier}_budget "
                             f"{format_size(budget)} ({budget} B): "
                             f"{why}; raise {tier}_budget or pick another tier")  # fmt: skip
        # Before the old record is touched; a put into memory copies the bytes, whatever they are
        if zeros and tier in (None, "nvme"):
            values = tensor.detach().resolve_conj().resolve_neg()  # a conj/neg view's raw bytes are not its values
            if values.reshape(-1).view(torch.uint8).any():
                raise ValueError(f"put({key!r}, ..., zeros=True): the tensor has bytes that are not zero")
        put_record(self._state, self._gpu, self._host, rec, tensor, tier, zeros)  # replace.py

    def get(self, key: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """A new tensor holding the record (a copy), blocking. May leave a copy in host, as the policy says."""
        self._check_open()
        device = torch.device(device)
        st, direct = self._state, False
        with deferred_sigint(lets_through=True) as sigint:  # the count and its undo held, the read not (as pinned)
            try:
                with st.lock:
                    st.check_open()  # under the lock: a close that began sees this copy's pin and waits for it
                    rec = st.get(key)
                    st.policy.access(key)
                    if rec.gpu is None and rec.buf is None and rec.idle and not (
                            st.policy.promote_on_get(key) and rec.footprint <= st.host_budget):  # fmt: skip
                        rec.pins += 1  # holds off delete and put while we read the file
                        rec.reading += 1
                        rec.file_reads += 1  # and a flush's write of it, which would tear what we read
                        direct = True
                        st.count("host", rec, hit=False)
                sigint.through = True
                if not direct:
                    with self._gpu.pinned(key, None, reading=True) as t:
                        return t.to(device, copy=True)
                out = torch.empty(rec.nbytes, dtype=torch.uint8)
                self._host.read_now(rec, out)
                return out.view(rec.dtype).view(rec.shape).to(device)
            finally:
                sigint.through = False
                if direct:
                    st.end_file_read(rec)

    def fetch(self, key: str, tier: Tier = "host") -> Future[None]:
        """Start moving the record up into ``tier``; the future resolves when it is there.

        Waits here for host budget room (evicting by the policy); "gpu" completes before returning.
        """
        self._check_open()
        if tier not in ("gpu", "host"):
            raise ValueError(f"fetch(..., tier={tier!r}): fetch moves records up, into 'gpu' or 'host'")
        if tier == "gpu":
            with self.pin(key, tier="gpu"):
                return done_future()
        st = self._state
        with st.lock:
            rec = st.get(key)
            st.policy.access(key)
            st.count("host", rec, rec.in_host or rec.kind in (Move.LOAD, Move.QUEUED, Move.ACQUIRING))
        fut, _ = self._host.begin(rec, block=True, gpu_down=self._gpu.down)
        return fut or done_future()

    def prefetch(self, keys: Iterable[str], tier: Tier = "host") -> list[Future[None]]:
        """Promote ``keys`` in order while the budget allows; returns a future per key started or queued.

        May evict records that are neither pinned nor in ``keys``, by the policy. A key that does not fit
        now, but will once write-backs in flight free their buffers, is queued and starts then. Stops at
        the first key that cannot fit (the list is then shorter than ``keys``). Never waits for I/O.
        """
        self._check_open()
        keys = [check_key(k) for k in keys]
        if tier == "gpu":
            return [self.fetch(k, "gpu") for k in keys]
        if tier != "host":
            raise ValueError(f"prefetch(..., tier={tier!r}): prefetch moves records into 'host' or 'gpu'")
        with self._state.lock:
            recs = [self._state.get(k) for k in keys]  # every key known, before anything moves
            for k in keys:
                self._state.policy.prefetched(k)
        out: list[Future[None]] = []
        for rec in recs:
            fut, ok = self._host.begin(rec, block=False, protect=frozenset(keys))
            if not ok:
                break
            out.append(fut or done_future())
        self._host.drain()  # room may be free already for a head that waited behind others
        return out

    def pin(self, key: str, tier: Tier | None = None) -> PinBlock:
        """Yield the stored tensor itself (no copy), unevictable until the block exits.

        ``tier`` ("gpu" | "host") moves it there first, waiting only for what is in flight; None keeps
        it where it is (host when only on NVMe). After an in-place change call ``mark_dirty(key)``. Do not
        keep the tensor past the block: the memory is reused once the record leaves the tier.
        """
        self._check_open()
        if tier not in (None, "gpu", "host"):
            raise ValueError(f"pin(..., tier={tier!r}): a pinned record lives in memory: 'gpu', 'host' or None")
        return self._gpu.pinned(key, tier, reading=False)  # a class, whose exit a Ctrl-C cannot skip (gpu_tier.py)

    def mark_dirty(self, key: str) -> None:
        """The record's tensor was changed in place: it is written (and re-checksummed) when it leaves."""
        with self._lock():
            rec = self._state.get(key)
            if rec.gpu is None and rec.buf is None:
                raise ValueError(f"mark_dirty({key!r}): the record is only on NVMe, so nothing changed in "
                                 f"memory; change it inside `with store.pin({key!r}):`")  # fmt: skip
            rec.changed()

    def spare(self, nbytes: int) -> PooledBuffer | None:
        """A host buffer of ``nbytes`` from this store's budget for the caller's own use, if there is room now
        (nothing is evicted or waited for), else None. Give it back with ``release()`` or ``exchange``."""
        self._check_open()
        return self._host.spare(nbytes)

    def exchange(self, key: str, buf: PooledBuffer) -> PooledBuffer:
        """Make ``buf`` (from ``spare``, holding the record's new bytes) record ``key``'s host buffer; returns
        the old buffer, for the caller to release. The caller holds ``key`` pinned in host memory, so no
        movement is in flight; the record is then dirty, like one changed in place."""
        self._check_open()
        with self._state.lock:
            rec = self._state.get(key)
            if not (rec.pins and rec.idle and rec.buf is not None and rec.gpu is None):
                raise ValueError(f"exchange({key!r}): the record must be pinned in host memory, idle")
            if buf.nbytes < rec.nbytes:
                raise ValueError(f"exchange({key!r}): a buffer of {buf.nbytes} bytes cannot hold {rec.nbytes}")
            old, rec.buf = rec.buf, buf
            rec.changed()
        return old

    def retire(self, key: str) -> Future[None] | None:
        """The caller is done with ``key`` for this scan. Under "scan" a record outside the resident set
        leaves host memory now (async write-back when dirty): returns that future; None when it stays."""
        self._check_open()
        with self._state.lock:
            rec = self._state.get(key)
            if not self._state.policy.retire(key) or rec.pins or rec.gpu is not None:
                return None
            cancelled = self._host.cancel_queued(rec)  # prefetched, never used: forget the prefetch
        if cancelled is not None:
            cancelled.set_result(None)
        return self._host.demote(rec)

    def evict(self, key: str, tier: Tier = "nvme") -> Future[None]:
        """Move the record down to ``tier`` ("host" or "nvme"); a clean record writes nothing."""
        self._check_open()
        if tier not in ("host", "nvme"):
            raise ValueError(f"evict(..., tier={tier!r}): records are evicted to 'host' or 'nvme'")
        while True:
            with self._state.lock:
                rec = self._state.get(key)
                if rec.pins > rec.reading:
                    raise ValueError(f"evict({key!r}): the record is pinned; evict it after the pin block")
                if rec.pins:  # get()'s copies end by themselves: wait for them, then look again
                    self._state.unpinned.wait()
                    continue
                cancelled, busy = self._host.cancel_queued(rec), rec.op
            if cancelled is not None:
                cancelled.set_result(None)
            if busy is None:
                break
            self._state.wait(busy, swallow=True)  # its owner reports its errors; then look again
        if rec.gpu is not None:
            self._gpu.down(rec)
        return (self._host.demote(rec) if tier == "nvme" else None) or done_future()

    def delete(self, key: str) -> None:
        """Remove the record from every tier, and its file."""
        self._check_open()
        self._drop(check_key(key), missing_ok=False)

    def keys(self) -> list[str]:
        with self._lock():
            return list(self._state.recs)

    def __contains__(self, key: object) -> bool:
        with self._lock():
            return key in self._state.recs

    def __len__(self) -> int:
        with self._lock():
            return len(self._state.recs)

    def info(self, key: str) -> RecordInfo:
        with self._lock():
            r = self._state.get(key)
            return RecordInfo(r.key, r.shape, r.dtype, r.tier, r.nbytes, r.checksum, r.dirty or not r.on_disk)

    def is_resident(self, key: str) -> bool:
        """Whether the policy keeps ``key`` in host memory from one scan to the next (the scan policy's
        resident set); a record that is not must be read again by the next scan."""
        with self._lock():
            self._state.get(key)
            return self._state.policy.is_resident(key)

    def stats(self) -> dict[str, Any]:
        """Counters: per tier hits/misses (and their bytes) and use; NVMe bytes and requests; waits."""
        with self._lock():
            return self._state.stats(dict(in_use=self._gpu.used, peak=self._gpu.peak, budget=self._gpu.budget))

    def flush(self) -> None:
        """Write every dirty record, wait, fsync the files and save the index atomically.

        A failed write raises its error (``WriteBackError``: key, path, offset, errno) once the other writes
        are done; that record stays dirty in memory (a later flush writes it again, once per call) and the
        index keeps its last good state.
        """
        self._check_open()
        self._write_back()

    def close(self, *, discard: bool = False) -> None:
        """Flush, then release pinned memory, threads and the folder lock (not a ``folder_lock`` handed in: its
        holder's). Idempotent.

        Waits first (up to ``lifecycle.CLOSE_WAIT_S``) for other threads' pin blocks and get() copies to end, as
        they use the memory closing releases; past that it raises ``TimeoutError`` and the store stays open. A Ctrl-C
        during that wait raises ``KeyboardInterrupt`` with the store open likewise; one later, once it is closed.
        New calls from other threads meanwhile raise "closed". A failed flush still releases everything, then
        raises: the records it could not write are lost (the index keeps the last good state). To keep them,
        flush(), fix the cause and flush() again.

        ``discard=True``: no flush. Changes not yet written are dropped unwritten (the files and the index keep
        their last saved state): for a folder about to be removed, whose records need no I/O.
        """
        if self._closed:
            return

        def release() -> None:
            shutdown(self._state, self._host, self._gpu, self._flock)
            forget(self)

        close_whole(self._state, release, None if discard else self._write_back)  # lifecycle.py

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        st = self._state
        state = "closed" if self._closed else f"{len(st.recs)} records, host {format_size(st.pool.in_use)}"
        return f"TieredStore({self.path!r}, {state} of {format_size(st.host_budget)}, policy={st.policy.name!r})"

    # ----------------------------------------------------------------------------------------- helpers
    def _check_open(self) -> None:
        self._state.check_open()  # closed, closing, or made in another process (before a fork)

    def _lock(self) -> threading.RLock:
        """The store's lock, for the calls that also serve a closed store (``len``, ``info``, ...). Raises first in
        a forked child, as every call does: a lock some thread held at the fork is never released there."""
        self._state.check_process()
        return self._state.lock

    def _drop(self, key: str, *, missing_ok: bool, only: Record | None = None) -> None:
        self._gpu.drop(key, missing_ok=missing_ok, only=only)

    def _write_back(self) -> None:  # flush's body: also close's, which refuses new calls meanwhile
        self._gpu.write_dirty()
        self._state.io.flush()
        with self._state.index_lock:
            save_index(self.path, self._state.recs, self._state.lock)
