"""File-level helpers of the disk benchmark: where a folder lives, O_DIRECT, and the page cache."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from tiered.calibration import filesystem_of

__all__ = ["filesystem_of", "direct_supported", "drop_cache", "preallocate"]


def direct_supported(folder: Path) -> bool:
    """Probe O_DIRECT once, up front, so the whole sweep runs in one known mode."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = folder / ".direct-probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    probe.unlink()
    return True


def drop_cache(path: str | os.PathLike) -> None:
    """Evict one file's pages from the page cache (what `echo 3 > drop_caches` does, for one file,
    without root). Under O_DIRECT it is a no-op safety; on tmpfs the cache is the storage, so the note
    says the figures are memory's."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def preallocate(path: str | os.PathLike, size: int) -> None:
    """Lay out a fresh file untimed: fio does the same before a write job, so the two compare."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
    finally:
        os.close(fd)
