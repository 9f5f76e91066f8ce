"""Linux kernel AIO through its system calls (io_setup, io_submit, io_getevents, io_destroy), by ctypes.

What ``IOConfig(submit="aio")`` runs on: one thread keeps up to ``threads`` direct reads and writes in the kernel's
queue, as DeepSpeed's libaio handle does, instead of one blocking call a thread. No library beyond the C runtime
(the calls themselves, not libaio.so), so nothing is installed for it. With O_DIRECT the kernel runs these
requests asynchronously on ext4 and XFS; without it (a buffered descriptor) io_submit would block, so the engine
sends only direct tasks here.

    ctx = AioContext(depth)
    ctx.submit([(tag, fd, write, address, nbytes, offset), ...])   # returns how many the kernel took
    for tag, result in ctx.events(min_nr=1, timeout_s=None): ...   # result: bytes moved, or -errno
    ctx.close()
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from collections.abc import Sequence

__all__ = ["AioContext", "unavailable_reason"]

# (io_setup, io_destroy, io_getevents, io_submit): x86_64's table, and asm-generic's (aarch64).
_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
_PREAD, _PWRITE = 0, 1  # IOCB_CMD_PREAD, IOCB_CMD_PWRITE


class _IOCB(ctypes.Structure):  # linux/aio_abi.h, little-endian
    _fields_ = [
        ("aio_data", ctypes.c_uint64),
        ("aio_key", ctypes.c_uint32),
        ("aio_rw_flags", ctypes.c_uint32),
        ("aio_lio_opcode", ctypes.c_uint16),
        ("aio_reqprio", ctypes.c_int16),
        ("aio_fildes", ctypes.c_uint32),
        ("aio_buf", ctypes.c_uint64),
        ("aio_nbytes", ctypes.c_uint64),
        ("aio_offset", ctypes.c_int64),
        ("aio_reserved2", ctypes.c_uint64),
        ("aio_flags", ctypes.c_uint32),
        ("aio_resfd", ctypes.c_uint32),
    ]


class _Event(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64), ("res2", ctypes.c_int64)]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


# Two handles on the C runtime's syscall(): CDLL's releases the GIL for the call, PyDLL's keeps it. A call that
# waits releases it; one that returns at once keeps it, since taking the GIL back is what costs: while another
# thread runs Python, a thread returning from a call waits up to the switch interval (5 ms) for the GIL, so each
# release costs up to that (bench/gil_busy.py: 32 threads of 1 MiB reads fell to a quarter of their rate beside
# a Python loop).
_libc: ctypes.CDLL | None
_held: ctypes.CDLL | None
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _held = ctypes.PyDLL(None, use_errno=True)
    _libc.syscall.restype = _held.syscall.restype = ctypes.c_long
except (OSError, AttributeError):  # not a POSIX C runtime
    _libc = _held = None


def _call(number: int, *args: object, wait: bool = True) -> int:
    """syscall(number, *args), repeated on EINTR; ``wait=False`` for a call that does not block: the GIL is kept."""
    lib = _libc if wait else _held
    assert lib is not None
    while True:
        r = lib.syscall(ctypes.c_long(number), *args)
        if r >= 0:
            return int(r)
        e = ctypes.get_errno()
        if e != 4:  # EINTR: a signal arrived; the call is safe to repeat
            raise OSError(e, os.strerror(e))


@functools.cache
def unavailable_reason() -> str | None:
    """Why kernel AIO cannot be used here (None: it can): another OS or CPU, or a kernel or container that
    refuses io_setup (a seccomp profile). Probed once a process, not once an engine."""
    if platform.system() != "Linux" or _libc is None:
        return f"kernel AIO is Linux's; this is {platform.system()}"
    if platform.machine() not in _SYSCALLS:
        return f"no kernel AIO system call numbers for {platform.machine()} here"
    try:
        AioContext(1).close()
    except OSError as e:
        return f"io_setup failed: {e}"
    return None


class AioContext:
    """One kernel AIO context of ``depth`` slots. Not thread-safe: one thread submits and reaps."""

    def __init__(self, depth: int):
        calls = _SYSCALLS.get(platform.machine())
        if calls is None or _libc is None:
            raise OSError(f"kernel AIO is not available on {platform.system()} {platform.machine()}")
        self._setup, self._destroy, self._getevents, self._submit = calls
        self.depth = depth
        self._ctx = ctypes.c_ulong(0)
        _call(self._setup, ctypes.c_uint(depth), ctypes.byref(self._ctx))
        self._iocbs = (_IOCB * depth)()  # slot i's control block; the kernel reads it at io_submit
        self._events = (_Event * depth)()
        self._slot_of: dict[int, int] = {}  # tag -> slot while in flight
        self._free = list(range(depth))
        self._open = True

    def submit(self, requests: Sequence[tuple[int, int, bool, int, int, int]]) -> int:
        """Queue ``(tag, fd, write, address, nbytes, offset)`` requests; returns how many the kernel took (the
        first ones; the rest were not queued). At most the free slots; raises OSError if it took none."""
        if len(requests) > len(self._free):
            raise ValueError(f"{len(requests)} requests for {len(self._free)} free slots")
        if not requests:
            return 0
        slots = []
        for tag, fd, write, address, nbytes, offset in requests:
            slot = self._free.pop()
            cb = self._iocbs[slot]
            ctypes.memset(ctypes.byref(cb), 0, ctypes.sizeof(cb))
            cb.aio_data, cb.aio_fildes, cb.aio_buf, cb.aio_nbytes, cb.aio_offset = tag, fd, address, nbytes, offset
            cb.aio_lio_opcode = _PWRITE if write else _PREAD
            slots.append(slot)
            self._slot_of[tag] = slot
        ptrs = (ctypes.POINTER(_IOCB) * len(slots))(*(ctypes.pointer(self._iocbs[s]) for s in slots))
        try:  # direct requests: the kernel queues them and returns (engine.py sends only those here)
            taken = _call(self._submit, self._ctx, ctypes.c_long(len(slots)), ptrs, wait=False)
        except OSError:
            self._release(requests)
            raise
        self._release(requests[taken:])
        return taken

    def _release(self, requests: Sequence[tuple[int, int, bool, int, int, int]]) -> None:
        for req in requests:
            self._free.append(self._slot_of.pop(req[0]))

    def events(self, min_nr: int, timeout_s: float | None) -> list[tuple[int, int]]:
        """Wait for at least ``min_nr`` completions (or ``timeout_s``; 0: take what is done, holding the GIL);
        returns ``(tag, result)`` for each: the bytes moved, or a negative errno."""
        ts = None
        if timeout_s is not None:
            ts = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
        n = _call(self._getevents, self._ctx, ctypes.c_long(min_nr), ctypes.c_long(self.depth), self._events,
                  ctypes.byref(ts) if ts is not None else None, wait=timeout_s != 0)  # fmt: skip
        out = []
        for k in range(n):
            ev = self._events[k]
            self._free.append(self._slot_of.pop(int(ev.data)))
            out.append((int(ev.data), int(ev.res)))
        return out

    def close(self) -> None:
        """Destroy the context (the kernel waits for what is still in flight). Idempotent."""
        if self._open:
            self._open = False
            _call(self._destroy, self._ctx)

    def __del__(self) -> None:
        try:
            self.close()
        except OSError:
            pass
