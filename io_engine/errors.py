"""Errors raised by io_engine. Every I/O error carries the path, the offset and the errno."""

from __future__ import annotations

import errno as _errno
import os


class IOEngineError(OSError):
    """An I/O request failed. ``path``, ``offset`` and ``errno`` say where and why."""

    def __init__(self, err: int, message: str, path: str | os.PathLike | None = None, offset: int | None = None):
        super().__init__(err, message, None if path is None else os.fspath(path))
        self.path = None if path is None else os.fspath(path)
        self.offset = offset

    def __str__(self) -> str:
        where = f" (path {self.path!r}, offset {self.offset})" if self.path is not None else ""
        name = _errno.errorcode.get(self.errno, str(self.errno)) if self.errno else "error"
        return f"[{name}] {self.strerror}{where}"

    @classmethod
    def from_oserror(cls, exc: OSError, path: str | os.PathLike, offset: int, action: str) -> IOEngineError:
        err = exc.errno or _errno.EIO
        if err == _errno.ENOSPC:
            msg = f"{action} failed: the disk is full (free space on that filesystem, or write elsewhere)"
        else:
            msg = f"{action} failed: {exc.strerror or exc}"
        out = cls(err, msg, path, offset)
        out.__cause__ = exc
        return out


def open_error(exc: OSError, path: str | os.PathLike, offset: int, *, follow_symlinks: bool) -> IOEngineError:
    """The error for a failed open: ELOOP under ``follow_symlinks=False`` means the path ends in a link."""
    if isinstance(exc, IOEngineError):
        return exc
    if exc.errno == _errno.ELOOP and not follow_symlinks:
        why = "open failed: the path is a symbolic link, which this engine does not follow (follow_symlinks=False)"
        out = IOEngineError(_errno.ELOOP, f"{why}: remove the link, and find out who planted it", path, offset)
        out.__cause__ = exc
        return out
    return IOEngineError.from_oserror(exc, path, offset, "open")


class ShortReadError(IOEngineError):
    """The file ended before the requested bytes were read (a truncated file)."""

    def __init__(self, path: str | os.PathLike, offset: int, expected: int, found: int):
        super().__init__(
            _errno.EIO,
            f"short read: expected {expected} bytes at offset {offset}, the file holds only {found} of them "
            "(is the file truncated?)",
            path,
            offset,
        )
        self.expected = expected
        self.found = found


class DirectIOUnsupportedError(IOEngineError):
    """direct='on' was asked for on a filesystem that refuses O_DIRECT (tmpfs, some FUSE mounts)."""


class KernelAIOUnavailableError(IOEngineError):
    """submit='aio' was asked for where Linux kernel AIO cannot run (another OS, or io_setup refused)."""


class EngineClosedError(RuntimeError):
    """The engine or pool was used after close()."""


class EngineForkedError(EngineClosedError):
    """An engine was used in a process forked after it was made: its threads live only in the parent."""


class PoolExhaustedError(TimeoutError):
    """PinnedBufferPool.acquire timed out: the budget stayed in use by other buffers."""
