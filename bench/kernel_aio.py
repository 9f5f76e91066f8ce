"""Linux kernel AIO (io_setup / io_submit / io_getevents) from one thread through ctypes: a probe, not an engine.

What it is for: on the GPU machine's virtio disk, io_engine (one synchronous pread/pwrite per worker thread) ran at
0.83x (read) and 0.85x (write) DeepSpeed's libaio handle, the two interleaved in one call (bench/RESULTS.md,
fifteenth session). This moves a whole file as libaio does, `depth` requests of `block` bytes in flight from one
thread, with no library beyond the C runtime (the syscalls, not libaio.so), so that `bench/disk_compare.py
--kaio` can tell whether the submission model closes that gap before io_engine grows a backend for it.

    seconds = stream_file(path, buffer_address, size, block=1 << 20, depth=32, write=False)

O_DIRECT: the buffer, block and size must be multiples of 4096 (page-aligned buffers are). Raises OSError where
the kernel refuses (no AIO in this kernel or container, a filesystem without O_DIRECT).
"""

from __future__ import annotations

import ctypes
import os
import platform
import time

# x86_64 and aarch64 syscall numbers (asm-generic on aarch64).
_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
IOCB_CMD_PREAD, IOCB_CMD_PWRITE = 0, 1


class IOCB(ctypes.Structure):  # linux/aio_abi.h, little-endian
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


class IOEvent(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64), ("res2", ctypes.c_int64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _syscall(number: int, *args: object) -> int:
    r = _libc.syscall(ctypes.c_long(number), *args)
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return r


def stream_file(path: str, address: int, size: int, *, block: int, depth: int, write: bool) -> float:
    """Move `size` bytes between `path` and the memory at `address` (sequential, O_DIRECT) with `depth` requests
    of `block` bytes in flight; returns seconds (a write's fsync excluded, as libaio's sync_pwrite has none)."""
    calls = _SYSCALLS.get(platform.machine())
    if calls is None:
        raise OSError(f"kernel AIO probe: no syscall numbers for {platform.machine()}")
    io_setup, io_destroy, io_getevents, io_submit = calls
    ctx = ctypes.c_ulong(0)
    _syscall(io_setup, ctypes.c_uint(depth), ctypes.byref(ctx))
    fd = -1
    try:
        fd = os.open(path, (os.O_WRONLY | os.O_CREAT if write else os.O_RDONLY) | os.O_DIRECT, 0o600)
        iocbs = (IOCB * depth)()
        events = (IOEvent * depth)()
        free = list(range(depth))
        issued = done = 0
        t0 = time.perf_counter()
        while done < size:
            batch = []
            while free and issued < size:  # every free slot gets the next block of the file
                i = free.pop()
                cb = iocbs[i]
                n = min(block, size - issued)
                cb.aio_data, cb.aio_fildes, cb.aio_offset, cb.aio_nbytes = i, fd, issued, n
                cb.aio_lio_opcode = IOCB_CMD_PWRITE if write else IOCB_CMD_PREAD
                cb.aio_buf = address + issued
                issued += n
                batch.append(ctypes.pointer(cb))
            if batch:
                ptrs = (ctypes.POINTER(IOCB) * len(batch))(*batch)
                sent = _syscall(io_submit, ctx, ctypes.c_long(len(batch)), ptrs)
                if sent != len(batch):
                    raise OSError(f"io_submit took {sent} of {len(batch)} requests")
            got = _syscall(io_getevents, ctx, ctypes.c_long(1), ctypes.c_long(depth), events, None)
            for k in range(got):
                ev = events[k]
                if ev.res < 0:
                    raise OSError(-ev.res, os.strerror(-ev.res))
                cb = iocbs[ev.data]
                if ev.res != cb.aio_nbytes:
                    raise OSError(f"kernel AIO: {ev.res} of {cb.aio_nbytes} bytes at {cb.aio_offset}")
                done += ev.res
                free.append(ev.data)
        return time.perf_counter() - t0
    finally:
        if fd >= 0:
            os.close(fd)
        _syscall(io_destroy, ctx)
