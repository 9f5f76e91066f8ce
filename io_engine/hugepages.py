"""Host memory for direct I/O (the buffer pool's blocks, ``aligned_empty``): a private anonymous mapping, from a
2 MiB boundary, in transparent huge pages where the kernel gives them, wiped in forked children. Not the slabs
(slab.py), whose bytes move only between host and GPU: they stay shared mappings, which a child reads.

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
is in 4 KiB pages, private, and nothing fails. Only the whole 2 MiB pages inside the buffer are advised huge; every
other byte of the mapping (the head before the boundary, a partial tail, the padding past it, a buffer below 2 MiB)
is advised ``MADV_NOHUGEPAGE``, since transparent huge pages ``always`` (RHEL's default) gives huge pages to any
anonymous range not so advised: a partial tail holding a 2 MiB-aligned range of the mapping would fault in a whole
huge page. So a buffer takes the bytes it asked for. ``TIERED_HUGE_PAGES=0`` (or ``false``, ``off``, ``no``) in the
environment turns the advice off: the whole mapping ``MADV_NOHUGEPAGE``, so off under ``always`` too (the memory
stays private, wiped on fork); ``1``, ``true``, ``on``, ``yes`` or empty leave it on, any other value raises.
A buffer of whole 2 MiB pages is mapped at its size (the kernel, from Linux 6.7 on, starts it on a 2 MiB
boundary); another one of 2 MiB or more, or one the kernel placed off a boundary, is mapped up to 2 MiB - 4 KiB
longer and used from the first boundary. Those extra bytes are never touched, so they take no memory, only address
space (what ``ulimit -v`` and ``vm.overcommit_memory=2``'s commit limit count); where that longer mapping does not
fit there, the buffer is mapped at its size, as Python's mapping would fit, and used from its start: only the whole
2 MiB pages that happen to lie on boundaries inside it are advised huge.

Fork: a private mapping would be copied into a forked child (a DataLoader worker, a helper): pages page-locked for
DMA (``cudaHostRegister``) eagerly at the fork, the rest on write, so a long-lived child would double the memory of
every buffer the parent rewrites. Leaving it out of the child (``MADV_DONTFORK``) leaves a hole there that the
child's own allocations can take and then lose when the child drops its copy of the parent's mmap object (its
close unmaps the range). So every mapping is ``MADV_WIPEONFORK`` (Linux 4.14): the child gets the same range as
fresh zero-filled memory of its own, and fork copies none of its pages. A forked child reads zeros from the
parent's buffers, never the parent's data: from a store's records in host memory (``store.pin()``'s tensor), an
optimizer's state chunks and staging, a ``TieredCache``'s pages in host memory, an ``aligned_empty`` buffer. A
tensor handed out from them that a child is to read must be cloned before the fork; tiered refuses every call on
a parent's optimizer, cache or store in a child anyway (README, "a child forked from the process"). Where the
kernel refuses the advice (before 4.14, or not Linux) the buffer is a shared mapping as before: slower, but a child
then shares it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

from .align import PAGE

__all__ = ["HUGE_PAGE", "ENV_VAR", "from_env", "host_mmap"]

HUGE_PAGE = 2 << 20
ENV_VAR = "TIERED_HUGE_PAGES"
_HUGE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
_NOT_HUGE = getattr(mmap, "MADV_NOHUGEPAGE", None)
# Linux's number (uapi mman-common.h); Python's mmap module does not export it. Asked only on Linux: elsewhere
# 18 may be another advice.
_WIPEONFORK = getattr(mmap, "MADV_WIPEONFORK", 18) if sys.platform.startswith("linux") else None


_OFF = ("0", "false", "off", "no")
_ON = ("1", "true", "on", "yes", "")


def from_env() -> bool:
    """$TIERED_HUGE_PAGES: off for 0/false/off/no, on for 1/true/on/yes, empty or unset (any case, spaces around).
    Anything else raises ValueError, as a bad $TIERED_IO_CONFIG does (``IOConfig.from_env``): a typo would otherwise
    leave them on without a word. Every buffer made reads it; a command line tool checks it up front, where it checks
    ``IOConfig.from_env()``, to say a bad value in one line rather than a traceback from its first buffer."""
    raw = os.environ.get(ENV_VAR, "")
    value = raw.strip().lower()
    if value in _OFF or value in _ON:
        return value not in _OFF
    raise ValueError(
        f"${ENV_VAR}={raw!r} is neither on nor off: {', '.join(_OFF)} turn huge pages off; "
        f"{', '.join(_ON[:-1])}, empty or unset leave them on"
    )


def host_mmap(nbytes: int) -> tuple[mmap.mmap, int]:
    """A mapping with ``nbytes`` usable from the returned offset (the module docstring): private and wiped in
    forked children, from a 2 MiB boundary with its whole 2 MiB pages advised as huge where ``nbytes`` holds one
    (from offset 0 where the padding does not fit), no other byte of it huge; where the kernel refuses to wipe it
    on fork, a shared mapping at offset 0, as before."""
    size = max(nbytes, 1)
    wanted = from_env()  # first, for every buffer: a bad value raises at the first one, not at the first big one
    if _WIPEONFORK is None:
        return mmap.mmap(-1, size), 0
    huge = nbytes >= HUGE_PAGE and wanted
    mm, offset = _private(size), 0
    if huge and (offset := _to_boundary(mm)):
        mm.close()
        try:
            mm = _private(size + HUGE_PAGE - PAGE)
        except OSError:  # ENOMEM: no room for the padding (ulimit -v, the commit limit); the buffer alone may fit
            mm, offset = _private(size), 0
        else:
            offset = _to_boundary(mm)
    try:
        mm.madvise(_WIPEONFORK)
    except OSError:  # EINVAL: a kernel before 4.14. Shared, as before, rather than copied into children
        mm.close()
        return mmap.mmap(-1, size), 0
    lo = _to_boundary(mm)  # the buffer's first boundary: ``offset``, unless the padding did not fit
    whole = (offset + nbytes - lo) // HUGE_PAGE * HUGE_PAGE if huge and lo < offset + nbytes else 0
    _advise(mm, lo, lo + whole)
    return mm, offset


def _advise(mm: mmap.mmap, lo: int, hi: int) -> None:
    """Bytes ``[lo, hi)`` of ``mm`` (whole 2 MiB pages on boundaries, or none) huge, every other byte not."""
    if hi <= lo:
        lo = hi = 0
    for advice, start, end in ((_HUGE, lo, hi), (_NOT_HUGE, 0, lo), (_NOT_HUGE, hi, len(mm))):
        if advice is not None and end > start:
            try:
                mm.madvise(advice, start, end - start)
            except OSError:  # a kernel built without transparent huge pages: 4 KiB pages, as the advice allows
                pass


def _private(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # type: ignore[attr-defined]


def _to_boundary(mm: mmap.mmap) -> int:
    """Bytes from the mapping's start to the next 2 MiB boundary."""
    anchor = ctypes.c_char.from_buffer(mm)  # an export of the buffer: dropped at once, so close() stays possible
    try:
        return -ctypes.addressof(anchor) % HUGE_PAGE
    finally:
        del anchor
