"""The hidden names beside a checkpoint (``.NAME.KIND-HOST-PID-RAND``: temp, aside and deleting folders, and the
temporary files of ``TieredCheckpointIO``), the lock that says one is in use, and which of them this process made.

A name in use is locked: ``hidden_name`` takes an flock on ``<hidden name>.lock`` beside it (store/lock.py's
``FolderLock``, made locked from its first instant, before the name itself exists) and holds it until ``ended``.
The kernel drops an flock with its process, and an flock means the same in every pid namespace, so ``in_use`` (what
``fsops.sweep`` and ``fsops.left_aside`` ask) needs no pid: a save in a container that shares this host name
(``--network=host``) but not its pids is never taken for dead, and a dead save whose pid another process now has is
never taken for alive. A name whose lock is free is a leftover any process may remove, and its lock file with it.

A name with no lock file beside it was left by a version of tiered older than these locks, or made on a
filesystem where flock is refused (Lustre mounted without ``flock``; ``held`` cannot tell there, and a lock file
that cannot be tested counts as held). For those the pid rule stays: in use while its pid is alive on this host.
Its own pid alone does not make such a name this process's: a container's first process has the same pid at every
start (a killed predecessor's names carry it), and two containers that share a host name may both run as that pid.
So this process counts the names it made itself (``hidden_name``), under way until ``ended``, and answers for
them before any lock or pid is looked at; a lock-less name of its pid that it did not make is never removed (it may
be another live process's save, or the only copy of a checkpoint an interrupted overwrite left aside).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket

from ..store.lock import FolderLock, lock_file_held
from .errors import CheckpointPathError

_HOST = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"
_HIDDEN = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old|deleting)-(?P<host>[A-Za-z0-9]+)-(?P<pid>\d+)-[0-9a-f]+$")
LOCK_SUFFIX = ".lock"  # a hidden name's lock file: the name and this, beside it
_LOCK_FILE = re.compile(r"^(?P<hidden>\..+)\.lock(?P<temp>\.[A-Za-z0-9_]+)?$")  # temp: FolderLock's name while made
NAME_MAX = 255  # bytes of one name, on every filesystem Linux mounts for data
# What hidden_name adds to a name at most: ".", ".deleting-", the host, "-", a 7-digit pid, "-", 8 hex digits; and
# the lock file beside it: ".lock", and while it is made, "." and 8 characters.
HIDDEN_EXTRA = len(f"..deleting-{_HOST}-{9999999}-{'f' * 8}{LOCK_SUFFIX}.{'x' * 8}")
# The names (their last component) this process made: a save, commit or deletion under way (``hidden_name`` to
# ``ended``), left by ``sweep``; and those whose save has ended but that are still on disk (a failed rmtree, a
# collective save whose peer died), which the next ``sweep`` removes. Names of its pid it did not make are in neither.
_UNDER_WAY: set[str] = set()
_ENDED_HERE: set[str] = set()
_LOCKS: dict[str, FolderLock] = {}  # the locks of the names under way (none where the filesystem refused one)


def check_target(path: str) -> None:
    """What a save refuses at ``path`` before it makes anything: a symbolic link (the commit would swap the link
    out, not write where it points, and leave it behind under a hidden name), and a name too long for the hidden
    names beside it (its temp folder would fail with ENAMETOOLONG)."""
    if os.path.islink(path):
        raise CheckpointPathError(
            f"{path} is a symbolic link (to {os.readlink(path)}); a save neither replaces a link nor writes through "
            "it: save to the folder it points to (os.path.realpath), or remove the link first"
        )
    name = os.fsencode(os.path.basename(path))
    if len(name) > NAME_MAX - HIDDEN_EXTRA:
        raise ValueError(
            f"the checkpoint name {os.path.basename(path)[:40]!r}... ({path}) is {len(name)} bytes: a save needs "
            f"names of at most {NAME_MAX - HIDDEN_EXTRA} bytes (the filesystem's {NAME_MAX}, less room for the "
            "temporary names it makes beside the checkpoint); choose a shorter name"
        )


def hidden_name(path: str, kind: str) -> str:
    """``parent/.NAME.KIND-HOST-PID-RAND``: a sibling no reader takes for a checkpoint, its lock held (the module
    docstring). Under way, so that ``sweep`` leaves it, until ``ended``: every path out of its save, the failed
    ones too, must call ``ended``. The caller makes the name itself (mkdir, a rename, a file)."""
    parent, name = os.path.split(path)
    hidden = f".{name}.{kind}-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}"
    _UNDER_WAY.add(hidden)
    try:
        _LOCKS[hidden] = FolderLock(parent or ".", name=hidden + LOCK_SUFFIX)
    except OSError:
        # No lock here (flock refused, the folder missing or full): the pid rule covers the name, and making the
        # name itself fails with the save's own error where the folder cannot be written.
        pass
    return os.path.join(parent, hidden)


def ended(path: str) -> None:
    """The save, commit or deletion that named ``path`` by ``hidden_name`` is over (done, or failed): whatever is
    still there under that name is a leftover, which the next ``sweep`` removes, in this process or any other
    (its lock is free); where nothing is left, the lock file goes too."""
    name = os.path.basename(path)
    if name in _UNDER_WAY:
        _UNDER_WAY.discard(name)
        lock = _LOCKS.pop(name, None)
        if os.path.lexists(path):
            _ENDED_HERE.add(name)
        if lock is not None:
            lock.release()
            gone(path)


def gone(path: str) -> None:
    """``path``, a hidden name no longer in use, was removed (by ``sweep``, or put back as a checkpoint): nothing of
    this process's is left under it, and its lock file (free) goes."""
    if not os.path.lexists(path):
        _ENDED_HERE.discard(os.path.basename(path))
        with contextlib.suppress(OSError):
            os.unlink(path + LOCK_SUFFIX)


def in_use(parent: str, entry: str, *, same_pid: bool = True) -> bool:
    """Whether the hidden name ``entry`` (of this host) in ``parent`` is a save, commit or deletion under way, in
    this process or another, that no one may touch (the module docstring says how each is told). ``same_pid``: the
    answer for a lock-less name of this pid that this process did not make (True for ``sweep``, which never deletes
    it; False for ``recover``, since putting an aside back harms no live commit: it replaces it again)."""
    if entry in _UNDER_WAY or entry in _ENDED_HERE:
        return entry in _UNDER_WAY
    locked = lock_file_held(os.path.join(parent, entry + LOCK_SUFFIX))
    if locked is not None:
        return locked
    pid = int(_HIDDEN.match(entry)["pid"])  # type: ignore[index]  # the caller matched it
    return same_pid if pid == os.getpid() else _pid_alive(pid)  # an older version's name, or no flock here


def stray_lock(parent: str, entry: str) -> bool:
    """``entry`` in ``parent`` is the lock file of a hidden name of this host that is gone, and free: what a saver
    killed between removing its name and its lock file left. Or the temporary name a lock file is made under
    (``FolderLock``'s), free, of a saver whose pid is gone: one killed while it made its lock file. (That name is
    unlocked for an instant while a live saver makes it, so the pid decides: a saver of another pid namespace
    making its lock at that instant is the one case this could take, and its save would then fail, not lose.)"""
    m = _LOCK_FILE.match(entry)
    if m is None or m["temp"] is None and os.path.lexists(os.path.join(parent, m["hidden"])):
        return False
    name = _HIDDEN.match(m["hidden"])
    if name is None or name["host"] != _HOST or m["hidden"] in _UNDER_WAY:
        return False
    if m["temp"] is not None and (int(name["pid"]) == os.getpid() or _pid_alive(int(name["pid"]))):
        return False
    return lock_file_held(os.path.join(parent, entry)) is False


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process in this pid namespace: only for names without a lock file."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
