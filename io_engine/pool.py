"""PinnedBufferPool: page-aligned host buffers under a hard byte budget, page-locked when CUDA is there.

Call order: ``pool = PinnedBufferPool(capacity)``; ``with pool.acquire(n) as buf: ... buf.tensor ...``
(or ``buf.release()``); ``pool.close()``.

Pinning (cudaHostRegister) costs about as much as the copy it speeds up, so released buffers are kept
and handed out again for requests of the same size; idle ones are freed only when a new size needs
their room. Pinned and idle bytes together never exceed ``capacity``.

Interrupts: a Ctrl-C raised in ``acquire``'s wait for a release leaves no buffer taken; one landing as the buffer is
handed out would lose it (counted in use for good). A caller that holds SIGINT from the pool to the buffer's owner
(the store: a record's host buffer) asks ``waiting_for_buffer()`` in its handler, and lets a Ctrl-C raise in that
wait, which other threads' buffers can make last for ever (as ``IOEngine``'s ``waiting_for_room``).

Memory comes from anonymous mmap (page-aligned; private, in huge pages where given, zero-filled in a forked
child: hugepages.py) and is page-locked with cudaHostRegister, rather than from torch's pinned allocator, which
rounds every block up to a power of two: a 192 MiB chunk would pin 256 MiB and break the budget. Each buffer is
charged in whole pages, the memory it really takes: use ``pool_bytes(sizes)`` to size a pool that must hold given
buffers at once.
"""

from __future__ import annotations

import mmap
import threading
import time

import torch

from .align import PAGE, round_up
from .condition import Condition
from .errors import EngineClosedError, PoolExhaustedError
from .hugepages import host_mmap
from .sizes import format_size, parse_size

# ``waiting``: this thread is in a pool's wait for a release, no buffer taken (waiting_for_buffer).
_release = threading.local()


def waiting_for_buffer() -> bool:
    """Whether the calling thread waits in ``PinnedBufferPool.acquire`` for a buffer to come back, none taken yet:
    an interrupt raised now loses nothing. For a SIGINT handler that holds Ctrl-C from the pool to the buffer's
    owner but must let it stop this wait (the module docstring)."""
    return getattr(_release, "waiting", False)


class _Block:
    """One mmap'd, possibly page-locked, allocation."""

    def __init__(self, size: int, pin: bool, *, shared: bool = False):
        self.size = size
        # The pool's: private, huge pages where given, wiped on fork (hugepages.py). ``shared``: Python's default
        # shared mapping, whose bytes a forked child reads (the slabs: slab.py).
        self.mm, self.offset = (mmap.mmap(-1, size), 0) if shared else host_mmap(size)
        # A storage of exactly the buffer, from its start (not the mapping's, before the padding): torch's
        # is_pinned() asks of the storage's start, torch.save writes a view's whole storage. Through a memoryview,
        # which holds an export of the mapping while a tensor lives (torch.frombuffer of the mmap itself holds
        # none), so free() cannot unmap the memory under a view still alive (its close raises BufferError).
        self.tensor = torch.frombuffer(memoryview(self.mm)[self.offset : self.offset + size], dtype=torch.uint8)
        self.registered = False
        if pin:
            # Fault the pages in first, on torch's intra-op threads (a fill runs in parallel): page-locking
            # then only pins them, where left to itself it would fault them in one at a time.
            self.tensor.zero_()
            rc = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), size, 0)
            if int(rc) != 0:
                raise MemoryError(
                    f"cudaHostRegister of {format_size(size)} failed with CUDA error {int(rc)}; "
                    "lower the host budget or raise the locked-memory limit (ulimit -l)"
                )
            self.registered = True

    def free(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.registered = False
        self.tensor = None  # type: ignore[assignment]
        try:
            self.mm.close()
        except BufferError:  # a view of it is still alive somewhere: the GC frees it with the last view
            pass

    def __del__(self) -> None:
        # A buffer never given back still gets unregistered: a page-locked range left behind after its
        # memory is unmapped makes CUDA refuse (error 712) or misreport a later mapping at that address.
        if getattr(self, "registered", False):
            try:
                self.free()
            except Exception:
                pass


def pool_bytes(sizes: list[int] | tuple[int, ...]) -> int:
    """The capacity a pool needs to hold buffers of these sizes at once (each rounded up to pages)."""
    return sum(max(PAGE, round_up(n, PAGE)) for n in sizes)


class PooledBuffer:
    """A buffer on loan from a pool. ``tensor`` is a uint8 CPU tensor of exactly ``nbytes``; after ``release()``
    it raises ValueError. A view taken before (``view()``, a slice) keeps working on bytes no longer its own."""

    def __init__(self, pool: PinnedBufferPool, block: _Block, nbytes: int):
        self._pool = pool
        self._block: _Block | None = block
        self.nbytes = nbytes
        self._tensor: torch.Tensor | None = block.tensor[:nbytes]

    @property
    def tensor(self) -> torch.Tensor:
        t = self._tensor
        if t is None:
            raise ValueError(
                f"this {format_size(self.nbytes)} PooledBuffer was released: its memory is back in the pool, "
                "another buffer's or unmapped; use the tensor before release()"
            )
        return t

    @property
    def pinned(self) -> bool:
        return self._block is not None and self._block.registered

    def view(self, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        t = self.tensor.view(dtype)
        return t if shape is None else t[: _numel(shape)].view(shape)

    def release(self) -> None:
        """Give the buffer back (idempotent); ``tensor`` raises from now on. Views taken before must not be used."""
        block, self._block = self._block, None
        # The tensor's storage holds an export of the block's mapping: a handle kept after release (a variable
        # still in scope, a list) would stop the pool from unmapping the block it frees later (trim, close, room
        # for another size), which would stay resident while the pool counts it freed, past its budget.
        self._tensor = None
        if block is not None:
            self._pool._give_back(block)

    def __enter__(self) -> PooledBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class PinnedBufferPool:
    def __init__(self, capacity: int | str, *, alignment: int = 4096, pin: bool | None = None):
        self.capacity = parse_size(capacity, name="capacity")
        if alignment < 1 or alignment & (alignment - 1) or alignment > mmap.PAGESIZE:
            raise ValueError(f"alignment must be a power of two <= the page size {mmap.PAGESIZE}, got {alignment}")
        self.pin = torch.cuda.is_available() if pin is None else bool(pin)
        if self.pin and not torch.cuda.is_available():
            raise ValueError("pin=True needs CUDA; pass pin=None to pin only where CUDA is available")
        self._lock = Condition()
        self._idle: dict[int, list[_Block]] = {}
        self._idle_bytes = 0
        self._in_use = 0
        self._closed = False
        self.nudges = 0  # nudge() calls: an acquire() given ``since`` stops waiting once this moves past it
        self.made_bytes = 0  # bytes of the buffers made (mapped, and pinned where pin), and the seconds it took
        self.made_s = 0.0

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def _round(self, nbytes: int) -> int:
        return pool_bytes([nbytes])

    def try_acquire(self, nbytes: int) -> PooledBuffer | None:
        """A buffer of ``nbytes`` if the budget allows it now, else None."""
        size = self._check(nbytes)
        with self._lock:
            return self._take(nbytes, size)

    def acquire(self, nbytes: int, timeout: float | None = None, *, since: int | None = None) -> PooledBuffer:
        """A buffer of ``nbytes``; waits for releases while the budget is used up.

        Raises ``PoolExhaustedError`` after ``timeout`` seconds, ``ValueError`` at once when ``nbytes``
        exceeds the capacity. Never returns None. ``since``: a value of ``nudges`` read earlier; the wait also
        ends (``PoolExhaustedError``) once ``nudge()`` was called after that read, so that a caller who can make
        room itself (evict a buffer's owner) looks again instead of sleeping out its timeout.
        """
        size = self._check(nbytes)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                buf = self._take(nbytes, size)
                if buf is not None:
                    return buf
                if since is not None and self.nudges != since:
                    raise PoolExhaustedError(f"no {format_size(size)} buffer free; nudged to look for room again")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise PoolExhaustedError(
                        f"no {format_size(size)} buffer became free within {timeout} s: "
                        f"{format_size(self._in_use)} of {format_size(self.capacity)} is in use. "
                        "Release buffers sooner or raise the budget."
                    )
                _release.waiting = True
                try:
                    self._lock.wait(left)
                finally:
                    _release.waiting = False
                if self._closed:
                    raise EngineClosedError("the buffer pool was closed while waiting")

    def _check(self, nbytes: int) -> int:
        if self._closed:
            raise EngineClosedError("this PinnedBufferPool is closed")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be an int > 0, got {nbytes!r}")
        size = self._round(nbytes)
        if size > self.capacity:
            raise ValueError(
                f"a buffer of {format_size(nbytes)} ({format_size(size)} in whole pages) can never fit the pool's "
                f"capacity of {format_size(self.capacity)}: raise the budget or use smaller chunks"
            )
        return size

    def _take(self, nbytes: int, size: int) -> PooledBuffer | None:
        # Lock held. Reuse an idle block of this size; else make room by freeing idle blocks.
        same = self._idle.get(size)
        if same:
            block = same.pop()
            self._idle_bytes -= size
        else:
            if self._in_use + size > self.capacity:
                return None
            while self._in_use + self._idle_bytes + size > self.capacity:
                victim_size = next(s for s, blocks in self._idle.items() if blocks)
                self._idle[victim_size].pop().free()
                self._idle_bytes -= victim_size
            t0 = time.perf_counter()
            block = _Block(size, self.pin)
            self.made_s += time.perf_counter() - t0
            self.made_bytes += size
        self._in_use += size
        return PooledBuffer(self, block, nbytes)

    def _give_back(self, block: _Block) -> None:
        with self._lock:
            self._in_use -= block.size
            if self._closed:
                block.free()
            else:
                self._idle.setdefault(block.size, []).append(block)
                self._idle_bytes += block.size
            self._lock.notify_all()

    def nudge(self) -> None:
        """Wake the acquire() calls that passed ``since``: a buffer's owner may now let it go, which the pool
        cannot see (the store: a record unpinned, evictable again)."""
        with self._lock:
            self.nudges += 1
            self._lock.notify_all()

    def trim(self) -> None:
        """Free every idle block (their memory returns to the OS)."""
        with self._lock:
            for blocks in self._idle.values():
                for b in blocks:
                    b.free()
            self._idle.clear()
            self._idle_bytes = 0

    def close(self) -> None:
        """Free idle buffers now and loaned ones as they come back. Idempotent."""
        self.trim()
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    def __enter__(self) -> PinnedBufferPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
