"""A stored record's state, the snapshot the store hands out, and the errors the store raises about records.

``Record`` is the store's bookkeeping for one key: where its bytes are (a host buffer, an HBM tensor, the
file) and which single movement is in flight (``kind``, a ``Move``, and ``op``, its future; record_state.py
holds the table of the moves it may make). The store, ``HostTier`` and ``GpuTier`` mutate it only under the
store's lock. ``RecordInfo`` is the immutable public snapshot of it.
"""

from __future__ import annotations

import errno
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal

import torch

from io_engine import IOEngineError, PooledBuffer, pool_bytes

from .record_state import Move, check_transition

__all__ = ["Tier", "TIERS", "IntegrityError", "WriteBackError", "BudgetError", "RecordInfo", "Record", "check_key",
           "pending_future", "done_future", "resolve_future"]  # fmt: skip

Tier = Literal["gpu", "host", "nvme"]
TIERS = ("gpu", "host", "nvme")


class IntegrityError(OSError):
    """A record read back from NVMe is corrupted, truncated or missing. Names the key, the file and the fix.

    ``fix``: what the user of the store's client should do; None: the store user's own (restore the file, or
    delete the record). A client whose records are not its users' (the KV cache's pages) words its own.
    """

    def __init__(self, key: str, path: str, what: str, fix: str | None = None):
        if fix is None:
            fix = f"Restore the file from a copy, or drop the record with store.delete({key!r})"
        self.message = f"record {key!r}: the file {path} {what}. {fix}"
        super().__init__(errno.EIO, self.message, path)
        self.key, self.path, self.what = key, path, what

    def __str__(self) -> str:
        return self.message


class WriteBackError(IOEngineError):
    """Writing a record from memory to its file failed (disk full, no permission, read-only, failing disk).

    The record stays in memory, dirty: nothing is lost while the store is open. ``errno``, ``path`` and
    ``offset`` come from the failed write (``cause``); ``key`` names the record. Fix the cause, then retry
    the call, or ``flush()``.
    """

    def __init__(self, key: str, path: str, cause: OSError):
        why = cause.strerror or str(cause)
        super().__init__(cause.errno or errno.EIO,
                         f"record {key!r} could not be written to its file ({why}); it stays in memory, unsaved: "
                         "fix the cause (free space, permissions, a read-only mount), then retry or flush()",
                         path, getattr(cause, "offset", None) or 0)  # fmt: skip
        self.key, self.cause = key, cause


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


class Record:
    """One record's state. Mutated only under the store's lock.

    ``kind`` names the one movement in flight (record_state.py: ``Move`` and its ``TRANSITIONS``) and ``op``
    is its future, None exactly when ``kind`` is ``IDLE``. Change them only through ``begin``, ``advance``
    and ``end``, which check the move against the table.
    """

    __slots__ = ("key", "path", "shape", "dtype", "nbytes", "footprint", "buf", "gpu", "on_disk", "checksum",
                 "dirty", "version", "pins", "reading", "file_reads", "op", "kind", "keep", "releasing",
                 "deleted", "error")  # fmt: skip

    def __init__(self, key: str, path: str, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int):
        self.key, self.path, self.shape, self.dtype, self.nbytes = key, path, shape, dtype, nbytes
        self.footprint = pool_bytes([nbytes])  # what the pool charges for it
        self.buf: PooledBuffer | None = None
        self.gpu: torch.Tensor | None = None
        self.on_disk = False  # the file holds bytes whose CRC is `checksum`
        self.checksum: int | None = None
        self.dirty = False
        self.version = 0  # bumped by mark_dirty, so a write-back can tell it raced with a change
        self.pins = 0  # pin blocks and get()'s copies in progress: either keeps the record where it is
        self.reading = 0  # the part of ``pins`` that are get()'s copies: they end by themselves, so others wait
        self.file_reads = 0  # get()'s copies read straight from the file: no write to it may start meanwhile
        self.op: Future[None] | None = None  # the movement in flight, if any
        self.kind = Move.IDLE
        self.keep = False  # WRITE only: the write-back must keep the buffer (someone wants it in host)
        self.releasing = False  # WRITE (or a put's MOVE writing it: write_placed): the buffer goes once written
        self.deleted = False
        self.error: BaseException | None = None  # why the last write-back failed; None once one succeeds

    # ----------------------------------------------------------------------- movements (lock held)
    def begin(self, move: Move) -> Future[None]:
        """Leave ``IDLE`` for ``move``, with a new future (returned): its owner resolves it after ``end``."""
        check_transition(self.kind, move)
        self.op, self.kind = pending_future(), move
        return self.op

    def advance(self, move: Move) -> None:
        """Go on to the next step ``move`` of the movement in flight; its future stays the same."""
        if move is Move.IDLE:
            raise ValueError("advance() never ends a movement: call end()")
        check_transition(self.kind, move)
        self.kind = move

    def end(self) -> Future[None] | None:
        """Back to ``IDLE``; returns the movement's future, for the caller to resolve outside the lock."""
        check_transition(self.kind, Move.IDLE)
        fut, self.op, self.kind, self.keep, self.releasing = self.op, None, Move.IDLE, False, False
        return fut

    def begin_write(self, *, release: bool) -> Future[None]:
        """Start a write-back (``WRITE``); ``release``: it frees the buffer once written."""
        fut = self.begin(Move.WRITE)
        self.releasing = release
        self.on_disk = False  # from now until it lands the file may be half old, half new
        return fut

    def changed(self) -> None:
        """Its bytes in memory changed: dirty, and a new version, so a write-back in flight knows it raced."""
        self.dirty = True
        self.version += 1

    def want_in_host(self) -> None:
        """Someone wants the record in host memory: a write-back in flight keeps the buffer."""
        if self.kind is Move.WRITE:
            self.keep = True

    # ----------------------------------------------------------------------------------- questions
    @property
    def idle(self) -> bool:  # no movement in flight
        return self.kind is Move.IDLE

    @property
    def in_host(self) -> bool:  # the buffer holds the record's bytes (a write-back only reads them)
        return self.buf is not None and self.kind in (Move.IDLE, Move.WRITE)

    @property
    def evictable(self) -> bool:
        return self.buf is not None and self.kind is Move.IDLE and self.pins == 0

    @property
    def tier(self) -> Tier:
        return "gpu" if self.gpu is not None else "host" if self.in_host else "nvme"

    def view(self) -> torch.Tensor:
        assert self.buf is not None
        return self.buf.tensor[: self.nbytes].view(self.dtype).view(self.shape)


def check_key(key: object) -> str:
    if not isinstance(key, str):
        raise TypeError(f"record keys are str, got {type(key).__name__} {key!r}: use e.g. str(key)")
    if not key or "\0" in key:
        raise ValueError(f"record key {key!r} must be a non-empty string without NUL characters")
    try:
        key.encode()  # its file name is made from its UTF-8 bytes (index.py)
    except UnicodeEncodeError as e:  # a lone surrogate, as from a file name decoded with "surrogateescape"
        fix = "replace the character, e.g. key.encode('utf-8', 'replace').decode()"
        raise ValueError(f"record key {key!r} cannot be encoded as UTF-8 ({e.reason}): keys must be UTF-8 "
                         f"encodable; {fix}") from None  # fmt: skip
    return key


def pending_future() -> Future[None]:
    """A running future for a movement; only the store resolves it."""
    f: Future[None] = Future()
    f.set_running_or_notify_cancel()  # a user's cancel() must not break the store's own set_result
    return f


def done_future() -> Future[None]:
    f = pending_future()
    f.set_result(None)
    return f


def resolve_future(fut: Future[None] | None, exc: BaseException | None) -> None:
    """Settle a movement's future with its outcome (``exc`` None: success); no future, nothing to do."""
    if fut is None:
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)
