"""IOFuture: the handle every request returns. Blocking calls are ``future.result()``."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Generator
from concurrent.futures import Future
from typing import Any


class IOFuture(Future):
    """A ``concurrent.futures.Future`` whose result is the byte count, also awaitable in asyncio.

    A request split into several tasks completes when its last task does; the first task error
    becomes the future's exception (the others still run to completion, so the buffer is never
    written to after the future is done).
    """

    def __init__(self, parts: int = 1, nbytes: int = 0):
        super().__init__()
        self._parts = parts
        self._nbytes = nbytes
        self._first_error: BaseException | None = None
        self._lock = threading.Lock()
        if parts == 0:
            self.set_result(nbytes)

    def _part_done(self, error: BaseException | None = None) -> None:
        with self._lock:
            if error is not None and self._first_error is None:
                self._first_error = error
            self._parts -= 1
            last = self._parts == 0
        if last:
            if self._first_error is not None:
                self.set_exception(self._first_error)
            else:
                self.set_result(self._nbytes)

    def __await__(self) -> Generator[Any, None, int]:
        return asyncio.wrap_future(self).__await__()

    @classmethod
    def completed(cls, nbytes: int) -> IOFuture:
        return cls(parts=0, nbytes=nbytes)

    @classmethod
    def failed(cls, error: BaseException) -> IOFuture:
        f = cls(parts=1)
        f._part_done(error)
        return f
