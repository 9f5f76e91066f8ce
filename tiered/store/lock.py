"""One process per store folder: an advisory ``flock`` on ``<folder>/.lock`` that holds the owner's pid.

Why ``flock`` and not ``fcntl.lockf``: POSIX record locks belong to the process, so a second store on the
same folder *in the same process* would get the lock too, and closing either descriptor would drop it
for both. ``flock`` locks belong to the open file description: a second open, in this process or
another, is refused, and the kernel drops the lock when the holder dies, so a crash leaves no stale lock
to clean up (the file stays; its pid is a hint for the error message, and how ``workdir.reclaim_dead`` recognises
a folder an older tiered made: so its reclaim takes a dead run's lock with ``keep_pid``, which keeps the first line's
pid and writes the taker's on a second line; the error names the last line's, the holder's).

Links: the lock file is opened with O_NOFOLLOW and must be a plain file of one link, so a symbolic or
hard link planted at ``.lock`` (pointing at a file someone wants overwritten) raises ``OSError`` rather
than having its target truncated.

Creation is one step: a new lock file is made under a temporary name (``.lock.<random>``), locked, and
only then linked to ``.lock``, so no other process ever sees an unlocked ``.lock`` of a live store (a
sibling's ``workdir.reclaim_dead`` would take that folder for a dead run's and delete it).

Fork: a child forked while the lock is held shares its open file description, so an unlock there would drop
the parent's lock. The lock is released only in the process that took it (owner.py); in a child, ``release()``,
collection or exit close the child's copy of the descriptor and nothing else.

Call order: ``lock = FolderLock(folder)`` (raises ``StoreLockedError`` if held); ``lock.release()``
(idempotent), or use it as a context manager. A lock dropped unreleased is released when collected (a
finalizer holds the descriptor, not the lock). A lock may be handed to a ``TieredStore`` (its ``folder_lock``),
which uses it and leaves it held at close: an optimizer's private folder is locked from the moment it is made
(workdir.make_workdir) until it is removed, across every store built in it (``check_holds`` says whether the
lock handed in is this folder's, still held).

Other names: ``FolderLock(folder, name=...)`` locks ``<folder>/<name>`` the same way (its temporary name is
``<name>.<random>``); a checkpoint save holds one beside each hidden name it makes (tiered/checkpoint/hidden.py).
``lock_file_held(path)`` asks whether such a lock is held, in any process of any pid namespace, without taking it from
anyone: a shared lock, tried and dropped at once, so two lookers never take each other for a holder. Where it
cannot tell (a filesystem without flock, a file it may not open, not a plain file) it answers held: whoever asks
leaves alone what the lock guards, as ``workdir.reclaim_dead`` leaves a folder whose lock it cannot take.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import tempfile

from .owner import OwnedFinalizer

__all__ = ["FolderLock", "StoreLockedError", "LOCK_NAME", "LOCK_TEMP_PREFIX", "lock_file_held"]

LOCK_NAME = ".lock"
LOCK_TEMP_PREFIX = LOCK_NAME + "."  # a new lock file's name until it is locked and linked (``_create_locked``)
_ATTEMPTS = 100  # create or lock, while the name is taken and then gone under us


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
    """Holds ``<folder>/<name>`` (``.lock``) exclusively until ``release()``. The folder must exist.

    ``keep_pid``: a lock file already there keeps the pid on its first line, ours written after it (a new one gets
    ours alone), see the module doc."""

    def __init__(self, folder: str | os.PathLike[str], *, name: str = LOCK_NAME, keep_pid: bool = False):
        self.folder = os.fspath(folder)
        self.path = os.path.join(self.folder, name)
        for _ in range(_ATTEMPTS):
            try:
                fd = _lock_existing(self.folder, self.path, keep_pid)  # first: an unwritable folder still has its lock
                if fd is None:
                    fd = _create_locked(self.folder, self.path, name + ".")
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):  # bare from the kernel: no path, no fix
                    raise _disk_full(self.folder, self.path, e) from e
                raise
            if fd is not None:
                break
        else:  # each attempt found the name taken, then gone: someone keeps removing it
            raise OSError(errno.EAGAIN, f"the lock file {self.path} kept appearing and vanishing while it was "
                          "being taken: is something else cleaning this folder? Give the store another folder",
                          self.path)  # fmt: skip
        # The finalizer holds the descriptor, not the lock: it runs once, from release() or when collected. In a
        # forked child it only closes the child's copy: LOCK_UN there would drop the parent's lock (owner.py).
        self._release = OwnedFinalizer(self, _unlock, fd, elsewhere=os.close)

    @property
    def held(self) -> bool:
        """Not released yet (nor collected)."""
        return self._release.alive

    def check_holds(self, folder: str) -> None:
        """``ValueError`` unless this lock is still held and is ``folder``'s: a store handed it locks nothing
        itself, so a wrong or released lock would leave its folder free for a sibling to take for a dead run's."""
        if not self.held:
            raise ValueError(f"folder_lock {self.path!r} was released: a store needs its folder locked while open")
        if not _same_folder(self.folder, folder):
            raise ValueError(f"folder_lock is the lock of {self.folder!r}, not of the store's folder {folder!r}")

    def release(self) -> None:
        """Drop the lock (idempotent). The file stays: unlinking it would race with a new locker. In a forked
        child: closes the child's copy of the descriptor; the lock stays its parent's."""
        self._release()

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _create_locked(folder: str, path: str, prefix: str) -> int | None:
    """A new lock file at ``path``, already locked and holding our pid, as its descriptor; None if one exists.

    Made under a temporary name (``prefix``: ``LOCK_TEMP_PREFIX`` for ``.lock``), locked, then linked into place,
    so that a ``.lock`` anyone sees is locked from its first instant: ``workdir.reclaim_dead`` in a sibling process
    never finds a live optimizer's new lock file free, and so never takes its folder for a dead run's.
    """
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=folder)  # O_EXCL, O_NOFOLLOW: ours alone
    try:
        os.set_inheritable(fd, False)  # a subprocess we exec must not inherit (and so keep) the lock
        os.fchmod(fd, 0o644)  # others may read the pid, for their StoreLockedError
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else has this file: never refused
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        os.link(tmp, path)  # the commit: fails (EEXIST) if a lock file, or anything else, is there
    except BaseException as e:
        os.close(fd)
        if isinstance(e, FileExistsError):
            return None
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return fd


def _lock_existing(folder: str, path: str, keep_pid: bool) -> int | None:
    """Lock the lock file already at ``path``: its descriptor; None when it vanished meanwhile (try again)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _not_a_lock_file(path, errno.ELOOP, "is a symbolic link") from e
        raise
    try:
        # The lock first: a holder, even one between linking its new file and unlinking the temporary name
        # (two links for that instant), means "in use". Locking writes nothing, so a planted file is safe.
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _not_a_lock_file(path, errno.EINVAL, "is not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        links = os.fstat(fd).st_nlink
        if links == 0:  # unlinked since we opened it (a dead run's folder being reclaimed): look again
            os.close(fd)
            return None
        if links != 1:
            raise _not_a_lock_file(path, errno.EINVAL, f"has {links} hard links")
        if keep_pid:  # the first line stays (see the module doc); ours follows it, for whoever this lock refuses
            text = os.pread(fd, 32, 0).split(b"\n")[0] + f"\n{os.getpid()}\n".encode()
            os.pwrite(fd, text, 0)  # the first line rewritten as it was: never absent, even if killed here
            os.ftruncate(fd, len(text))
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as e:
        pid = _read_pid(fd)
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise StoreLockedError(folder, pid) from None
        raise
    return fd


def lock_file_held(path: str) -> bool | None:
    """Whether the lock file at ``path`` is held by a ``FolderLock`` (the module docstring); None: no such file.
    Takes nothing from a holder and leaves nothing held."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError:
        return True  # a link planted there, a file we may not read: cannot tell
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return True
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # refused only while someone holds it exclusively
    except OSError:  # EWOULDBLOCK: held; anything else (ENOLCK, EOPNOTSUPP: no flock here): cannot tell
        return True
    finally:
        os.close(fd)  # drops the shared lock, if taken
    return False


def _same_folder(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # either is gone: the folder the store opens is checked (and refused) on its own
        return os.path.abspath(a) == os.path.abspath(b)


def _unlock(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _not_a_lock_file(path: str, err: int, what: str) -> OSError:
    return OSError(err, f"the lock file {path} {what}: a store never follows or shares it (was it planted there?). "
                   "Remove it, or give the store another folder", path)  # fmt: skip


def _disk_full(folder: str, path: str, cause: OSError) -> OSError:
    # Worded as the store's other full-disk errors: the file, then the fix. Nothing new is left behind: the
    # temporary lock file goes in ``_create_locked``'s ``finally``.
    return OSError(cause.errno, f"the lock file {path} could not be written ({cause.strerror}): the disk holding "
                   f"the store folder {folder} is full. Free space there, or give the store another nvme_path",
                   path)  # fmt: skip


def _read_pid(fd: int) -> int | None:
    """The holder's pid: the last line (the second where the lock was taken with ``keep_pid``, the only one else)."""
    try:
        lines = os.pread(fd, 64, 0).decode("ascii", "replace").split()
        return int(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None
