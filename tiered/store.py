"""TieredStore: keyed tensors in three tiers (GPU HBM, pinned host DDR, files on NVMe) under hard budgets.

Call order::

    store = TieredStore(path, host_budget="8GiB", policy="scan", io=IOConfig(...))   # locks the folder
    store.put(key, tensor)                      # copies in; the policy places it
    store.prefetch(keys)                        # async NVMe -> host, in order, while the budget allows
    with store.pin(key, tier="host") as t:      # waits only for that record's read; t is the record itself
        t.add_(1); store.mark_dirty(key)        # in-place change: say so, or it is never written
    store.retire(key)                           # done for this scan: "scan" streams it back out
    store.get(key) / store.evict(key) / store.delete(key)
    store.flush()                               # dirty records written, fsynced, index saved
    store.close()                               # flush + release memory, threads and the lock

A store left open is closed when the main thread ends (io_engine.close_at_exit, before the engines it
uses), so its dirty records are saved and no I/O thread runs during interpreter finalization.

Concurrency. One lock (``_lock``) guards the records' states and the counters, and is held only for
those few assignments: never across I/O, checksums, copies or pool allocation (pinning a new block is
slow). Each record has at most one movement in flight (``op``, a Future): any other request on it
first waits for that future (outside the lock) and then looks again. I/O runs on io_engine's threads;
their completion callbacks do nothing but hand the finishing step to ``_mover``, a small executor that
checksums (in parallel segments, ``checksum.py``) and updates state. So a read and a write-back
overlap, checksums never run on the caller's thread for async paths, and a user's future callback
never runs on (and blocks) an I/O thread.

Layout. ``TieredStore`` (here: the public calls, flush and lifecycle) builds on ``GpuTier`` (gpu_tier.py:
HBM moves and budget, and bringing a pinned record into a tier), which builds on ``HostTier``
(host_tier.py: pinned host buffers under ``host_budget``, write-back, loading, the prefetch queue).
``Record`` and the errors are in records.py; the folder's index and file names in store_index.py (its
"Links" says why nothing there is followed through a link). A failed write-back raises ``WriteBackError``
from the call that needed room (host_tier.py); the record stays in memory, dirty.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch

from io_engine import IOConfig, IOEngine, PinnedBufferPool, format_size, parse_size
from io_engine.shutdown import close_at_exit, forget

from .checksum import Checksummer
from .gpu_tier import GpuTier
from .lock import FolderLock, StoreLockedError
from .policy import Policy, make_policy
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
    pending_future,
)
from .store_index import StoreFolderError, index_entry, prepare_folder, read_index, record_path, write_index

__all__ = ["TieredStore", "RecordInfo", "StoreLockedError", "IntegrityError", "BudgetError", "WriteBackError",
           "StoreFolderError"]  # fmt: skip


class TieredStore(GpuTier):
    """Keyed tensor records in GPU / host / NVMe tiers. See the module docstring for the call order.

    ``io``: an ``IOConfig``, an engine to share (``IOEngine`` or ``SerialEngine``, not closed by the store;
    make it with ``follow_symlinks=False``, as the store makes its own) or None (``IOConfig.from_env()``).
    ``nvme_path``: a new or empty folder, or one a store used before (store_index.py's "Links" says why).
    ``policy``: "lru", "scan" or a ``tiered.policy.Policy``.
    ``stream_reserve`` (policy "scan"): host bytes kept out of the resident set for records streaming
    through (prefetched, being updated, being written back); default a quarter of ``host_budget``.
    """

    def __init__(self, nvme_path: str | os.PathLike[str], *, gpu_budget: int | str = 0,
                 host_budget: int | str = "1GiB", io: IOConfig | Any | None = None,
                 policy: str | Policy = "lru", verify: bool = True, stream_reserve: int | str | None = None,
                 mover_threads: int = 4) -> None:  # fmt: skip
        if not isinstance(nvme_path, (str, os.PathLike)):
            raise TypeError(f"nvme_path must be a folder path (str or os.PathLike), got {type(nvme_path).__name__}")
        self.path = os.path.abspath(os.fspath(nvme_path))
        self.host_budget = parse_size(host_budget, name="host_budget")
        self.gpu_budget = parse_size(gpu_budget, name="gpu_budget")
        if self.gpu_budget and not torch.cuda.is_available():
            msg = f"gpu_budget={gpu_budget!r} ignored: CUDA is not available, so there is no HBM tier"
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            self.gpu_budget = 0
        reserve = self.host_budget // 4 if stream_reserve is None else parse_size(stream_reserve, name="stream_reserve")
        if reserve > self.host_budget:
            raise ValueError(f"stream_reserve {format_size(reserve)} exceeds host_budget "
                             f"{format_size(self.host_budget)}: lower it or raise host_budget")  # fmt: skip
        if not isinstance(verify, bool):
            raise TypeError(f"verify must be True or False, got {verify!r}")
        if isinstance(mover_threads, bool) or not isinstance(mover_threads, int) or mover_threads < 1:
            raise ValueError(f"mover_threads must be an int >= 1, got {mover_threads!r}")
        if not (io is None or isinstance(io, IOConfig) or all(hasattr(io, a) for a in ("pread", "pwrite", "flush"))):
            raise TypeError(f"io must be an IOConfig, an IOEngine/SerialEngine or None, got {type(io).__name__}")
        self.verify, self.stream_reserve = verify, reserve
        self._policy = make_policy(policy)
        self._closed = True  # until built: close() on a half-built store must be harmless
        prepare_folder(self.path)  # refuses links and other people's files
        self._flock = FolderLock(self.path)  # before reading the index: another process may be writing it
        try:
            self._own_io = io is None or isinstance(io, IOConfig)
            self._io = IOEngine(io or IOConfig.from_env(), follow_symlinks=False) if self._own_io else io
            self._pool = PinnedBufferPool(self.host_budget)
            self._crc = Checksummer()
            self._mover = ThreadPoolExecutor(mover_threads, thread_name_prefix="tiered-mover")
            self._lock = threading.Lock()
            self._mine = threading.local()  # the records each thread has pinned: see _acquire
            self._recs = {}
            self._queue = deque()  # prefetches waiting for room that write-backs will free
            self._queued = self._releasing = self._loading = self._gpu_used = 0
            self._host_peak = self._gpu_peak = self._evictions = 0
            self._io_wait = self._room_wait = 0.0
            self._tier = {t: dict(hits=0, misses=0, hit_bytes=0, miss_bytes=0) for t in ("gpu", "host")}
            self._nvme = dict(bytes_read=0, bytes_written=0, reads=0, writes=0)
            self._device = torch.device("cuda", torch.cuda.current_device()) if self.gpu_budget else None
            self._side = None  # CUDA side stream for copies, made on first use
            self._policy.bind(host_budget=self.host_budget, stream_reserve=reserve)
            self._load_index()
        except BaseException:
            self._flock.release()
            raise
        self._closed = False
        close_at_exit(self, early=True)  # before the engines: closing flushes through one

    # ------------------------------------------------------------------------------------------ public
    def put(self, key: str, tensor: torch.Tensor, *, tier: Tier | None = None) -> None:
        """Copy ``tensor`` in as record ``key``, replacing any record of that key.

        ``tier=None``: the highest tier with room, as the policy says ("scan" streams records outside its
        resident set to NVMe, asynchronously). ``tier="nvme"`` returns once the file is written. A tensor
        larger than every budget is written to NVMe straight from ``tensor``.
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
        if budget >= 0 and (rec.footprint if tier == "host" else nbytes) > budget:
            why = "there is no HBM tier (gpu_budget is 0 or CUDA is missing)" if budget == 0 else "it does not fit"
            raise ValueError(f"put({key!r}, tier={tier!r}): {format_size(nbytes)} exceeds {tier}_budget "
                             f"{format_size(budget)}: {why}; raise {tier}_budget or pick another tier")  # fmt: skip
        self._drop(key, missing_ok=True)
        # nobody touches it while it is copied in
        explicit, rec.op, rec.kind = tier is not None, pending_future(), "move"
        with self._lock:
            self._recs[key] = rec
            self._policy.insert(key, rec.footprint)
            if tier is None and self.gpu_budget and self._gpu_used + nbytes <= self.gpu_budget:
                tier = "gpu"
            elif tier is None:
                tier = self._policy.placement(key) if rec.footprint <= self.host_budget else "nvme"
        try:
            if tier == "gpu":
                self._reserve_gpu(rec)
                try:
                    rec.gpu = torch.empty(rec.shape, dtype=rec.dtype, device=self._device)
                except BaseException:  # a CUDA OOM: give the reservation back (from here on _drop does)
                    with self._lock:
                        self._gpu_used -= rec.nbytes
                    raise
                self._copy(rec.gpu, tensor)
            elif rec.footprint <= self.host_budget:
                try:  # streaming ("nvme") may not evict residents; without room it writes synchronously
                    rec.buf = self._acquire(rec, urgent=tier == "host", block=True)
                    self._copy(rec.view(), tensor)
                except BudgetError:
                    if tier == "host":
                        raise
            if rec.gpu is None and rec.buf is None:
                self._write_now(rec, tensor)
            rec.dirty = rec.gpu is not None or rec.buf is not None
        except BaseException:
            self._finish(rec)
            self._drop(key, missing_ok=True)
            raise
        self._finish(rec)
        fut = self._demote(rec) if tier == "nvme" and rec.buf is not None else None  # the buffer frees once written
        if explicit and fut is not None:
            try:  # an explicit NVMe put returns once written, so a full disk raises here
                fut.result()
            except BaseException as e:
                self._drop(key, missing_ok=True)
                if isinstance(e, WriteBackError):  # the record is not kept: its write's own error says it all
                    raise e.cause from None
                raise

    def get(self, key: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """A new tensor holding the record (a copy), blocking. May leave a copy in host, as the policy says."""
        self._check_open()
        device = torch.device(device)
        with self._lock:
            rec = self._get(key)
            self._policy.access(key)
            direct = rec.gpu is None and rec.buf is None and rec.kind is None and not (
                self._policy.promote_on_get(key) and rec.footprint <= self.host_budget)  # fmt: skip
            if direct:
                rec.pins += 1  # holds off delete and put while we read the file
                self._count("host", rec, hit=False)
        if not direct:
            with self.pin(key) as t:
                return t.to(device, copy=True)
        try:
            out = torch.empty(rec.nbytes, dtype=torch.uint8)
            self._read_now(rec, out)
            return out.view(rec.dtype).view(rec.shape).to(device)
        finally:
            with self._lock:
                rec.pins -= 1

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
        with self._lock:
            rec = self._get(key)
            self._policy.access(key)
            self._count("host", rec, rec.in_host or rec.kind in ("load", "queued", "acquiring"))
        fut, _ = self._begin_host(rec, block=True)
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
        with self._lock:
            recs = [self._get(k) for k in keys]  # every key known, before anything moves
            for k in keys:
                self._policy.prefetched(k)
        out: list[Future[None]] = []
        for rec in recs:
            fut, ok = self._begin_host(rec, block=False, protect=frozenset(keys))
            if not ok:
                break
            out.append(fut or done_future())
        self._drain()  # room may be free already for a head that waited behind others
        return out

    @contextmanager
    def pin(self, key: str, tier: Tier | None = None) -> Iterator[torch.Tensor]:
        """Yield the stored tensor itself (no copy), unevictable until the block exits.

        ``tier`` ("gpu" | "host") moves it there first, waiting only for what is in flight; None keeps
        it where it is (host when only on NVMe). After an in-place change call ``mark_dirty(key)``. Do not
        keep the tensor past the block: the memory is reused once the record leaves the tier.
        """
        self._check_open()
        if tier not in (None, "gpu", "host"):
            raise ValueError(f"pin(..., tier={tier!r}): a pinned record lives in memory: 'gpu', 'host' or None")
        with self._lock:
            rec = self._get(key)
            rec.pins += 1
            self._policy.access(key)
        mine = self._mine.__dict__.setdefault("pins", [])
        mine.append(rec)
        try:
            yield self._materialize(rec, tier)
        finally:
            mine.remove(rec)
            with self._lock:
                rec.pins -= 1

    def mark_dirty(self, key: str) -> None:
        """The record's tensor was changed in place: it is written (and re-checksummed) when it leaves."""
        with self._lock:
            rec = self._get(key)
            if rec.gpu is None and rec.buf is None:
                raise ValueError(f"mark_dirty({key!r}): the record is only on NVMe, so nothing changed in "
                                 f"memory; change it inside `with store.pin({key!r}):`")  # fmt: skip
            rec.dirty = True
            rec.version += 1

    def retire(self, key: str) -> Future[None] | None:
        """The caller is done with ``key`` for this scan. Under "scan" a record outside the resident set
        leaves host memory now (async write-back when dirty): returns that future; None when it stays."""
        self._check_open()
        with self._lock:
            rec = self._get(key)
            if not self._policy.retire(key) or rec.pins or rec.gpu is not None:
                return None
            cancelled = self._cancel_queued(rec)  # prefetched, never used: forget the prefetch
        if cancelled is not None:
            cancelled.set_result(None)
        return self._demote(rec)

    def evict(self, key: str, tier: Tier = "nvme") -> Future[None]:
        """Move the record down to ``tier`` ("host" or "nvme"); a clean record writes nothing."""
        self._check_open()
        if tier not in ("host", "nvme"):
            raise ValueError(f"evict(..., tier={tier!r}): records are evicted to 'host' or 'nvme'")
        while True:
            with self._lock:
                rec = self._get(key)
                if rec.pins:
                    raise ValueError(f"evict({key!r}): the record is pinned; evict it after the pin block")
                cancelled, busy = self._cancel_queued(rec), rec.op
            if cancelled is not None:
                cancelled.set_result(None)
            if busy is None:
                break
            self._wait(busy, swallow=True)  # its owner reports its errors; then look again
        if rec.gpu is not None:
            self._gpu_down(rec)
        return (self._demote(rec) if tier == "nvme" else None) or done_future()

    def delete(self, key: str) -> None:
        """Remove the record from every tier, and its file."""
        self._check_open()
        self._drop(check_key(key), missing_ok=False)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._recs)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._recs

    def __len__(self) -> int:
        with self._lock:
            return len(self._recs)

    def info(self, key: str) -> RecordInfo:
        with self._lock:
            r = self._get(key)
            return RecordInfo(r.key, r.shape, r.dtype, r.tier, r.nbytes, r.checksum, r.dirty or not r.on_disk)

    def is_resident(self, key: str) -> bool:
        """Whether the policy keeps ``key`` in host memory from one scan to the next (the scan policy's
        resident set); a record that is not must be read again by the next scan."""
        with self._lock:
            self._get(key)
            return self._policy.is_resident(key)

    def stats(self) -> dict[str, Any]:
        """Counters: per tier hits/misses (and their bytes) and use; NVMe bytes and requests; waits."""
        with self._lock:
            gpu = dict(in_use=self._gpu_used, peak=self._gpu_peak, budget=self.gpu_budget)
            host = dict(in_use=self._pool.in_use, peak=self._host_peak, budget=self.host_budget)
            return {"gpu": {**self._tier["gpu"], **gpu}, "host": {**self._tier["host"], **host},
                    "nvme": dict(self._nvme), "evictions": self._evictions, "io_wait_s": self._io_wait,
                    "room_wait_s": self._room_wait,
                    "checksum_bytes": self._crc.bytes, "checksum_s": self._crc.seconds,
                    "records": len(self._recs), "policy": self._policy.stats()}  # fmt: skip

    def flush(self) -> None:
        """Write every dirty record, wait, fsync the files and save the index atomically.

        A failed write raises its error (``WriteBackError``: key, path, offset, errno) once the other writes
        are done; that record stays dirty in memory (a later flush writes it again, once per call) and the
        index keeps its last good state.
        """
        self._check_open()
        while True:
            waits, writes, gpu = [], [], []
            with self._lock:
                for r in self._recs.values():
                    if r.kind is None and (r.dirty or not r.on_disk) and r.gpu is not None:
                        r.op, r.kind = pending_future(), "move"
                        gpu.append(r)
                    elif r.kind is None and (r.dirty or not r.on_disk) and r.buf is not None:
                        writes.append((r, self._write_locked(r, release=False)))
                    if r.kind in ("write", "move"):
                        waits.append(r.op)
            if not waits:
                break
            for r, version in writes:
                self._submit_mover(self._write_task, r, version)
            errors: list[BaseException] = []
            for r in gpu:
                try:
                    self._write_now(r, r.gpu)  # type: ignore[arg-type]
                except BaseException as e:  # noqa: BLE001 - raised after the other writes finished
                    errors.append(e)
                finally:
                    self._finish(r)
            for f in waits:
                try:
                    self._wait(f)  # type: ignore[arg-type]
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)
            if errors:
                raise errors[0]
        self._io.flush()
        self._save_index()

    def close(self) -> None:
        """Flush, then release pinned memory, threads and the folder lock. Idempotent.

        A failed flush still releases everything, then raises: the records it could not write are lost
        (the index keeps the last good state). To keep them, flush(), fix the cause and flush() again.
        """
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._shutdown()
            forget(self)

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._recs)} records, host {format_size(self._pool.in_use)}"
        return f"TieredStore({self.path!r}, {state} of {format_size(self.host_budget)}, policy={self._policy.name!r})"

    # ----------------------------------------------------------------------------------------- helpers
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this TieredStore ({self.path}) is closed; open a new one on the folder")

    def _get(self, key: str) -> Record:  # lock held
        rec = self._recs.get(check_key(key))
        if rec is None:
            raise KeyError(f"no record {key!r} in the store at {self.path} ({len(self._recs)} records): put() it first")
        return rec

    def _drop(self, key: str, *, missing_ok: bool) -> None:
        """Remove ``key`` from memory, the policy and disk, once no move of it is in flight."""
        while True:
            with self._lock:
                rec = self._recs.get(key)
                if rec is None and missing_ok:
                    return
                rec = self._get(key)
                if rec.pins:
                    raise ValueError(f"record {key!r} is pinned: delete or replace it after its pin block")
                cancelled, busy, free = self._cancel_queued(rec), rec.op, None
                if busy is None:
                    del self._recs[key]
                    self._policy.remove(key)
                    rec.deleted, free, rec.buf = True, rec.buf, None
                    self._gpu_used -= rec.nbytes if rec.gpu is not None else 0
                    rec.gpu = None
            if cancelled is not None:
                cancelled.set_result(None)
            if busy is None:
                break
            self._wait(busy, swallow=True)
        if free is not None:
            free.release()
            self._drain()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(rec.path)

    def _shutdown(self) -> None:
        with self._lock:
            self._closed = True
            queued = [self._cancel_queued(r) for r in list(self._queue)]
        for f in queued:
            f.set_result(None)  # type: ignore[union-attr]
        while True:  # let every move in flight land before the threads and buffers go
            with self._lock:
                ops = [r.op for r in self._recs.values() if r.op is not None]
            if not ops:
                break
            for f in ops:
                self._wait(f, swallow=True)
        with self._lock:
            for r in self._recs.values():
                if r.buf is not None:
                    r.buf.release()
                r.buf = r.gpu = None
            self._gpu_used = 0
        self._mover.shutdown(wait=True)
        self._crc.close()
        self._pool.close()
        if self._own_io:
            self._io.close()
        self._flock.release()

    # ------------------------------------------------------------------------------------------ index
    def _save_index(self) -> None:
        """Save the index of the records whose files are whole, as one consistent snapshot (store_index.py)."""
        with self._lock:
            entries = {k: index_entry(r) for k, r in self._recs.items() if r.on_disk}
        write_index(self.path, entries)

    def _load_index(self) -> None:
        for rec in read_index(self.path):
            self._recs[rec.key] = rec
            self._policy.insert(rec.key, rec.footprint)
