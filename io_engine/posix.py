"""The plain POSIX side of every engine: request checks, whole-range pread/pwrite loops, fsync by path.

Shared by the threaded ``IOEngine`` and the ``SerialEngine`` twin, so that both check a request the same way.
"""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Any

from .buffers import HostBuffer, as_host_buffer
from .errors import IOEngineError, open_error

__all__ = ["O_DIRECT", "O_NOFOLLOW", "validate_request", "check_follow_symlinks", "pread_all", "pwrite_all",
           "fsync_path", "allocate"]  # fmt: skip

O_DIRECT = getattr(os, "O_DIRECT", 0)  # absent on macOS: "auto" then means buffered
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

try:  # Linux's fallocate(2); absent elsewhere (then nothing is allocated ahead)
    _fallocate: Any = ctypes.CDLL(None, use_errno=True).fallocate
    _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
except (OSError, AttributeError):
    _fallocate = None
# The filesystem cannot allocate ahead: the write proceeds as if it had not been asked.
_UNSUPPORTED = frozenset({errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL, errno.ENODEV})


def validate_request(buffer: Any, offset: int, nbytes: int | None, *, write: bool) -> tuple[HostBuffer, int]:
    """Shared boundary checks for every engine: returns the host buffer and the byte count."""
    hb = as_host_buffer(buffer, writable=not write)
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"offset must be an int, got {type(offset).__name__}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    n = hb.nbytes if nbytes is None else nbytes
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
    if n > hb.nbytes:
        raise ValueError(f"nbytes={n} exceeds the buffer's {hb.nbytes} bytes: pass a larger buffer or a smaller nbytes")
    return hb, n


def check_follow_symlinks(value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"follow_symlinks must be True or False, got {value!r}")
    return value


def pread_all(fd: int, view: memoryview, pos: int, path: str) -> int:
    """Read until ``view`` is full or the file ends; returns the bytes read."""
    done = 0
    while done < len(view):
        try:
            got = os.preadv(fd, [view[done:]], pos + done)
        except InterruptedError:
            continue
        except OSError as e:
            raise IOEngineError.from_oserror(e, path, pos + done, "read") from e
        if got == 0:
            break
        done += got
    return done


def pwrite_all(fd: int, view: memoryview, pos: int, path: str) -> None:
    done = 0
    while done < len(view):
        try:
            done += os.pwrite(fd, view[done:], pos + done)
        except InterruptedError:
            continue
        except OSError as e:
            raise IOEngineError.from_oserror(e, path, pos + done, "write") from e


def fsync_path(path: str, *, follow_symlinks: bool = True) -> None:
    """fsync one file by path (any descriptor of the file flushes all of its dirty pages)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | (0 if follow_symlinks else O_NOFOLLOW))
    except FileNotFoundError:
        return
    except OSError as e:
        raise open_error(e, path, 0, follow_symlinks=follow_symlinks) from e
    try:
        os.fsync(fd)
    except OSError as e:
        raise IOEngineError.from_oserror(e, path, 0, "fsync") from e
    finally:
        os.close(fd)


def allocate(fd: int, offset: int, nbytes: int) -> bool:
    """Allocate the blocks of ``[offset, offset + nbytes)`` of an open file, growing it to cover them
    (fallocate(2), mode 0). True when done; False where the filesystem (or the OS) cannot, and nothing changed.

    Why: on ext4 and XFS a direct write past the end of a file takes the inode's lock exclusively (it moves
    the size) and allocates as it goes, so the engine's parallel tasks of a fresh file write one at a time;
    into allocated blocks inside the size they run together (`bench/disk_probe.py --phases state`, 1 GiB on
    the development VM's ext4: 2.2 GB/s fresh, 3.3 GB/s allocated first). Not ``os.posix_fallocate``: glibc
    emulates that by writing zeros where the filesystem lacks it, which would write every byte twice.
    Raises OSError for a real failure (ENOSPC: the disk is full), so that a full disk shows before any byte
    of the write lands.
    """
    if _fallocate is None or nbytes <= 0:
        return False
    while True:
        if _fallocate(fd, 0, offset, nbytes) == 0:
            return True
        err = ctypes.get_errno()
        if err == errno.EINTR:
            continue
        if err in _UNSUPPORTED:
            return False
        raise OSError(err, os.strerror(err))
