"""DuplexEngine: reads through one engine, writes through another, behind the one engine interface.

Why: an engine runs its tasks first in, first out, so a step's read-ahead waits behind the write-backs
queued before it, and both directions share one thread count. On the GPU machine's disk reads went fastest
at 64 threads (2.31 GB/s against 1.74 at 32) and writes at 32 (3.02 against 2.62 at 64),
bench/disk_probe.py: two engines give each direction its own queue and its own threads.

Call order: ``eng = DuplexEngine(reader, writer)`` (each an IOEngine or SerialEngine, made by the caller);
``pread`` goes to ``reader``, ``pwrite`` to ``writer``; ``flush(path=None)`` waits for the reads in flight,
then flushes the writer (its writes land and their files are fsynced); ``close()`` closes both, unless
``own=False``. A read of a range while a write of it is in flight sees either bytes, as with one engine:
callers that need the write's bytes wait for its future first (the store does).
"""

from __future__ import annotations

import os
from typing import Any

from .future import IOFuture
from .interface import EngineInterface


class DuplexEngine(EngineInterface):
    """``reader`` serves ``pread``, ``writer`` serves ``pwrite``; see the module docstring."""

    def __init__(self, reader: EngineInterface, writer: EngineInterface, *, own: bool = True):
        for name, eng in (("reader", reader), ("writer", writer)):
            if not all(callable(getattr(eng, a, None)) for a in ("pread", "pwrite", "flush", "close")):
                raise TypeError(f"{name} must be an IOEngine or SerialEngine, got {type(eng).__name__}")
        if reader is writer:
            raise ValueError("reader and writer are the same engine: pass it alone, not a DuplexEngine of it")
        self.reader, self.writer, self.own = reader, writer, own
        self.config = getattr(writer, "config", None)

    def pread(self, buffer: Any, path: str | os.PathLike, offset: int = 0, *, nbytes: int | None = None) -> IOFuture:
        return self.reader.pread(buffer, path, offset, nbytes=nbytes)

    def pwrite(self, buffer: Any, path: str | os.PathLike, offset: int = 0, *, nbytes: int | None = None) -> IOFuture:
        return self.writer.pwrite(buffer, path, offset, nbytes=nbytes)

    def flush(self, path: str | os.PathLike | None = None) -> None:
        """Wait for every read and write in flight, then fsync the files written (or only ``path``)."""
        self.reader.flush()  # it wrote nothing: this only waits for its reads
        self.writer.flush(path)

    def stats(self) -> dict[str, int]:
        """The two engines' counters, summed."""
        a, b = self.reader.stats(), self.writer.stats()  # type: ignore[attr-defined]
        return {k: a.get(k, 0) + b.get(k, 0) for k in dict.fromkeys([*a, *b])}

    def close(self) -> None:
        """Close both engines (``own=True``, the default); idempotent."""
        if self.own:
            try:
                self.reader.close()
            finally:
                self.writer.close()
