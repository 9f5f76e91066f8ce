"""The host tier's synchronous I/O: records read and written in the caller's thread, bypassing host buffers.

``SyncIO`` is a part of ``HostTier`` (host_tier.py), split off to keep that module readable: a record no host
buffer can hold is written (``write_now``) or read (``read_now``) here, a record known to be zeros has its file
allocated (``write_zeros_now``), and the errors a read back from NVMe raises are made here (``_read_error``,
``_mismatch``), for the host tier's asynchronous loads too, whose outcome is settled here (``_load_outcome``). It
shares the store's ``StoreState`` (``state``).

``waiting_for_write``: a put, which holds Ctrl-C (replace.py), lets one through while ``write_now`` waits for its
write to land, which a stalled disk can make last for ever; the put's undo then drops the file being written.
"""

from __future__ import annotations

import errno
import os
import threading
import time

import torch

from io_engine import IOEngineError, ShortReadError
from io_engine.posix import allocate

from .checksum import crc32_zeros
from .records import IntegrityError, Record
from .state import StoreState

__all__ = ["SyncIO", "waiting_for_write"]

_write = threading.local()  # ``waiting``: this thread waits in write_now for its write to land


def waiting_for_write() -> bool:
    """Whether this thread waits in ``write_now`` for its write, already queued, to land (the module docstring)."""
    return getattr(_write, "waiting", False)


class SyncIO:
    """Synchronous reads and writes of whole records, in the caller's thread (mixed into ``HostTier``)."""

    state: StoreState

    # ------------------------------------------------------------------------------ synchronous I/O
    def write_now(self, rec: Record, tensor: torch.Tensor) -> None:
        """Write ``tensor`` as ``rec``'s file in the caller's thread (a record no host buffer can hold)."""
        s = self.state
        with s.lock:
            version = rec.version
            s.nvme["write_started_bytes"] += rec.nbytes
        # A conjugate or negative view (x.conj()) keeps that bit through .contiguous() and .cpu(): its values are
        # the resolved ones, which its raw bytes are not (nor may it be viewed as bytes)
        src = tensor.detach().resolve_conj().resolve_neg()
        src = src.cpu() if src.device.type != "cpu" else src.contiguous()  # pageable staging, not the budget
        crc = s.crc.compute(src)
        fut = s.io.pwrite(src, rec.path, 0)
        _write.waiting = True
        try:
            fut.result()
        finally:
            _write.waiting = False
        with s.lock:
            rec.on_disk, rec.checksum, rec.error = True, crc, None
            rec.dirty = rec.version != version  # changed meanwhile (another thread's pin block): still dirty
            s.nvme["bytes_written"] += rec.nbytes
            s.nvme["writes"] += 1

    def write_zeros_now(self, rec: Record) -> None:
        """Make ``rec``'s file ``nbytes`` of zeros without writing them: its blocks allocated (fallocate, so a
        full disk fails here as a write would; where the filesystem cannot, the file is sparse), which read as
        zeros, and which its later write-backs fill in place, as the engine's own writes do (io_engine.posix)."""
        s = self.state
        with s.lock:
            version = rec.version
        try:
            fd = os.open(rec.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
            try:
                os.ftruncate(fd, rec.nbytes)
                allocate(fd, 0, rec.nbytes)  # where the filesystem cannot, the file stays sparse: zeros still
            finally:
                os.close(fd)
        except OSError as e:  # named as a write's failure is: the file, and for a full disk what to do
            raise IOEngineError.from_oserror(e, rec.path, 0, "allocate") from e
        with s.lock:
            rec.on_disk, rec.checksum, rec.error = True, crc32_zeros(rec.nbytes), None
            rec.dirty = rec.version != version

    def read_now(self, rec: Record, out: torch.Tensor) -> None:
        """Read ``rec``'s file into ``out`` (uint8, nbytes) in the caller's thread, and verify it."""
        s = self.state
        t0 = time.perf_counter()
        try:
            s.io.pread(out, rec.path, 0).result()
        except BaseException as e:
            raise self._read_error(rec, e) from e
        finally:
            with s.lock:
                s.io_wait += time.perf_counter() - t0
        got = s.crc.compute(out) if s.verify and rec.checksum is not None else rec.checksum
        if got != rec.checksum:
            raise self._mismatch(rec, got)  # type: ignore[arg-type]
        with s.lock:
            s.nvme["bytes_read"] += rec.nbytes
            s.nvme["reads"] += 1

    def _load_outcome(self, rec: Record, exc: BaseException | None) -> BaseException | None:
        """What a load of ``rec`` into its buffer came to (None: loaded): its read's error, named, or its checksum
        checked. A failure to check it is the load's error: on a mover thread, raised, it was lost, and with it
        the load's end (its future never resolved: a caller waiting on it, or close, hung)."""
        if exc is not None:
            return self._read_error(rec, exc)
        if not self.state.verify or rec.checksum is None:
            return None
        try:
            got = self.state.crc.compute(rec.buf.tensor[: rec.nbytes])  # type: ignore[union-attr]
        except Exception as e:  # noqa: BLE001 - e.g. no checksum thread could start: the load's error
            return e
        return self._mismatch(rec, got) if got != rec.checksum else None

    def _mismatch(self, rec: Record, got: int) -> IntegrityError:
        what = f"does not match its checksum (crc32 {got:#010x} read, {rec.checksum:#010x} written): it is corrupted"
        return IntegrityError(rec.key, rec.path, what)

    def _read_error(self, rec: Record, exc: BaseException) -> BaseException:
        if isinstance(exc, ShortReadError):
            what = f"is truncated: it holds {exc.found} of the record's {exc.expected} bytes"
            return IntegrityError(rec.key, rec.path, what)
        if isinstance(exc, OSError) and exc.errno == errno.ENOENT:
            return IntegrityError(rec.key, rec.path, "is missing")
        return exc
