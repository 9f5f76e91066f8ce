"""The files an IOEngine has open: one pair of descriptors a file in flight, shared by its requests.

``OpenFiles.acquire(owner, path, write, offset)`` sets ``owner.handle`` to a ``Handle`` it opens (or the one held,
while the path still names its file): an O_DIRECT descriptor where the filesystem takes it (``direct``: "auto" falls
back to buffered I/O with one warning, "on" refuses, "off" never asks) and a buffered one for unaligned heads and
tails. ``release(owner)`` after each request; the last closes it. The reference and ``owner.handle`` are taken and
given back in one step, where a Ctrl-C cannot land: an interrupted ``acquire`` leaves any reference it took on
``owner``, and ``release`` gives it back once however often it is called (engine.py's submit relies on both).
``allocate(h, offset, n)`` allocates the range a direct write would extend its file into (engine.py's docstring
says why). Any thread may call them.

``hold(path, fd)`` makes reads of ``path`` use the open file ``fd`` (a duplicate of it) until ``drop_held()``, with
no look at what ``path`` names meanwhile: a reader that opened several files together (a checkpoint's manifest and
its data) keeps reading those files while another process renames new ones into their place, where ``acquire``
would switch to the new file at its next request.
"""

from __future__ import annotations

import errno
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Protocol

from .config import IOConfig
from .errors import DirectIOUnsupportedError, open_error
from .posix import O_DIRECT, O_NOFOLLOW, allocate

__all__ = ["Handle", "Holder", "OpenFiles"]


@dataclass(eq=False)
class Handle:
    """Open descriptors of one file (one inode), shared by every request in flight on it.

    Sharing keeps the descriptors in use bounded by the files in flight, not by the requests: a
    thousand queued reads of one file hold two descriptors, not two thousand.
    """

    key: tuple[str, bool]
    inode: int
    fd_direct: int  # -1 where the filesystem refused O_DIRECT (or direct="off")
    fd_buffered: int
    refs: int = 0
    held: bool = False  # by ``OpenFiles.hold``: the path is not looked at again

    def close(self) -> None:
        for fd in (self.fd_direct, self.fd_buffered):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass


class Holder(Protocol):
    """What holds a reference on a ``Handle`` (a request): ``handle`` is set and cleared by ``OpenFiles`` only."""

    handle: Handle | None


class OpenFiles:
    def __init__(self, config: IOConfig, follow_symlinks: bool):
        self.direct, self.follow_symlinks = config.direct, follow_symlinks
        self._lock = threading.Lock()
        self._handles: dict[tuple[str, bool], Handle] = {}
        self._warned_buffered = False
        self._no_allocate: set[int] = set()  # st_dev of filesystems that refused fallocate: not asked again

    def acquire(self, owner: Holder, path: str, write: bool, offset: int) -> None:
        """Set ``owner.handle`` to the open descriptors of ``path`` for reading or writing: the ones held already if
        the path still names their file, else opened anew (``offset``: for an error's message). Each reference is
        counted and set on ``owner`` with nothing in between where an interrupt could land."""
        key = (path, write)
        with self._lock:
            h = self._handles.get(key)
            if h is not None and h.held:
                h.refs += 1
                owner.handle = h
                return
            if h is not None:
                try:
                    st = os.stat(path) if self.follow_symlinks else os.lstat(path)
                    same = st.st_ino == h.inode
                except OSError:
                    same = False
                if same:  # the path still names the inode we hold open
                    h.refs += 1
                    owner.handle = h
                    return
        # Each descriptor opened, closed here if anything (a Ctrl-C included) stops acquire before the handle holding
        # them is stored. Left open: one whose os.open returned as a press landed, before its number reached ``fds``
        # (a handler runs as a builtin returns; Python code cannot close that window).
        fds: list[int] = []
        try:
            fd_direct, fd_buffered = self._open(path, write, offset, fds)
            h = Handle(key, os.fstat(fd_buffered).st_ino, fd_direct, fd_buffered, refs=1)
            with self._lock:
                old = self._handles.get(key)
                # Stored, set on owner and forgotten here with no call in between, where no handler runs.
                self._handles[key] = h  # a replaced handle lives on until its own requests finish
                owner.handle = h
                fds = []
                if old is not None and old.refs == 0:
                    old.close()
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def hold(self, path: str, fd: int) -> None:
        """Serve reads of ``path`` from the open file ``fd`` (duplicated: the caller keeps its own) until
        ``drop_held``. Its O_DIRECT descriptor is opened through /proc/self/fd, which names ``fd``'s file even once
        it is unlinked; where that cannot be (no /proc, a filesystem without O_DIRECT), reads go buffered."""
        key = (path, False)
        fd_buffered = os.dup(fd)
        fd_direct = -1
        if self.direct != "off" and O_DIRECT:
            try:
                fd_direct = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | O_DIRECT | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                if self.direct == "on":
                    os.close(fd_buffered)
                    raise
        h = Handle(key, os.fstat(fd_buffered).st_ino, fd_direct, fd_buffered, refs=1, held=True)
        with self._lock:
            old = self._handles.get(key)
            self._handles[key] = h
            if old is not None and old.refs == 0:
                old.close()
            elif old is not None and old.held:  # held twice: the first hold's reference goes with it
                self._unref(old)

    def drop_held(self) -> None:
        """Give up every ``hold``; each descriptor closes once the requests still on it finish."""
        with self._lock:
            for h in [h for h in self._handles.values() if h.held]:
                self._unref(h)

    def _unref(self, h: Handle) -> None:
        h.refs -= 1
        if h.refs == 0:
            self._close(h)

    def _close(self, h: Handle) -> None:
        if self._handles.get(h.key) is h:
            del self._handles[h.key]
        h.close()

    def release(self, owner: Holder) -> None:
        """Give back ``owner``'s reference, if it holds one (a second call finds none); the last one closes the
        file. Cleared and counted down with no call in between: an interrupt leaves the reference held or gone."""
        with self._lock:
            h, owner.handle = owner.handle, None
            if h is not None:
                h.refs -= 1
                if h.refs == 0:
                    self._close(h)

    def _open(self, path: str, write: bool, offset: int, fds: list[int]) -> tuple[int, int]:
        """The O_DIRECT (-1 if none) and buffered descriptors of ``path``, each appended to ``fds`` as it opens: the
        caller closes them if it is stopped before it holds them."""
        mode = self.direct
        follow = self.follow_symlinks
        flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
        flags |= getattr(os, "O_CLOEXEC", 0) | (0 if follow else O_NOFOLLOW)
        fd_direct = -1
        if mode != "off" and O_DIRECT:
            try:
                fd_direct = os.open(path, flags | O_DIRECT, 0o644)
                fds.append(fd_direct)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise open_error(e, path, offset, follow_symlinks=follow) from e
                if mode == "on":
                    raise DirectIOUnsupportedError(
                        errno.EINVAL,
                        "this filesystem refuses O_DIRECT (ramfs, some FUSE mounts, tmpfs before Linux 6.6): "
                        "use direct='auto' or 'off', or a folder on a real disk",
                        path,
                        offset,
                    ) from e
                self._warn_buffered(path)
        elif mode == "on":
            raise DirectIOUnsupportedError(errno.EINVAL, "O_DIRECT is not available on this OS", path, 0)
        # The buffered descriptor serves unaligned heads and tails (and everything without O_DIRECT).
        try:
            fd_buffered = os.open(path, flags, 0o644)
        except OSError as e:  # the O_DIRECT descriptor, in ``fds``, is the caller's to close
            raise open_error(e, path, offset, follow_symlinks=follow) from e
        fds.append(fd_buffered)
        return fd_direct, fd_buffered

    def allocate(self, h: Handle, offset: int, n: int) -> int:
        """Allocate the part of ``[offset, offset + n)`` past the end of the file (engine.py's docstring says why);
        returns the bytes allocated."""
        st = os.fstat(h.fd_buffered)
        end = offset + n
        if end <= st.st_size or st.st_dev in self._no_allocate:
            return 0
        start = max(offset, st.st_size)  # a hole before ``offset`` stays a hole, as the write leaves it
        if allocate(h.fd_buffered, start, end - start):
            return end - start
        self._no_allocate.add(st.st_dev)
        return 0

    def _warn_buffered(self, path: str) -> None:
        if not self._warned_buffered:
            self._warned_buffered = True
            warnings.warn(
                f"{path}: the filesystem refuses O_DIRECT; falling back to buffered I/O (the page cache may "
                "inflate read bandwidth). Pass IOConfig(direct='off') to silence this.",
                RuntimeWarning,
                stacklevel=4,
            )
