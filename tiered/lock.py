"""One process per store folder: an advisory ``flock`` on ``<folder>/.lock`` that holds the owner's pid.

Why ``flock`` and not ``fcntl.lockf``: POSIX record locks belong to the process, so a second store on the
same folder *in the same process* would get the lock too, and closing either descriptor would drop it
for both. ``flock`` locks belong to the open file description: a second open, in this process or
another, is refused, and the kernel drops the lock when the holder dies, so a crash leaves no stale lock
to clean up (the file stays; its pid is only a hint for the error message).

Links: the lock file is opened with O_NOFOLLOW and must be a plain file of one link, so a symbolic or
hard link planted at ``.lock`` (pointing at a file someone wants overwritten) raises ``OSError`` rather
than having its target truncated.

Call order: ``lock = FolderLock(folder)`` (raises ``StoreLockedError`` if held); ``lock.release()``
(idempotent), or use it as a context manager. A lock dropped unreleased is released when collected (a
finalizer holds the descriptor, not the lock).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import weakref

__all__ = ["FolderLock", "StoreLockedError", "LOCK_NAME"]

LOCK_NAME = ".lock"


class StoreLockedError(OSError):
    """Another process (or another store in this process) holds the folder. ``pid`` says which one."""

    def __init__(self, folder: str, pid: int | None):
        if pid is None:
            who = "another process (its pid is unknown)"
        elif pid == os.getpid():
            who = f"this process (pid {pid}), through another TieredStore still open"
        else:
            who = f"process {pid}"
        message = (
            f"the store folder {folder!r} is in use by {who}. Close that store (or end that process) first, "
            "or give this one a different nvme_path"
        )
        super().__init__(errno.EWOULDBLOCK, message, os.path.join(folder, LOCK_NAME))
        self.folder = folder
        self.pid = pid
        self.message = message

    def __str__(self) -> str:
        return self.message


class FolderLock:
    """Holds ``<folder>/.lock`` exclusively until ``release()``. The folder must exist."""

    def __init__(self, folder: str | os.PathLike[str]):
        self.folder = os.fspath(folder)
        self.path = os.path.join(self.folder, LOCK_NAME)
        # O_CLOEXEC: a subprocess we exec must not inherit (and so keep) the lock.
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _not_a_lock_file(self.path, errno.ELOOP, "is a symbolic link") from e
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                what = "is not a regular file" if not stat.S_ISREG(st.st_mode) else f"has {st.st_nlink} hard links"
                raise _not_a_lock_file(self.path, errno.EINVAL, what)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            pid = _read_pid(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StoreLockedError(self.folder, pid) from None
            raise
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            os.close(fd)
            raise
        # The finalizer holds the descriptor, not the lock: it runs once, from release() or when collected.
        self._release = weakref.finalize(self, _unlock, fd)

    def release(self) -> None:
        """Drop the lock (idempotent). The file stays: unlinking it would race with a new locker."""
        self._release()

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _unlock(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _not_a_lock_file(path: str, err: int, what: str) -> OSError:
    return OSError(err, f"the lock file {path} {what}: a store never follows or shares it (was it planted there?). "
                   "Remove it, or give the store another folder", path)  # fmt: skip


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None
