"""The cache's mover: one worker thread and one side CUDA stream for what must not hold up the forward pass.

It runs, in submission order, the writes of filled pages to the store and the parts of layer loads that go
through the store (pages it streams from NVMe). On CUDA the side stream is also where the caller's thread issues
the copies of loads whose pages are all in memory (held pinned pages, device pages): those need no thread, only
an event the compute stream waits for (``OffloadedCache`` prefetches the same way). A write first waits, on the
mover thread, for the event recorded after the tokens it copies were appended, so the forward pass never waits
for it; a load's store part waits on the side stream for the event that frees its ring slot. On CPU there is no
stream and no event; the thread does the same work, so the ordering logic runs in CI too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from io_engine.threadpool import ThreadPool

__all__ = ["Mover"]


class Mover:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pool = ThreadPool(1, thread_name_prefix="tiered-kv")
        self._ident: int | None = None  # the worker thread's

    def event(self, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
        """An event recorded now on ``stream`` (default: the caller's current stream); None on CPU."""
        if self.stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return ev

    def compute(self) -> torch.cuda.Stream | None:
        """The caller's current stream (where the model's kernels run); None on CPU."""
        return torch.cuda.current_stream(self.device) if self.stream is not None else None

    def submit(self, fn: Callable[..., Any], *args: Any, after: torch.cuda.Event | None = None) -> Future[Any]:
        return self._pool.submit(self._run, fn, args, after)

    @torch.no_grad()  # grad mode is per thread: this one copies values only
    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], after: torch.cuda.Event | None) -> Any:
        self._ident = threading.get_ident()
        if self.stream is None:
            return fn(*args)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if after is not None:
                after.synchronize()
            return fn(*args)

    def close(self) -> None:
        # Not waiting on the worker itself: a dropped cache can be collected, and closed, in any thread.
        self._pool.shutdown(wait=threading.get_ident() != self._ident)
