"""The cache's mover: one worker thread that runs the window's loads and write-backs in submission order.

Order is the whole synchronization between the two directions: a layer's write-back is submitted before the
next load of that layer, so a load always sees every page written. On CUDA each task runs on one side stream
(as ``OffloadedCache``'s prefetch does) and waits for it before it ends, so a finished future means the data
has landed; a write-back first waits for the event recorded after the tokens it copies were appended. The
main thread blocks only when the layer it needs next is still in flight. On CPU the same thread does the same
copies (torch releases the GIL in them), so the window logic is exercised there too.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

__all__ = ["Mover"]


class Mover:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tiered-kv")

    def event(self) -> torch.cuda.Event | None:
        """An event on the caller's current stream (None on CPU): what a write-back waits for."""
        if self.stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def submit(self, fn: Callable[..., Any], *args: Any, after: torch.cuda.Event | None = None) -> Future[Any]:
        return self._pool.submit(self._run, fn, args, after)

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], after: torch.cuda.Event | None) -> Any:
        if self.stream is None:
            return fn(*args)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if after is not None:
                after.synchronize()
            out = fn(*args)
            self.stream.synchronize()
            return out

    def handed_over(self, *tensors: torch.Tensor | None) -> None:
        """Buffers made on the side stream, now used on the caller's stream: the allocator must not reuse
        their memory for the side stream while the caller's kernels still read it."""
        if self.stream is not None:
            current = torch.cuda.current_stream(self.device)
            for t in tensors:
                if t is not None:
                    t.record_stream(current)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
