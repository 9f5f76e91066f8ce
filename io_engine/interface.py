"""The interface both engines share: the blocking calls are the async ones plus ``.result()``."""

from __future__ import annotations

import os
from typing import Any

from .future import IOFuture


class EngineInterface:
    """Subclasses implement ``pread``, ``pwrite``, ``flush``, ``stats`` and ``close``."""

    def pread(self, buffer: Any, path: str | os.PathLike, offset: int = 0, *, nbytes: int | None = None) -> IOFuture:
        raise NotImplementedError

    def pwrite(self, buffer: Any, path: str | os.PathLike, offset: int = 0, *, nbytes: int | None = None) -> IOFuture:
        raise NotImplementedError

    def flush(self, path: str | os.PathLike | None = None) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def read(self, buffer: Any, path: str | os.PathLike, offset: int = 0, *, nbytes: int | None = None) -> int:
        """``pread(...).result()``: the bytes read."""
        return self.pread(buffer, path, offset, nbytes=nbytes).result()

    def write(self, buffer: Any, path: str | os.PathLike, offset: int = 0, *, nbytes: int | None = None) -> int:
        """``pwrite(...).result()``: the bytes written."""
        return self.pwrite(buffer, path, offset, nbytes=nbytes).result()

    def fsync(self, path: str | os.PathLike | None = None) -> None:
        """Alias of ``flush``."""
        self.flush(path)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
