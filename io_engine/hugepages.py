"""Host memory for direct I/O: a private anonymous mapping from a 2 MiB boundary, in transparent huge pages where
the kernel gives them.

Why: a direct read or write pins the buffer's pages for the disk each time. Python's ``mmap.mmap(-1, n)`` is a
*shared* mapping (shmem, which the kernel's default ``shmem_enabled=never`` keeps in 4 KiB pages); from such
buffers the engine moved data at two thirds of the rate it reached from private anonymous memory, and from
private memory advised into 2 MiB pages (one segment a 1 MiB task, where 4 KiB pages make 256, more than a virtio
disk takes in one request: ``max_segments`` 254) at the most. Same engine, 1 MiB tasks over 64 threads, one 1 GiB
file, four interleaved rounds on the development VM (bench/RESULTS.md, forty-first session): shared 2.2-2.7 GB/s
written, 1.34-1.72 read; private 2.6-4.7 / 2.05-2.7; private in huge pages 3.4-4.7 / 2.06-2.79. On an H100
machine the engine wrote 1.19x libaio's best from torch's pinned memory while `tiered-bench io`, from the buffer
pool's shared mappings, wrote 0.87x.

``madvise(MADV_HUGEPAGE)`` asks, it does not force: with transparent huge pages ``never`` (or none free) the memory
is in 4 KiB pages, private, and nothing fails. Only whole 2 MiB pages inside the buffer are advised, so a buffer
takes the bytes it asked for (no huge page is faulted in for a partial tail). ``TIERED_HUGE_PAGES=0`` in the
environment turns the advice off.

Fork: a private mapping is copied on write into a forked child (a DataLoader worker), not shared. Pages pinned for
DMA (``cudaHostRegister``) would be copied eagerly at the fork, the whole pinned state again in each child, so a
mapping that is to be pinned is left out of forked children (``MADV_DONTFORK``, as RDMA libraries do for their
registered memory): a child never reads the optimizer's pinned buffers.
"""

from __future__ import annotations

import ctypes
import mmap
import os

__all__ = ["HUGE_PAGE", "ENV_VAR", "host_mmap"]

HUGE_PAGE = 2 << 20
ENV_VAR = "TIERED_HUGE_PAGES"
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
_DONTFORK = getattr(mmap, "MADV_DONTFORK", None)
_PRIVATE = getattr(mmap, "MAP_PRIVATE", None)  # absent on Windows, where mmap.mmap(-1, n) is private already


def _wanted() -> bool:
    return os.environ.get(ENV_VAR, "1").strip() != "0"


def _anonymous(nbytes: int) -> mmap.mmap:
    if _PRIVATE is None:
        return mmap.mmap(-1, nbytes)
    return mmap.mmap(-1, nbytes, flags=_PRIVATE | mmap.MAP_ANONYMOUS)


def host_mmap(nbytes: int, *, pinned: bool = False) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping with ``nbytes`` usable from the returned offset: a 2 MiB boundary, its whole
    2 MiB pages advised as huge, where ``nbytes`` holds one; else offset 0. The mapping is up to 2 MiB longer than
    asked; those bytes are never touched, so they take no memory. ``pinned``: the caller will page-lock it, so it
    is left out of forked children (the module docstring)."""
    if nbytes < HUGE_PAGE or _ADVICE is None or not _wanted():
        mm, offset = _anonymous(max(nbytes, 1)), 0
    else:
        mm = _anonymous(nbytes + HUGE_PAGE)
        anchor = ctypes.c_char.from_buffer(mm)  # an export of the buffer: dropped at once, so close() stays possible
        offset = -ctypes.addressof(anchor) % HUGE_PAGE
        del anchor
        _advise(mm, _ADVICE, offset, nbytes // HUGE_PAGE * HUGE_PAGE)
    if pinned and _DONTFORK is not None:
        _advise(mm, _DONTFORK, 0, len(mm))
    return mm, offset


def _advise(mm: mmap.mmap, advice: int, start: int, length: int) -> None:
    try:
        mm.madvise(advice, start, length)
    except OSError:  # a kernel without the feature (built without transparent huge pages): as before
        pass
