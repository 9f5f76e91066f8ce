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

Concurrency. One lock (``_lock``) guards the records' states and the counters, and is held only for
those few assignments: never across I/O, checksums, copies or pool allocation (pinning a new block is
slow). Each record has at most one movement in flight (``op``, a Future): any other request on it
first waits for that future (outside the lock) and then looks again. I/O runs on io_engine's threads;
their completion callbacks do nothing but hand the finishing step to ``_mover``, a small executor that
checksums (in parallel segments, ``checksum.py``) and updates state. So a read and a write-back
overlap, checksums never run on the caller's thread for async paths, and a user's future callback
never runs on (and blocks) an I/O thread.

Host memory comes only from a ``PinnedBufferPool(host_budget)``: resident records, reads in flight and
buffers still being written all hold pool buffers, so the budget holds by construction. A prefetch that
does not fit now but will once write-backs in flight finish is queued (``_queue``, FIFO) and started by
the write-back that frees its room, so reads start the moment space exists.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import mmap
import os
import threading
import time
import urllib.parse
import warnings
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from hashlib import sha256
from typing import Any, Literal

import torch

from io_engine import IOConfig, IOEngine, PinnedBufferPool, PooledBuffer, ShortReadError, format_size, parse_size

from .checksum import ALGORITHM, Checksummer
from .lock import FolderLock, StoreLockedError
from .policy import Policy, make_policy

__all__ = ["TieredStore", "RecordInfo", "StoreLockedError", "IntegrityError", "BudgetError"]

Tier = Literal["gpu", "host", "nvme"]
_TIERS = ("gpu", "host", "nvme")
_PAGE = mmap.PAGESIZE
_INDEX = "index.json"
_RECORDS = "records"
_WAIT_POLL_S = 0.05  # a blocked pool wait re-checks for new victims this often


class IntegrityError(OSError):
    """A record read back from NVMe is corrupted, truncated or missing. Names the key and the file."""

    def __init__(self, key: str, path: str, what: str):
        self.message = (
            f"record {key!r}: the file {path} {what}. Restore the file from a copy, or drop the record "
            f"with store.delete({key!r})"
        )
        super().__init__(errno.EIO, self.message, path)
        self.key, self.path = key, path

    def __str__(self) -> str:
        return self.message


class BudgetError(MemoryError):
    """A tier's budget is held by records that cannot move (pinned), so a request can never fit."""


@dataclass(frozen=True)
class RecordInfo:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    tier: Tier
    nbytes: int
    checksum: int | None  # CRC-32 of the file's bytes, None until first written
    dirty: bool  # memory holds changes the file does not


class _Rec:
    """One record's state. Mutated only under the store's lock."""

    __slots__ = ("key", "path", "shape", "dtype", "nbytes", "footprint", "buf", "gpu", "on_disk", "checksum",
                 "dirty", "version", "pins", "op", "kind", "keep", "releasing", "deleted")  # fmt: skip

    def __init__(self, key: str, path: str, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int):
        self.key, self.path, self.shape, self.dtype, self.nbytes = key, path, shape, dtype, nbytes
        self.footprint = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)  # what the pool charges for it
        self.buf: PooledBuffer | None = None
        self.gpu: torch.Tensor | None = None
        self.on_disk = False  # the file holds bytes whose CRC is `checksum`
        self.checksum: int | None = None
        self.dirty = False
        self.version = 0  # bumped by mark_dirty, so a write-back can tell it raced with a change
        self.pins = 0
        self.op: Future[None] | None = None  # the movement in flight, if any
        self.kind: str | None = None  # "queued" | "acquiring" | "load" | "write" | "move"
        self.keep = False  # a write-back in flight must keep the buffer (someone wants it in host)
        self.releasing = False  # a write-back in flight will free the buffer
        self.deleted = False

    @property
    def in_host(self) -> bool:  # the buffer holds the record's bytes (a write-back only reads them)
        return self.buf is not None and self.kind in (None, "write")

    @property
    def evictable(self) -> bool:
        return self.buf is not None and self.kind is None and self.pins == 0

    @property
    def tier(self) -> Tier:
        return "gpu" if self.gpu is not None else "host" if self.in_host else "nvme"

    def view(self) -> torch.Tensor:
        assert self.buf is not None
        return self.buf.tensor[: self.nbytes].view(self.dtype).view(self.shape)


def _future() -> Future[None]:
    f: Future[None] = Future()
    f.set_running_or_notify_cancel()  # a user's cancel() must not break the store's own set_result
    return f


def _done() -> Future[None]:
    f = _future()
    f.set_result(None)
    return f


def _file_name(key: str) -> str:
    safe = urllib.parse.quote(key, safe="-_.")  # injective: distinct keys get distinct names
    if len(safe) > 180:  # keep under NAME_MAX (255) with room to spare
        safe = f"{safe[:100]}~{sha256(key.encode()).hexdigest()[:24]}"
    return f"{safe}.bin"


def _check_key(key: object) -> str:
    if not isinstance(key, str):
        raise TypeError(f"record keys are str, got {type(key).__name__} {key!r}: use e.g. str(key)")
    if not key or "\0" in key:
        raise ValueError(f"record key {key!r} must be a non-empty string without NUL characters")
    return key


class TieredStore:
    """Keyed tensor records in GPU / host / NVMe tiers. See the module docstring for the call order.

    ``io``: an ``IOConfig``, an engine to share (``IOEngine`` or ``SerialEngine``, not closed by the store)
    or None (``IOConfig.from_env()``). ``policy``: "lru", "scan" or a ``tiered.policy.Policy``.
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
        os.makedirs(os.path.join(self.path, _RECORDS), exist_ok=True)
        self._flock = FolderLock(self.path)  # before reading the index: another process may be writing it
        try:
            self._own_io = io is None or isinstance(io, IOConfig)
            self._io: Any = IOEngine(io or IOConfig.from_env()) if self._own_io else io
            self._pool = PinnedBufferPool(self.host_budget)
            self._crc = Checksummer()
            self._mover = ThreadPoolExecutor(mover_threads, thread_name_prefix="tiered-mover")
            self._lock = threading.Lock()
            self._mine = threading.local()  # the records each thread has pinned: see _acquire
            self._recs: dict[str, _Rec] = {}
            self._queue: deque[_Rec] = deque()  # prefetches waiting for room that write-backs will free
            self._queued = self._releasing = self._loading = self._gpu_used = 0
            self._host_peak = self._gpu_peak = self._evictions = 0
            self._io_wait = 0.0
            self._tier = {t: dict(hits=0, misses=0, hit_bytes=0, miss_bytes=0) for t in ("gpu", "host")}
            self._nvme = dict(bytes_read=0, bytes_written=0, reads=0, writes=0)
            self._device = torch.device("cuda", torch.cuda.current_device()) if self.gpu_budget else None
            self._side: Any = None  # CUDA side stream for copies, made on first use
            self._policy.bind(host_budget=self.host_budget, stream_reserve=reserve)
            self._load_index()
        except BaseException:
            self._flock.release()
            raise
        self._closed = False

    # ------------------------------------------------------------------------------------------ public
    def put(self, key: str, tensor: torch.Tensor, *, tier: Tier | None = None) -> None:
        """Copy ``tensor`` in as record ``key``, replacing any record of that key.

        ``tier=None``: the highest tier with room, as the policy says ("scan" streams records outside its
        resident set to NVMe, asynchronously). ``tier="nvme"`` returns once the file is written. A tensor
        larger than every budget is written to NVMe straight from ``tensor``.
        """
        self._check_open()
        key = _check_key(key)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"put({key!r}, ...) needs a torch.Tensor, got {type(tensor).__name__}")
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.device.type not in ("cpu", "cuda"):
            raise TypeError(f"put({key!r}, ...): only dense CPU or CUDA tensors can be stored, got layout "
                            f"{tensor.layout} on {tensor.device}; convert with .to_dense() / .cpu()")  # fmt: skip
        if tier is not None and tier not in _TIERS:
            raise ValueError(f"tier must be one of {_TIERS} or None, got {tier!r}")
        nbytes = tensor.numel() * tensor.element_size()
        rec = _Rec(key, os.path.join(self.path, _RECORDS, _file_name(key)), tuple(tensor.shape), tensor.dtype, nbytes)
        budget = {"gpu": self.gpu_budget, "host": self.host_budget}.get(tier or "", -1)
        if budget >= 0 and (rec.footprint if tier == "host" else nbytes) > budget:
            why = "there is no HBM tier (gpu_budget is 0 or CUDA is missing)" if budget == 0 else "it does not fit"
            raise ValueError(f"put({key!r}, tier={tier!r}): {format_size(nbytes)} exceeds {tier}_budget "
                             f"{format_size(budget)}: {why}; raise {tier}_budget or pick another tier")  # fmt: skip
        self._drop(key, missing_ok=True)
        explicit, rec.op, rec.kind = tier is not None, _future(), "move"  # nobody touches it while it is copied in
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
            except BaseException:
                self._drop(key, missing_ok=True)
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
                return _done()
        with self._lock:
            rec = self._get(key)
            self._policy.access(key)
            self._count("host", rec, rec.in_host or rec.kind in ("load", "queued", "acquiring"))
        fut, _ = self._begin_host(rec, block=True)
        return fut or _done()

    def prefetch(self, keys: Iterable[str], tier: Tier = "host") -> list[Future[None]]:
        """Promote ``keys`` in order while the budget allows; returns a future per key started or queued.

        May evict records that are neither pinned nor in ``keys``, by the policy. A key that does not fit
        now, but will once write-backs in flight free their buffers, is queued and starts then. Stops at
        the first key that cannot fit (the list is then shorter than ``keys``). Never waits for I/O.
        """
        self._check_open()
        keys = [_check_key(k) for k in keys]
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
            out.append(fut or _done())
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
        return (self._demote(rec) if tier == "nvme" else None) or _done()

    def delete(self, key: str) -> None:
        """Remove the record from every tier, and its file."""
        self._check_open()
        self._drop(_check_key(key), missing_ok=False)

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

    def stats(self) -> dict[str, Any]:
        """Counters: per tier hits/misses (and their bytes) and use; NVMe bytes and requests; waits."""
        with self._lock:
            gpu = dict(in_use=self._gpu_used, peak=self._gpu_peak, budget=self.gpu_budget)
            host = dict(in_use=self._pool.in_use, peak=self._host_peak, budget=self.host_budget)
            return {"gpu": {**self._tier["gpu"], **gpu}, "host": {**self._tier["host"], **host},
                    "nvme": dict(self._nvme), "evictions": self._evictions, "io_wait_s": self._io_wait,
                    "checksum_bytes": self._crc.bytes, "checksum_s": self._crc.seconds,
                    "records": len(self._recs), "policy": self._policy.stats()}  # fmt: skip

    def flush(self) -> None:
        """Write every dirty record, wait, fsync the files and save the index atomically.

        A failed write raises its error (path, offset, errno) once the other writes are done; that record
        stays dirty in memory and the index keeps its last good state.
        """
        self._check_open()
        while True:
            waits, writes, gpu = [], [], []
            with self._lock:
                for r in self._recs.values():
                    if r.kind is None and (r.dirty or not r.on_disk) and r.gpu is not None:
                        r.op, r.kind = _future(), "move"
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
        """Flush, then release pinned memory, threads and the folder lock. Idempotent."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._shutdown()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._recs)} records, host {format_size(self._pool.in_use)}"
        return f"TieredStore({self.path!r}, {state} of {format_size(self.host_budget)}, policy={self._policy.name!r})"

    # -------------------------------------------------------------------- host buffers and write-back
    def _acquire(self, rec: _Rec, *, urgent: bool, block: bool, protect: frozenset[str] = frozenset()) -> Any:
        """A host buffer for ``rec``, evicting by the policy until enough bytes are free or on their way.

        ``block``: wait for write-backs and other threads to free room; raise BudgetError when only the
        caller's own pins could (they would never end).
        """
        size = max(rec.nbytes, 1)  # the pool hands out no empty buffers; a page serves a 0-byte record
        while True:
            buf = self._pool.try_acquire(size)
            if buf is not None:
                return self._took(buf)
            writes = []
            with self._lock:
                coming = self._host_free() + self._releasing - self._queued
                cands = [k for k, r in self._recs.items() if r.evictable and r is not rec and k not in protect]
                for k in self._policy.victims(cands, incoming=rec.key, urgent=urgent) if coming < rec.footprint else ():
                    v = self._recs[k]
                    coming += v.footprint
                    version = self._demote_locked(v)
                    if version is not None:
                        writes.append((v, version))
                    if coming >= rec.footprint:
                        break
                if urgent:  # hopeless only if this thread's own pins hold the room: others' pins end
                    held = {id(r): r for r in getattr(self._mine, "pins", ()) if r.buf is not None}
                    mine = sum(r.footprint for r in held.values())
                    stuck = rec.footprint > self.host_budget - mine
                else:  # a streaming put may give up as soon as nothing is moving: it then writes directly
                    stuck = self._host_free() + self._releasing < rec.footprint and not self._loading
            for v, version in writes:
                self._submit_mover(self._write_task, v, version)
            buf = self._pool.try_acquire(size)
            if buf is not None or not block:
                return buf and self._took(buf)
            if stuck:
                raise BudgetError(f"host_budget {format_size(self.host_budget)} cannot make room for record "
                                  f"{rec.key!r} ({format_size(rec.nbytes)}): {format_size(self._pool.in_use)} "
                                  "is held by pinned or moving records. Leave pin blocks sooner, or raise "
                                  "host_budget")  # fmt: skip
            t0 = time.perf_counter()
            try:
                buf = self._pool.acquire(size, timeout=_WAIT_POLL_S)
            except TimeoutError:  # PoolExhaustedError: look for new victims, then wait again
                buf = None
            with self._lock:
                self._io_wait += time.perf_counter() - t0
            if buf is not None:
                return self._took(buf)

    def _took(self, buf: PooledBuffer) -> PooledBuffer:
        with self._lock:
            self._host_peak = max(self._host_peak, self._pool.in_use)
        return buf

    def _host_free(self) -> int:
        return self.host_budget - self._pool.in_use

    def _demote_locked(self, rec: _Rec) -> int | None:
        """Lock held, ``rec`` evictable. Clean: free its buffer now, no I/O (None). Dirty: start a
        releasing write-back and return the version to write (the caller submits ``_write_task``)."""
        if rec.dirty or not rec.on_disk:
            return self._write_locked(rec, release=True)
        buf, rec.buf = rec.buf, None
        self._evictions += 1
        buf.release()  # type: ignore[union-attr] # the pool's lock is a leaf: safe under ours
        return None

    def _demote(self, rec: _Rec) -> Future[None] | None:
        """Host -> NVMe if ``rec`` is evictable; the future resolves once the buffer is free."""
        with self._lock:
            if not rec.evictable:
                return None
            version, fut = self._demote_locked(rec), rec.op
        if version is None:
            self._drain()
            return _done()
        self._submit_mover(self._write_task, rec, version)
        return fut

    def _write_locked(self, rec: _Rec, *, release: bool) -> int:
        rec.op, rec.kind, rec.keep, rec.releasing = _future(), "write", False, release
        rec.on_disk = False  # from now until it lands the file may be half old, half new
        self._releasing += rec.footprint if release else 0
        return rec.version

    def _write_task(self, rec: _Rec, version: int) -> None:
        """Mover thread: checksum the buffer (parallel segments), then hand it to the I/O threads."""
        try:
            data = rec.buf.tensor[: rec.nbytes]  # type: ignore[union-attr]
            crc = self._crc.compute(data)
            iof = self._io.pwrite(data, rec.path, 0)
        except BaseException as e:  # noqa: BLE001 - it belongs to the write's future
            self._write_done(rec, version, 0, e)
            return
        iof.add_done_callback(lambda f: self._submit_mover(self._write_done, rec, version, crc, f.exception()))

    def _write_done(self, rec: _Rec, version: int, crc: int, exc: BaseException | None) -> None:
        free = None
        with self._lock:
            self._releasing -= rec.footprint if rec.releasing else 0
            if exc is None:
                rec.on_disk, rec.checksum = True, crc
                rec.dirty = rec.version != version  # changed while being written: still dirty
                self._nvme["bytes_written"] += rec.nbytes
                self._nvme["writes"] += 1
                if rec.releasing and not (rec.keep or rec.pins or rec.dirty):
                    free, rec.buf = rec.buf, None
                    self._evictions += 1
            fut, rec.op, rec.kind, rec.keep, rec.releasing = rec.op, None, None, False, False
        if free is not None:
            free.release()
        self._drain()
        _resolve(fut, exc)

    # ---------------------------------------------------------------------------------------- loading
    def _begin_host(self, rec: _Rec, *, block: bool, protect: frozenset[str] = frozenset()) -> tuple[Any, bool]:
        """Start bringing ``rec`` into host memory: (future, or None when it is there already; started).

        ``block=False`` (prefetch) never waits: it queues the record when room is on its way, else
        returns (None, False). ``block=True`` waits for room (evicting urgently) and for other moves.
        """
        while True:
            with self._lock:
                self._alive(rec)
                if rec.in_host:
                    rec.keep = rec.keep or rec.kind == "write"  # wanted in host: the write-back keeps the buffer
                    return rec.op, True
                if rec.gpu is not None and rec.kind is None and not block:
                    return None, True  # already above host
                busy = (
                    rec.op if rec.kind in ("load", "acquiring", "move") or rec.kind == "queued" and not block else None
                )
                if busy is not None and not block:
                    return busy, True
                if busy is None and rec.gpu is None:
                    if rec.footprint > self.host_budget:
                        if not block:
                            return None, False
                        raise ValueError(f"record {rec.key!r} ({format_size(rec.nbytes)}) is larger than "
                                         f"host_budget {format_size(self.host_budget)}: read it with get(), "
                                         "or raise host_budget")  # fmt: skip
                    if rec.kind == "queued":
                        self._unqueue(rec)
                    rec.op, rec.kind = rec.op or _future(), "acquiring"
                    fut, jump = rec.op, block or not self._queue  # a prefetch waits behind earlier queued ones
                    break
            if busy is not None:
                self._wait(busy, swallow=True)  # a failed load is retried (and reported) below
            else:
                self._gpu_down(rec)
        try:
            buf = self._acquire(rec, urgent=block, block=block, protect=protect) if jump else None
        except BaseException as e:
            with self._lock:
                rec.op = rec.kind = None
            fut.set_exception(e)
            raise
        if buf is None:
            with self._lock:
                if self._host_free() + self._releasing - self._queued >= rec.footprint:
                    rec.kind = "queued"  # a write-back in flight will free room: _drain starts the read then
                    self._queue.append(rec)
                    self._queued += rec.footprint
                    return fut, True
                rec.op = rec.kind = None
            fut.set_result(None)
            return None, False
        self._start_load(rec, buf)
        return fut, True

    def _start_load(self, rec: _Rec, buf: PooledBuffer) -> None:
        with self._lock:
            rec.buf, rec.kind = buf, "load"
            self._loading += 1
        try:
            iof = self._io.pread(buf.tensor[: rec.nbytes], rec.path, 0)
        except BaseException as e:  # noqa: BLE001 - it belongs to the load's future
            self._load_done(rec, e)
            return
        iof.add_done_callback(lambda f: self._submit_mover(self._load_done, rec, f.exception()))

    def _load_done(self, rec: _Rec, exc: BaseException | None) -> None:
        """Mover thread: verify the checksum, then publish the buffer (or free it on error)."""
        if exc is not None:
            exc = self._read_error(rec, exc)
        elif self.verify and rec.checksum is not None:
            got = self._crc.compute(rec.buf.tensor[: rec.nbytes])  # type: ignore[union-attr]
            exc = self._mismatch(rec, got) if got != rec.checksum else None
        free = None
        with self._lock:
            self._loading -= 1
            if exc is None:
                rec.dirty = False
                self._nvme["bytes_read"] += rec.nbytes
                self._nvme["reads"] += 1
            else:
                free, rec.buf = rec.buf, None
            fut, rec.op, rec.kind = rec.op, None, None
        if free is not None:
            free.release()
            self._drain()
        _resolve(fut, exc)

    def _drain(self) -> None:
        """Start queued prefetches, head first, while the pool has room for them."""
        while True:
            with self._lock:
                if self._closed or not self._queue:
                    return
                rec = self._queue[0]
            buf = self._pool.try_acquire(max(rec.nbytes, 1))
            if buf is None:
                return
            with self._lock:
                ok = bool(self._queue) and self._queue[0] is rec and rec.kind == "queued"
                if ok:
                    self._unqueue(rec)
                    rec.kind = "acquiring"
            if ok:
                self._start_load(rec, self._took(buf))
            else:
                buf.release()

    def _unqueue(self, rec: _Rec) -> None:  # lock held
        self._queue.remove(rec)
        self._queued -= rec.footprint

    def _cancel_queued(self, rec: _Rec) -> Future[None] | None:
        """Lock held: drop ``rec``'s queued prefetch; the caller resolves the returned future (unlocked)."""
        if rec.kind != "queued":
            return None
        self._unqueue(rec)
        fut, rec.op, rec.kind = rec.op, None, None
        return fut

    def _materialize(self, rec: _Rec, tier: Tier | None) -> torch.Tensor:
        """Pinned ``rec`` -> its tensor in ``tier`` (None: where it is, else host), moving it there."""
        counted = False
        while True:
            with self._lock:
                self._alive(rec)
                target = tier or ("gpu" if rec.gpu is not None else "host")
                if not counted:
                    hit = rec.gpu is not None if target == "gpu" else rec.in_host or rec.kind in ("load", "queued")
                    self._count(target, rec, hit)
                    counted = True
                if rec.kind is None and target == "gpu" and rec.gpu is not None:
                    return rec.gpu
                if rec.kind is None and target == "host" and rec.in_host:
                    return rec.view()
                rec.keep = rec.keep or rec.kind == "write"
                busy = rec.op if rec.kind in ("write", "move") else None
            if busy is not None:
                self._wait(busy, swallow=True)  # someone else's write or move: its owner reports errors
            elif target == "gpu" and rec.gpu is None and (rec.in_host or rec.footprint > self.host_budget):
                self._gpu_up(rec)
            else:
                fut, _ = self._begin_host(rec, block=True)
                if fut is not None:
                    self._wait(fut)  # our read: a corrupt or missing file raises here

    # ------------------------------------------------------------------------------ synchronous I/O
    def _write_now(self, rec: _Rec, tensor: torch.Tensor) -> None:
        """Write ``tensor`` as ``rec``'s file in the caller's thread (a record no host buffer can hold)."""
        src = tensor.detach()
        src = src.cpu() if src.device.type != "cpu" else src.contiguous()  # pageable staging, not the budget
        crc = self._crc.compute(src)
        self._io.pwrite(src, rec.path, 0).result()
        with self._lock:
            rec.on_disk, rec.checksum, rec.dirty = True, crc, False
            self._nvme["bytes_written"] += rec.nbytes
            self._nvme["writes"] += 1

    def _read_now(self, rec: _Rec, out: torch.Tensor) -> None:
        """Read ``rec``'s file into ``out`` (uint8, nbytes) in the caller's thread, and verify it."""
        t0 = time.perf_counter()
        try:
            self._io.pread(out, rec.path, 0).result()
        except BaseException as e:
            raise self._read_error(rec, e) from e
        finally:
            with self._lock:
                self._io_wait += time.perf_counter() - t0
        got = self._crc.compute(out) if self.verify and rec.checksum is not None else rec.checksum
        if got != rec.checksum:
            raise self._mismatch(rec, got)  # type: ignore[arg-type]
        with self._lock:
            self._nvme["bytes_read"] += rec.nbytes
            self._nvme["reads"] += 1

    def _mismatch(self, rec: _Rec, got: int) -> IntegrityError:
        what = f"does not match its checksum (crc32 {got:#010x} read, {rec.checksum:#010x} written): it is corrupted"
        return IntegrityError(rec.key, rec.path, what)

    def _read_error(self, rec: _Rec, exc: BaseException) -> BaseException:
        if isinstance(exc, ShortReadError):
            what = f"is truncated: it holds {exc.found} of the record's {exc.expected} bytes"
            return IntegrityError(rec.key, rec.path, what)
        if isinstance(exc, OSError) and exc.errno == errno.ENOENT:
            return IntegrityError(rec.key, rec.path, "is missing")
        return exc

    # --------------------------------------------------------------------------------------- GPU tier
    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not (dst.is_cuda or src.is_cuda):
            dst.copy_(src)
            return
        dev = dst.device if dst.is_cuda else src.device
        self._side = self._side or torch.cuda.Stream(device=dev)
        # The side stream first waits for the user's pending kernels on the tensor; we wait for the copy.
        self._side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(self._side):
            dst.copy_(src, non_blocking=True)
        self._side.synchronize()

    def _reserve_gpu(self, rec: _Rec) -> None:
        """Count ``rec`` against gpu_budget, moving unpinned GPU records down (policy order) for room."""
        while True:
            with self._lock:
                if self._gpu_used + rec.nbytes <= self.gpu_budget:
                    self._gpu_used += rec.nbytes
                    self._gpu_peak = max(self._gpu_peak, self._gpu_used)
                    return
                cands = [k for k, r in self._recs.items() if r.gpu is not None and r.kind is None and not r.pins]
                victims = self._policy.victims(cands, incoming=rec.key, urgent=True)
                if not victims:
                    raise BudgetError(f"gpu_budget {format_size(self.gpu_budget)} cannot make room for record "
                                      f"{rec.key!r} ({format_size(rec.nbytes)}): the GPU tier holds only pinned "
                                      "or moving records. Leave pin blocks sooner, or raise gpu_budget")  # fmt: skip
            self._gpu_down(self._recs[victims[0]])

    def _gpu_down(self, rec: _Rec) -> None:
        """GPU -> host (-> NVMe when the host budget cannot hold it), synchronously."""
        with self._lock:
            if rec.gpu is None or rec.kind is not None:
                return
            rec.op, rec.kind = _future(), "move"
        try:
            buf = None
            if rec.footprint <= self.host_budget:
                buf = self._acquire(rec, urgent=True, block=True, protect=frozenset([rec.key]))
                self._copy(buf.tensor[: rec.nbytes].view(rec.dtype).view(rec.shape), rec.gpu)  # type: ignore[arg-type]
            elif rec.dirty or not rec.on_disk:
                self._write_now(rec, rec.gpu)  # type: ignore[arg-type]
            with self._lock:
                rec.buf, rec.gpu, self._gpu_used = buf, None, self._gpu_used - rec.nbytes
        finally:
            self._finish(rec)

    def _gpu_up(self, rec: _Rec) -> None:
        """Host (or NVMe, for records the host budget cannot hold) -> GPU, synchronously."""
        with self._lock:
            if rec.gpu is not None or rec.kind is not None:
                return
            rec.op, rec.kind = _future(), "move"
        reserved = False
        try:
            self._reserve_gpu(rec)
            reserved = True
            gpu = torch.empty(rec.shape, dtype=rec.dtype, device=self._device)
            if rec.buf is None:
                staging = torch.empty(rec.nbytes, dtype=torch.uint8)
                self._read_now(rec, staging)
            self._copy(gpu, rec.view() if rec.buf is not None else staging.view(rec.dtype).view(rec.shape))
            with self._lock:
                rec.gpu, free, rec.buf, reserved = gpu, rec.buf, None, False
            if free is not None:
                free.release()
                self._drain()
        finally:
            if reserved:
                with self._lock:
                    self._gpu_used -= rec.nbytes
            self._finish(rec)

    # ----------------------------------------------------------------------------------------- helpers
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this TieredStore ({self.path}) is closed; open a new one on the folder")

    def _get(self, key: str) -> _Rec:  # lock held
        rec = self._recs.get(_check_key(key))
        if rec is None:
            raise KeyError(f"no record {key!r} in the store at {self.path} ({len(self._recs)} records): put() it first")
        return rec

    def _alive(self, rec: _Rec) -> None:  # lock held
        if rec.deleted:
            raise KeyError(f"record {rec.key!r} was deleted (or replaced) while this call waited for it")

    def _count(self, tier: str, rec: _Rec, hit: bool) -> None:  # lock held
        d = self._tier[tier]
        d["hits" if hit else "misses"] += 1
        d["hit_bytes" if hit else "miss_bytes"] += rec.nbytes

    def _wait(self, fut: Future[None], *, swallow: bool = False) -> None:
        t0 = time.perf_counter()
        try:
            fut.result()
        except BaseException:
            if not swallow:
                raise
        finally:
            with self._lock:
                self._io_wait += time.perf_counter() - t0

    def _finish(self, rec: _Rec) -> None:
        """End a synchronous move ("move") and wake those waiting on it."""
        with self._lock:
            fut, rec.op, rec.kind = rec.op, None, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _submit_mover(self, fn: Any, *args: Any) -> None:
        try:
            self._mover.submit(fn, *args)
        except RuntimeError:  # shut down (interpreter exit): finish inline rather than lose a completion
            fn(*args)

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
        """Write index.json atomically: a temp file, fsync, rename (the commit), fsync of the folder."""
        with self._lock:
            records = {k: {"file": os.path.basename(r.path), "shape": list(r.shape), "nbytes": r.nbytes,
                           "dtype": str(r.dtype).removeprefix("torch."), "checksum": r.checksum}
                       for k, r in self._recs.items() if r.on_disk}  # fmt: skip
        path = os.path.join(self.path, _INDEX)
        with open(path + ".tmp", "w") as f:
            json.dump({"format": "tiered.store", "version": 1, "checksum": ALGORITHM, "records": records}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _load_index(self) -> None:
        path = os.path.join(self.path, _INDEX)
        if not os.path.exists(path):
            return
        fix = "restore it from a copy, or move the folder aside and start a new store"
        try:
            with open(path) as f:
                data = json.load(f)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not a TieredStore index ({e}): {fix}") from e
        if not isinstance(data, dict) or data.get("format") != "tiered.store" or data.get("version") != 1:
            raise ValueError(f"{path} is not a version-1 TieredStore index: {fix}")
        if data.get("checksum") != ALGORITHM:
            raise ValueError(f"{path} uses checksum {data.get('checksum')!r}; this version reads {ALGORITHM!r}")
        for key, e in data.get("records", {}).items():
            try:
                dtype, shape = getattr(torch, e["dtype"]), tuple(int(s) for s in e["shape"])
                if not isinstance(dtype, torch.dtype) or int(e["nbytes"]) != math.prod(shape) * dtype.itemsize:
                    raise ValueError("its dtype and shape do not match its nbytes")
                if os.sep in e["file"] or e["file"].startswith("."):
                    raise ValueError(f"bad file name {e['file']!r}")
                rec = _Rec(_check_key(key), os.path.join(self.path, _RECORDS, e["file"]), shape, dtype, e["nbytes"])
                rec.on_disk, rec.checksum = True, int(e["checksum"])
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise ValueError(f"{path}: the entry for record {key!r} is malformed ({exc}): {fix}") from exc
            self._recs[key] = rec
            self._policy.insert(key, rec.footprint)


def _resolve(fut: Future[None] | None, exc: BaseException | None) -> None:
    if fut is None:
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)
