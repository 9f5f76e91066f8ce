"""Folder operations that make a checkpoint appear atomically, and disappear safely.

The commit protocol (save.py drives it)::

    temp = hidden_name(path, "tmp")       .NAME.tmp-HOST-PID-RAND, next to the target (same filesystem)
    ... write the files into temp, fsync each, write manifest.json last, fsync it and temp ...
    commit(temp, path)                    rename(temp, path), or an atomic exchange when path exists: committed;
    fsync_dir(parent)                     the rename itself is durable (or CheckpointCommittedError); the old deleted

A reader only ever opens ``path``, which is either absent, the old complete checkpoint or the new
complete one, so a kill -9 at any moment leaves nothing half-written under a real name. It opens every file
once, through one descriptor of the folder, and reads those (reader.py), so a commit over ``path`` while it
reads leaves it reading the checkpoint it opened, whole. Leftovers
(hidden names of processes that are gone, or of this process's saves that have ended: ``hidden_name`` to ``ended``)
are removed by ``sweep`` at the start of the next save. A hidden name is in use while the flock on its lock file
beside it is held (``hidden.in_use``), which holds across pid namespaces and pid reuse: a save of another container
with this host name is never removed. A name with no lock file (an older version's) falls back to its pid: hidden.py
says how.

Overwriting: ``renameat2(RENAME_EXCHANGE)`` swaps the two folders in one step (Linux >= 3.15; ext4, xfs,
btrfs, tmpfs). Where the filesystem refuses it, the old folder is first renamed aside (``.NAME.old-...``),
the new one renamed in, the old deleted; a kill between the two renames leaves ``path`` missing and the
old checkpoint aside, and ``recover`` (called by save, load and latest_checkpoint) renames it back, unless
its saver's save is still in use (``hidden.in_use``: a save between its renames, left alone). A lock-less one of
this pid not made here goes back (a predecessor's, killed; a live one's commit finds its checkpoint there and
replaces it, as another save's). A reader that may not write
the folder (a read-only mount) reads the aside where it is instead (``readable``), and says so.

Reading a checkpoint's own files (no link followed, regular files only): ``regular_files.py``.

Deleting (``retire_folder``): rename to ``.NAME.deleting-...`` first, then ``rmtree``, so a half-deleted
folder never carries a checkpoint's name.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import signal
import time
import warnings
from collections.abc import Callable

from io_engine import fsync_dir

from ..interrupts import deferred_sigint
from .errors import CheckpointCommittedError, CheckpointError, CheckpointPathError
from .hidden import _HIDDEN, _HOST, LOCK_SUFFIX, ended, gone, hidden_name, in_use, stray_lock
from .manifest import MANIFEST
from .regular_files import read_manifest
from .validate import MAX_UNIX_TIME, loads

HOOK_ENV = "TIERED_CHECKPOINT_TEST_HOOK"
COMMIT_ROUNDS = 8  # commit's looks at the path; each more one means another save committed meanwhile
_HOOK_COUNTS: dict[str, int] = {}


def test_hook(point: str) -> None:
    """Crash-test hook, a no-op unless ``TIERED_CHECKPOINT_TEST_HOOK`` is set (tests only).

    ``trace:FILE`` appends each point's name to FILE; ``pause:SECONDS`` sleeps at every point (so a test can
    kill at random moments); ``kill:POINT:N`` sends SIGKILL to this process at the N-th pass through
    POINT. Several specs may be joined with ``;``.
    """
    spec = os.environ.get(HOOK_ENV)
    if not spec:
        return
    count = _HOOK_COUNTS[point] = _HOOK_COUNTS.get(point, 0) + 1
    for part in spec.split(";"):
        kind, _, arg = part.partition(":")
        if kind == "trace":
            with open(arg, "a") as f:
                f.write(f"{point}\n")
        elif kind == "pause":
            time.sleep(float(arg))
        elif kind == "kill":
            where, _, nth = arg.partition(":")
            if where == point and count == int(nth or 1):
                os.kill(os.getpid(), signal.SIGKILL)


SHARDS = "shards.json"  # a checkpoint sharded across ranks (sharded.py): the map, beside a checkpoint a rank
FIRST_PART = "rank-00000"


def is_checkpoint(path: str) -> bool:
    """A folder with a manifest: complete, because the manifest is written last and folders are renamed in.
    A checkpoint sharded across ranks counts too: its map is written last, and the folder renamed in whole."""
    if not os.path.isdir(path):
        return False
    return os.path.isfile(os.path.join(path, MANIFEST)) or os.path.isfile(os.path.join(path, SHARDS))


# ------------------------------------------------------------------------------------------ dating
def manifest_created(folder: str) -> float | None:
    """The save time a checkpoint's manifest states, or None when it cannot be read or makes no sense (such a
    folder is never resumed from, nor pruned). Not CRC-checked: it only orders candidates."""
    if os.path.isfile(os.path.join(folder, SHARDS)):  # sharded: its first part's manifest says when
        folder = os.path.join(folder, FIRST_PART)
    try:
        created = loads(read_manifest(folder), folder)["created_unix"]
    except (OSError, CheckpointError, KeyError, TypeError):
        return None
    if isinstance(created, bool) or not isinstance(created, (int, float)) or not 0 <= created <= MAX_UNIX_TIME:
        return None
    return float(created)


# ------------------------------------------------------------------------------------- durability
def makedirs_durable(path: str, target: str | None = None) -> None:
    """``os.makedirs``, and fsync of the parent of every folder it made, so their names survive a crash. A file
    where a folder should be is a NotADirectoryError naming it and ``target`` (what the folder is for)."""
    missing = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        missing.append(p)
        p = os.path.dirname(p)
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:  # made meanwhile by someone else: fine if it is a folder
            if not os.path.isdir(d):
                raise NotADirectoryError(
                    errno.ENOTDIR,
                    f"cannot make the folder of {target or path}: {d} is a file, not a folder; choose a path "
                    "under folders, or move the file away",
                    d,
                ) from None
        fsync_dir(os.path.dirname(d))


def write_file(path: str, data: bytes) -> None:
    """Write ``data`` to a new file and fsync it (small files: objects.pt, manifest.json)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


_libc: ctypes.CDLL | None
try:
    _libc = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - not on Linux/glibc
    _libc = None
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _renameat2_exchange(a: str, b: str) -> bool:
    """Swap two paths atomically. False when the kernel, libc or filesystem cannot (then use the fallback)."""
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) failed: {os.strerror(err)}", a, None, b)


exchange: Callable[[str, str], bool] = _renameat2_exchange  # tests replace it to exercise the fallback


def reserve(fd: int, nbytes: int) -> bool:
    """Allocate ``nbytes`` for a file now (fallocate), so a full disk shows before any data is written.

    Returns False where the filesystem cannot (then writes find out); raises OSError(ENOSPC) when full.
    Not ``os.posix_fallocate``: glibc emulates that by writing every block where the filesystem lacks it.
    """
    fn = getattr(_libc, "fallocate", None)
    if fn is None or nbytes <= 0:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if fn(fd, 0, 0, nbytes) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err))


def free_bytes(path: str) -> int:
    return shutil.disk_usage(path).free


# ----------------------------------------------------------------------------------------- commit
def commit(temp: str, path: str) -> None:
    """Make the complete folder ``temp`` appear as ``path``, durably, and delete the folder it replaced, if any.

    ``path`` must be absent, an empty folder or a checkpoint (save checks that before writing). Another save of
    the same path may commit between this one's look at ``path`` and its rename (every DDP rank saving after the
    same step, or two jobs): its checkpoint is then replaced as any earlier one is, so both saves succeed and the
    later one stays; likewise when ``path`` goes away between the look and an exchange.

    The rename or exchange that puts ``temp`` in is the commit point. A failure before it leaves ``path`` as it was
    (an old checkpoint moved aside is put back, whatever the exception) and ``temp`` holding the new checkpoint, for
    the caller to remove. After it the save has committed: a failed fsync of the folder is CheckpointCommittedError
    naming ``path``, which holds the new checkpoint; the replaced folder is deleted all the same, so nothing is
    left. A Ctrl-C is held throughout (``deferred_sigint``) and raised at the end, with ``temp`` gone.
    """
    parent = os.path.dirname(path) or "."
    with deferred_sigint():
        old = _put_in(temp, path)
        try:
            fsync_dir(parent)
        except OSError as e:
            why = f"the fsync of {parent} that makes it durable failed (a machine crash may lose it: check the disk)"
            raise CheckpointCommittedError(path, why, e) from e
        finally:  # committed: what ``old`` holds is the replaced checkpoint, whatever happened since
            test_hook("committed")
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
                ended(old)  # what rmtree could not remove: the next sweep does
                test_hook("old-removed")
            ended(temp)


def _put_in(temp: str, path: str) -> str | None:
    """``commit``'s rename or exchange (the module docstring). Returns the folder ``path`` held (swapped to
    ``temp``'s name, or moved aside), or None; raises with ``path`` as it was and the new checkpoint in ``temp``."""
    onto_empty = True
    for _ in range(COMMIT_ROUNDS):  # each turn round means another process committed or deleted ``path`` meanwhile
        empty = os.path.isdir(path) and not os.listdir(path)
        if not os.path.lexists(path) or (empty and onto_empty):
            try:
                os.rename(temp, path)  # onto nothing, or replacing an empty folder
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                # A checkpoint was committed there since the look, or the filesystem never lets a rename replace
                # a folder (some FUSE and network ones): either way, exchange with it or move it aside.
                onto_empty = False
                continue
            test_hook("renamed")
            return None
        try:
            if exchange(temp, path):
                test_hook("exchanged")
                return temp  # now holds the old checkpoint
        except FileNotFoundError:
            if not os.path.lexists(temp):
                raise
            continue  # ``path`` went away since the look
        aside = hidden_name(path, "old")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            ended(aside)
            continue  # as above
        try:
            test_hook("moved-aside")
            os.rename(temp, path)
        except BaseException as e:  # a KeyboardInterrupt or SystemExit too: the old checkpoint must not stay aside
            if isinstance(e, OSError) and e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                shutil.rmtree(aside, ignore_errors=True)  # replaced anyway; another save's checkpoint took its place
                ended(aside)
                continue
            ended(aside)  # the only copy of the old checkpoint: put back now, or by the next recover or sweep
            try:
                recover(path)
            except OSError:
                pass  # the rename's error says more
            raise
        test_hook("renamed")
        return aside
    raise CheckpointPathError(
        errno.EEXIST,
        f"could not put the checkpoint in place at {path!r}: after {COMMIT_ROUNDS} tries it still found the path "
        "taken (other saves committing there all the time, or a filesystem that refuses to replace folders): "
        "save to another path, or on a local filesystem",
        path,
    )


def left_aside(path: str) -> str | None:
    """The checkpoint an interrupted overwrite of the missing ``path`` left aside (``.NAME.old-...``, its saver
    gone), the newest where there are several; None when ``path`` exists or there is none."""
    parent, name = os.path.split(os.path.abspath(path))
    if os.path.lexists(path) or not os.path.isdir(parent):
        return None
    olds = []
    for entry in os.listdir(parent):
        m = _HIDDEN.match(entry)
        if not m or m["name"] != name or m["kind"] != "old" or not is_checkpoint(os.path.join(parent, entry)):
            continue
        if m["host"] == _HOST and in_use(parent, entry, same_pid=False):
            continue  # a save in progress, between its two renames: not ours to undo
        olds.append(entry)
    if not olds:
        return None
    # The newest aside is the last one committed before the crash (dated as latest_checkpoint dates: sharded too).
    newest = max(olds, key=lambda e: (manifest_created(os.path.join(parent, e)) or 0.0, e))
    return os.path.join(parent, newest)


def recover(path: str) -> bool:
    """``path`` is missing but an overwrite was interrupted between its two renames (its process is gone):
    put the old checkpoint back. Returns whether it did."""
    parent = os.path.dirname(os.path.abspath(path))
    aside = left_aside(path)
    if aside is None:
        return False
    try:
        os.rename(aside, path)
    except OSError as e:
        # Another process (every rank resuming at once) put it back (ENOENT) or a checkpoint at ``path`` (ENOTEMPTY).
        if e.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
            raise
        return False
    gone(aside)  # its lock file, free
    fsync_dir(parent)
    return True


NO_WRITE = (errno.EROFS, errno.EACCES, errno.EPERM)  # a folder this process may only read: no error for a reader


def put_back(path: str, stacklevel: int = 3) -> str | None:
    """``recover``, with a RuntimeWarning (``stacklevel``: at the caller's caller) when it put a checkpoint back.
    Where this process may not write the folder (a read-only mount, another user's run) the aside stays where it
    is: returned (``left_aside``), to be read there as the checkpoint of its name (``stuck_message`` says so).
    None otherwise."""
    try:
        restored = recover(path)
    except OSError as e:
        if e.errno not in NO_WRITE:
            raise
        return left_aside(path)
    if restored:
        warnings.warn(f"{path}: restored the previous checkpoint, which an interrupted save had moved aside",
                      RuntimeWarning, stacklevel=stacklevel)  # fmt: skip
    return None


def stuck_message(root: str, asides: list[str]) -> str:
    """What a reader says of the ``asides`` in ``root`` it reads where they are (``put_back`` could not)."""
    return (
        f"{root}: an interrupted save left {', '.join(map(os.path.basename, asides))} aside, which this process "
        "cannot rename back (no write access to the folder); it counts as the checkpoint of its name and loads from "
        "there. A process that may write the folder (the next save, load_checkpoint) puts it back"
    )


def readable(path: str) -> str:
    """Where the checkpoint ``path`` is read from: ``path``, an interrupted overwrite's aside put back under it first
    (``put_back``); or that aside, in place, where this process may not write the folder, with a RuntimeWarning
    (``stuck_message``, as ``latest_checkpoint`` warns). Every reader opens what this returns."""
    aside = put_back(path, stacklevel=4)
    if aside is None:
        return path
    warnings.warn(stuck_message(os.path.dirname(aside), [aside]), RuntimeWarning, stacklevel=3)
    return aside


def moved_aside(entry: str) -> str | None:
    """The name of the checkpoint whose old folder ``entry`` is (``.NAME.old-...``, commit's move aside), else None."""
    m = _HIDDEN.match(entry)
    return m["name"] if m and m["kind"] == "old" else None


def retire_folder(path: str) -> None:
    """Delete a checkpoint folder: renamed to a hidden name first, so no half-deleted checkpoint remains."""
    doomed = hidden_name(path, "deleting")
    try:
        os.rename(path, doomed)
        fsync_dir(os.path.dirname(path) or ".")
        test_hook("pruning")
        shutil.rmtree(doomed, ignore_errors=True)
    finally:
        ended(doomed)
    test_hook("pruned")


def sweep(parent: str) -> list[str]:
    """Remove the leftovers of saves on this host that are no longer in use (temp, aside and deleting folders, and
    the temporary files of ``TieredCheckpointIO``: all named by ``hidden_name``), with their lock files: those whose
    lock is free (their saver ended, or died), and, without a lock file, those whose pid is gone or this process's
    that have ended. A save under way in any process is left alone, whatever pid namespace it runs in, and so are
    lock-less names of this pid that this process did not make (hidden.py).

    An ``old`` aside whose checkpoint name is missing is restored (``recover``) instead. Returns what it removed.
    """
    removed: list[str] = []
    try:
        entries = os.listdir(parent)
    except FileNotFoundError:
        return removed
    for entry in entries:
        if stray_lock(parent, entry):  # a saver killed between removing its name and its lock file, or making it
            full = os.path.join(parent, entry)
            if entry.endswith(LOCK_SUFFIX):
                gone(full.removesuffix(LOCK_SUFFIX))
            else:  # the lock file's temporary name
                remove_tree(full)
            continue
        m = _HIDDEN.match(entry)
        if not m or m["host"] != _HOST or in_use(parent, entry):
            continue  # another host's, or a save under way (hidden.py)
        full = os.path.join(parent, entry)
        if m["kind"] == "old" and recover(os.path.join(parent, m["name"])):
            gone(full)
            continue
        if os.path.lexists(full):
            remove_tree(full)
            removed.append(full)
        gone(full)
    return removed


def remove_tree(path: str) -> None:
    """Delete a folder, or a file or link, a link not followed (rmtree refuses a link or a file, and ``ignore_errors``
    would hide that: a link swapped out by an older version's save stayed for good)."""
    if os.path.islink(path) or not os.path.isdir(path):
        try:
            os.unlink(path)
        except OSError:  # gone already, or not ours to delete (another user's, in a shared folder): as rmtree's
            pass
        return
    shutil.rmtree(path, ignore_errors=True)


def series_key(name: str) -> str:
    """The name with its last run of digits taken out: "step-300" and "step-400" are one series, "best" another,
    and "seed1-step-300" and "seed2-step-300" two more. Only the last number counts, because runs that share a
    folder often differ by a number of their own (a seed, an lr, a model size), and ``keep_last`` must never
    delete another run's checkpoints."""
    return re.sub(r"\d+(?=\D*$)", "#", name)
