"""SerialEngine: the serial twin of IOEngine, the oracle of the tests.

Same interface, no threads, no O_DIRECT, no splitting: each request runs in the caller's thread with
plain ``os.pread``/``os.pwrite`` and returns an already completed future. ``follow_symlinks=False`` refuses
links as IOEngine does; the IOConfig fields do not apply.
"""

from __future__ import annotations

import os
from typing import Any

from .config import IOConfig
from .errors import EngineClosedError, IOEngineError, ShortReadError, open_error
from .future import IOFuture
from .interface import EngineInterface
from .posix import check_follow_symlinks, fsync_path, validate_request


class SerialEngine(EngineInterface):
    def __init__(self, config: IOConfig | None = None, *, follow_symlinks: bool = True):
        self.config = config if config is not None else IOConfig.from_env()
        self.follow_symlinks = check_follow_symlinks(follow_symlinks)
        self._closed = False
        self._written: set[str] = set()
        self._stats = dict(bytes_read=0, bytes_written=0, requests=0, direct_bytes=0, buffered_bytes=0,
                           allocated_bytes=0)  # fmt: skip

    def pread(self, buffer: Any, path: str | os.PathLike, offset: int = 0, *, nbytes: int | None = None) -> IOFuture:
        return self._do(False, buffer, path, offset, nbytes)

    def pwrite(self, buffer: Any, path: str | os.PathLike, offset: int = 0, *, nbytes: int | None = None) -> IOFuture:
        return self._do(True, buffer, path, offset, nbytes)

    def flush(self, path: str | os.PathLike | None = None) -> None:
        self._check_open()
        targets = self._written if path is None else {os.fspath(path)}
        for p in sorted(targets):
            fsync_path(p, follow_symlinks=self.follow_symlinks)
        self._written = set() if path is None else self._written - targets

    def stats(self) -> dict[str, int]:
        return dict(self._stats)

    def close(self) -> None:
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("this SerialEngine is closed; create a new one")

    def _do(self, write: bool, buffer: Any, path: str | os.PathLike, offset: int, nbytes: int | None) -> IOFuture:
        self._check_open()
        hb, n = validate_request(buffer, offset, nbytes, write=write)
        path = os.fspath(path)
        follow = self.follow_symlinks
        flags = ((os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY) | (0 if follow else getattr(os, "O_NOFOLLOW", 0))
        try:
            fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            return IOFuture.failed(open_error(e, path, offset, follow_symlinks=follow))
        try:
            done = 0
            while done < n:
                if write:
                    done += os.pwrite(fd, hb.view[done:n], offset + done)
                else:
                    data = os.pread(fd, n - done, offset + done)
                    if not data:
                        raise ShortReadError(path, offset, n, done)
                    hb.view[done : done + len(data)] = data
                    done += len(data)
        except IOEngineError as e:
            return IOFuture.failed(e)
        except OSError as e:
            return IOFuture.failed(IOEngineError.from_oserror(e, path, offset + done, "write" if write else "read"))
        finally:
            os.close(fd)
        if write:
            self._written.add(path)
        self._stats["requests"] += 1
        self._stats["bytes_written" if write else "bytes_read"] += n
        self._stats["buffered_bytes"] += n
        return IOFuture.completed(n)
