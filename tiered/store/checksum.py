"""Record checksums: CRC-32 (zlib's polynomial) of a buffer, computed in parallel segments.

Why CRC-32 and not a cryptographic hash: the threat is a torn write, a flipped bit or a truncated file,
not an adversary, and ``zlib.crc32`` runs at about 2 GB/s per core (``python -m tiered.store.checksum`` to
measure) and releases the GIL on large buffers, so threads add up.

Why combine segment CRCs with ``crc32_combine`` rather than hashing the list of segment CRCs: the result
is exactly ``zlib.crc32(whole_buffer)``, so it does not depend on the segment size, the thread count or
the I/O block size, and anyone can check a record file with a one-line ``zlib.crc32(open(f).read())``.
Combining costs one 32x32 GF(2) product per segment (microseconds), not a pass over the data.

Call order: ``c = Checksummer(threads)``; ``c.compute(buffer)`` from any thread except the checksummer's
own; ``c.close()``. ``crc32(buffer)`` is the serial twin (the oracle of the tests).
"""

from __future__ import annotations

import os
import threading
import time
import zlib
from functools import lru_cache
from typing import Any

import torch

from io_engine.threadpool import ThreadPool

__all__ = ["ALGORITHM", "SEGMENT_BYTES", "Checksummer", "byte_view", "crc32", "crc32_combine", "crc32_zeros"]

ALGORITHM = "crc32"  # recorded in the store's index, so a later change of algorithm is detected
SEGMENT_BYTES = 4 << 20  # small enough to spread a 16 MiB record over 4 cores, large enough to amortise
_POLY = 0xEDB88320  # reflected CRC-32 polynomial, as zlib uses


def byte_view(buffer: Any) -> memoryview:
    """A flat, read-only-or-not byte memoryview of a contiguous CPU tensor, ndarray or buffer object."""
    if isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise TypeError(f"checksums need a contiguous CPU tensor, got a {buffer.device.type} tensor "
                            f"(contiguous={buffer.is_contiguous()})")  # fmt: skip
        if buffer.numel() == 0:
            return memoryview(b"")
        # An ndarray is a buffer; numpy's stubs declare its __buffer__ for Python >= 3.12 only (the ignore).
        return memoryview(buffer.detach().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    mv = memoryview(buffer)
    return mv.cast("B") if mv.nbytes and mv.format != "B" else mv


def crc32(buffer: Any) -> int:
    """CRC-32 of the whole buffer in the caller's thread: the serial twin of ``Checksummer.compute``."""
    return zlib.crc32(byte_view(buffer))


# --- crc32_combine, after zlib 1.2.12's multmodp / x2nmodp: polynomial arithmetic modulo the CRC
# polynomial, bit-reflected. crc(A + B) = (crc(A) * x^(8 * len(B))) mod P  xor  crc(B).
def _multmodp(a: int, b: int) -> int:
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()  # _X2N[k] = x^(2^k) mod P


@lru_cache(maxsize=64)
def _shift_operator(nbytes: int) -> int:
    """x^(8 * nbytes) mod P: cached, because every full segment has the same length."""
    p, k, n = 1 << 31, 3, nbytes  # start at x^0; the 8 bits per byte are the k = 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A + B from crc1 = crc(A), crc2 = crc(B) and len2 = len(B)."""
    if len2 <= 0:
        return crc1
    return _multmodp(_shift_operator(len2), crc1) ^ crc2


@lru_cache(maxsize=64)
def crc32_zeros(nbytes: int) -> int:
    """CRC-32 of ``nbytes`` zero bytes without a buffer of them: powers of two of zeros combined
    (``crc32_combine``), O(log nbytes). What a record whose file is allocated, not written, reads as."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    crc, piece, length = 0, zlib.crc32(b"\0"), 1  # crc of no bytes; of ``length`` zeros
    while nbytes:
        if nbytes & 1:
            crc = crc32_combine(crc, piece, length)
        piece, length, nbytes = crc32_combine(piece, piece, length), 2 * length, nbytes >> 1
    return crc


class Checksummer:
    """Parallel CRC-32 over fixed-size segments; ``compute(buf) == zlib.crc32(buf)``.

    ``threads`` workers take the segments after the first; the calling thread does the first one
    itself rather than idling. Call ``compute`` from threads other than these workers (the store calls
    it from its mover threads), or it may wait on itself.
    """

    def __init__(self, threads: int | None = None, *, segment_bytes: int = SEGMENT_BYTES) -> None:
        if threads is None:
            threads = min(8, os.cpu_count() or 1)
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
            raise ValueError(f"threads must be an int >= 0 (0: compute in the caller's thread), got {threads!r}")
        if isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int) or segment_bytes < 1:
            raise ValueError(f"segment_bytes must be an int >= 1, got {segment_bytes!r}")
        self.segment_bytes = segment_bytes
        self._pool = ThreadPool(threads, thread_name_prefix="tiered-crc") if threads else None
        self._lock = threading.Lock()
        self.bytes = 0  # bytes checksummed so far, and the seconds it took (wall, summed over callers)
        self.seconds = 0.0

    def compute(self, buffer: Any) -> int:
        """CRC-32 of ``buffer`` (a contiguous CPU tensor, ndarray or bytes-like object)."""
        mv = byte_view(buffer)
        n, seg = mv.nbytes, self.segment_bytes
        t0 = time.perf_counter()
        if n <= seg or self._pool is None:
            crc = zlib.crc32(mv)
        else:
            starts = range(seg, n, seg)
            futs = [self._pool.submit(zlib.crc32, mv[s : s + seg]) for s in starts]
            crc = zlib.crc32(mv[:seg])
            for s, f in zip(starts, futs, strict=True):
                crc = crc32_combine(crc, f.result(), min(seg, n - s))
        with self._lock:
            self.bytes += n
            self.seconds += time.perf_counter() - t0
        return crc

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> Checksummer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _main() -> None:  # pragma: no cover - a measuring tool: python -m tiered.store.checksum [MiB] [threads]
    import sys

    size = int(sys.argv[1]) << 20 if len(sys.argv) > 1 else 256 << 20
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else None
    data = torch.randint(0, 256, (size,), dtype=torch.uint8)
    with Checksummer(threads) as c:
        for label, fn in (("serial", crc32), (f"parallel x{c._pool._max_workers if c._pool else 0}", c.compute)):
            fn(data)  # warm up: page faults, thread start
            t0 = time.perf_counter()
            reps = 5
            for _ in range(reps):
                fn(data)
            dt = (time.perf_counter() - t0) / reps
            print(f"{label:>14}: {size / dt / 1e9:6.2f} GB/s on {size >> 20} MiB")


if __name__ == "__main__":  # pragma: no cover
    _main()
