"""The optimizer's private working folder under the user's ``nvme_path`` root, and reclaiming dead runs' folders.

Layout::

    nvme_path/                       # the root the user names; shared by every optimizer that names it
    nvme_path/tiered-<tag>-<random>/ # one per live optimizer: made with mkdtemp (mode 0700, O_EXCL), so it
                                     # is ours alone; a TieredStore folder (.lock, index.json, records/)
                                     # and WORKDIR_MARK (.tiered-workdir), which says it is such a folder

Why a private folder each: several optimizers in one process (a resumed HF Trainer, a second Lightning
``fit()``, one optimizer per parameter) or several ranks share one ``nvme_path``; and a folder that
someone else could have made (and planted links in) is never reused.

Locked for its whole life: ``make_workdir`` takes the folder's lock (lock.py) right after ``mkdtemp`` and hands
it to the caller, who passes it to each store it opens there (``TieredStore(folder, folder_lock=lock)``) and
releases it only once the folder is removed. So the folder is locked while the caller measures the disk before
its first store (calibration.py: a 1 GiB file, and up to 30 s waiting for another process's measurement) and
between the stores an optimizer builds when it lays its state out again (optim/param_set.py): neither is ever
taken for a dead run's by a sibling starting on the root, nor left unreclaimed by a run killed then.

A run killed with SIGKILL leaves its folder behind. Its ``.lock`` is an flock, which the kernel dropped with
the process, so the next optimizer under the same root finds a folder whose lock it can take: that folder
is reclaimed (deleted) before the free-space check, so a restart on a tight disk is not refused for space
that only dead files hold. A folder is reclaimed only when make_workdir made it, is ours (our uid, a real
directory, not a link) and holds nothing but a store's own files; anything else is left alone. A folder with no
``.lock`` is one whose maker is between ``mkdtemp`` and linking its lock file (microseconds), so it is left alone
too: a run killed in that instant leaves a folder holding only its marker.

Made by make_workdir: the root is the user's, and so may be a folder of the user's own stores; a closed
``TieredStore`` named ``tiered-...`` there has a free lock and only a store's files too, and is no dead run's.
So make_workdir writes ``WORKDIR_MARK`` into the folder before its lock, and it is removed just before the lock
file; a folder is a run's when it holds that file. Folders made before the marker existed (a run of an older tiered
killed, leaving a whole state on the disk) are recognised by what make_workdir gave them: the name
``tiered-[rank<r>-]<pid>-<8 random>`` (``folder_tag``'s, mkdtemp's) and that same pid in the lock file, which
make_workdir's lock wrote and nobody rewrote since (taking a lock writes the taker's pid), and by an index that
lists no record, or none: a run never flushes its store, so its records are in files no index lists, which a
TieredStore opening the folder would remove itself (index.reclaim_leftovers). A user's store can have that name
and pid (named ``tiered-<its pid>-<8 hex>``, the last process to open it wrote its pid), but then is deleted only
when it holds no record: a store holding records is never deleted. A reclaim takes the lock keeping that pid on
the first line (``keep_pid``; its own follows, for whoever it refuses meanwhile): one killed part-way, the marker
already removed or never there, leaves a folder the next start still recognises. It removes the whole folder
before it releases that lock, as ``remove_workdir`` does: a store opened on it meanwhile is refused, or, once the
lock file is unlinked, makes its own and keeps the folder.

Call order: ``folder, lock = make_workdir(root, tag)`` (reclaims first); ``TieredStore(folder,
folder_lock=lock)``, as many in turn as the caller needs; ``remove_workdir(folder, lock)`` after the last store
is closed (the folder emptied under the lock, then the lock released).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import stat
import tempfile

import torch

from ..telemetry import CALIBRATE_NAME
from .lock import LOCK_NAME, LOCK_TEMP_PREFIX, FolderLock, StoreLockedError

__all__ = ["PREFIX", "EXPORT_PREFIX", "WORKDIR_MARK", "make_workdir", "remove_workdir", "reclaim_dead", "default_root",
           "folder_tag", "mapped_empty", "file_in_the_way"]  # fmt: skip

PREFIX = "tiered-"
EXPORT_PREFIX = "state_dict-"  # state_dicts.py's backing files, unlinked as soon as they are mapped
ENV_ROOT = "TIERED_NVME_PATH"
WORKDIR_MARK = ".tiered-workdir"  # in every folder make_workdir makes: only such folders are ever reclaimed
_MARK_TEXT = (b"A private working folder of a TieredOptimizer or TieredCache (tiered). Removed when it closes; if\n"
              b"its process was killed, the next one started on this root removes it.\n")  # fmt: skip
_OLD_RUN_NAME = re.compile(re.escape(PREFIX) + r"(?:rank\d+-)?(\d+)-[a-z0-9_]{8}")  # before the marker: see the doc
_INDEX = "index.json"  # index.py's INDEX_FILE (index.py imports this module)
_EMPTY_INDEX_MAX = 4096  # bytes: an index listing no record is under 100
_STORE_FILES = {LOCK_NAME, WORKDIR_MARK, _INDEX, _INDEX + ".tmp", CALIBRATE_NAME}
_STORE_DIRS = {"records"}
_log = logging.getLogger("tiered")
_said_default = False


def default_root() -> str:
    """The root used when no ``nvme_path`` is given: ``$TIERED_NVME_PATH``, else ``<tempdir>/tiered``. Said
    once a process in the "tiered" logger, since the system temp folder is often RAM or a small disk."""
    global _said_default
    env = os.environ.get(ENV_ROOT)
    root = env or os.path.join(tempfile.gettempdir(), "tiered")
    if not _said_default:
        _said_default = True
        # Where the root came from: a user who set the variable is not asked to set it
        hint = f"from ${ENV_ROOT}; set nvme_path= to put them elsewhere" if env else \
            f"set nvme_path= or ${ENV_ROOT} to put them on a fast disk"  # fmt: skip
        _log.warning("tiered: no nvme_path given; the working files (an optimizer's state, a KV cache's pages) go "
                     "under %s (%s)", root, hint)  # fmt: skip
    return root


def folder_tag() -> str:
    """Names a private folder: the process id, and the rank when torch.distributed is running."""
    import torch.distributed as dist  # here, not at import: torch loads its distributed package lazily

    if dist.is_available() and dist.is_initialized():
        return f"rank{dist.get_rank()}-{os.getpid()}"
    return str(os.getpid())


def make_workdir(root: str, tag: str) -> tuple[str, FolderLock]:
    """A new private folder under ``root`` (created if missing), after reclaiming dead runs' folders there, and
    its lock, held from the folder's first instant (see the module doc)."""
    blocker = file_in_the_way(root)
    if blocker is not None:
        what = "it" if blocker == os.path.abspath(root) else repr(blocker)
        raise NotADirectoryError(errno.ENOTDIR, f"nvme_path {root!r} cannot be written: {what} is a file, not a "
                                 "folder. nvme_path names a folder (made if missing) for the working files (an "
                                 "optimizer's state, a KV cache's pages): give "
                                 "a folder's path, or move the file away", blocker)  # fmt: skip
    try:
        os.makedirs(root, exist_ok=True)
        if not os.path.isdir(root):
            raise NotADirectoryError(20, "not a directory", root)
        reclaim_dead(root)
        folder = tempfile.mkdtemp(prefix=f"{PREFIX}{tag}-", dir=root)  # mode 0700, fails if the name exists
        try:
            _write_mark(folder)  # before the lock: a .lock a sibling sees is a marked folder's
        except BaseException:
            _remove_shell(folder)
            raise
    except OSError as e:
        raise type(e)(e.errno, f"nvme_path {root!r} cannot be written ({e.strerror}): choose a writable folder",
                      root) from e  # fmt: skip
    try:
        return folder, FolderLock(folder)  # its errors name the lock file and the fix
    except BaseException:
        _remove_shell(folder)  # only the marker: a lock file not made leaves no temporary file either
        raise


def _write_mark(folder: str) -> None:
    fd = os.open(os.path.join(folder, WORKDIR_MARK), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                 | getattr(os, "O_NOFOLLOW", 0), 0o644)  # fmt: skip
    try:
        os.write(fd, _MARK_TEXT)
    finally:
        os.close(fd)


def _made_by_make_workdir(folder: str) -> bool:
    """Whether ``folder`` (ours, a real folder) is one make_workdir made: its marker, or an older run's name and
    lock pid (the lock file's first line), with no record in its index (see the module doc). Read before its lock is
    taken: taking it (but with ``keep_pid``, which writes the taker's on a second line) writes the taker's pid."""
    if _marked(folder):
        return True
    old = _OLD_RUN_NAME.fullmatch(os.path.basename(folder))
    if old is None:
        return False
    pid = _read_start(os.path.join(folder, LOCK_NAME), 32)
    return pid is not None and pid.split(b"\n")[0].strip() == old.group(1).encode() and _lists_no_record(folder)


def _marked(folder: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(os.path.join(folder, WORKDIR_MARK)).st_mode)
    except OSError:
        return False


def _lists_no_record(folder: str) -> bool:
    """Whether ``folder`` has no index, or one that lists no record: then it holds nothing a store would give back
    (a TieredStore opening it removes its unlisted record files, index.reclaim_leftovers). A run's store is never
    flushed (its records deleted, or closed with ``discard``), so a killed run's folder passes; a user's store
    holding records, closed or killed after a flush, never does."""
    path = os.path.join(folder, _INDEX)
    if not os.path.lexists(path):
        return True
    text = _read_start(path, _EMPTY_INDEX_MAX + 1)
    if text is None or len(text) > _EMPTY_INDEX_MAX:
        return False  # unreadable (a link, say: never followed), or long: it lists records
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    return isinstance(doc, dict) and doc.get("records") == {}


def _read_start(path: str, size: int) -> bytes | None:
    """The first ``size`` bytes of the file at ``path`` (a link not followed), or None where it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        return os.read(fd, size)
    except OSError:
        return None
    finally:
        os.close(fd)


def file_in_the_way(path: str) -> str | None:
    """The first of ``path`` and the folders above it that exists and is not a folder (links followed, as the
    user's own choice), or None: why a folder cannot be made there, said in words rather than as EEXIST."""
    path = os.path.abspath(path)
    parts = [path]
    while os.path.dirname(parts[-1]) != parts[-1]:
        parts.append(os.path.dirname(parts[-1]))
    for p in reversed(parts):
        if not os.path.exists(p):
            return None
        if not os.path.isdir(p):
            return p
    return None


def reclaim_dead(root: str) -> int:
    """Delete the folders of dead runs under ``root`` (see the module doc); returns the bytes freed."""
    freed = 0
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    for name in names:
        if name.startswith(PREFIX):
            freed += _reclaim(os.path.join(root, name))
    return freed


def _reclaim(folder: str) -> int:
    try:
        st = os.lstat(folder)
    except OSError:
        return 0
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or not _made_by_make_workdir(folder):
        return 0  # not a run's folder: a user's store named tiered-..., say, closed, its lock free
    lock_path = os.path.join(folder, LOCK_NAME)
    if not os.path.isfile(lock_path) or os.path.islink(lock_path):
        return 0  # no lock yet: a live optimizer may be between mkdtemp and linking its lock (make_workdir)
    try:
        lock = FolderLock(folder, keep_pid=True)  # the name's pid stays: killed part-way, still a run's (see above)
    except (StoreLockedError, OSError):
        return 0  # alive (or not ours to take)
    try:
        if not _marked(folder) and not _lists_no_record(folder):
            return 0  # a user's store, opened, filled and closed since it was looked at above
        try:
            files = _own_files(folder)
        except OSError:  # gone meanwhile: a sibling reclaimed it and released the lock just before we took it
            files = None
        if files is None:
            return 0
        freed = _unlink(files)
        # Under the lock, as remove_workdir: released first, a store opening the folder meanwhile would get the
        # lock, then lose its .lock (a second store on the folder opening too) and its records/ to this removal.
        _remove_shell(folder)
    finally:
        lock.release()
    _log.info("tiered: reclaimed %s, left by a run that ended without closing its optimizer", folder)
    return freed


def _own_files(folder: str) -> list[str] | None:
    """The store's files in ``folder`` (lock excluded), or None if it holds anything else (then it is left)."""
    out = []
    for entry in os.scandir(folder):
        own_file = (entry.name in _STORE_FILES or entry.name.startswith(LOCK_TEMP_PREFIX)
                    or entry.name.startswith(EXPORT_PREFIX) and entry.name.endswith(".bin"))  # fmt: skip
        if own_file and entry.is_file(follow_symlinks=False):
            if entry.name not in (LOCK_NAME, WORKDIR_MARK):  # those two last (_remove_shell)
                out.append(entry.path)
        elif entry.name in _STORE_DIRS and entry.is_dir(follow_symlinks=False):
            for sub in os.scandir(entry.path):
                if not (sub.name.endswith(".bin") and sub.is_file(follow_symlinks=False)):
                    return None
                out.append(sub.path)
        else:
            return None
    return out


def remove_workdir(folder: str, lock: FolderLock | None = None) -> None:
    """Remove a closed optimizer's folder: its store files (none left after a clean close) and the lock file; then
    release ``lock``, the folder's (make_workdir's), held till then so that no sibling empties it meanwhile."""
    try:
        try:
            files = _own_files(folder) if os.path.isdir(folder) else None
        except OSError:  # no lock held: a sibling's reclaim_dead took the closed folder and is emptying it
            files = None
        _unlink(files or ())
        _remove_shell(folder)
    finally:
        if lock is not None:
            lock.release()


def _unlink(files: list[str] | tuple[()]) -> int:
    """Delete ``files``; returns the bytes they held."""
    freed = 0
    for path in files:
        with contextlib.suppress(OSError):
            freed += os.lstat(path).st_size
            os.unlink(path)
    return freed


def _remove_shell(folder: str) -> None:
    """What is left of an emptied store folder: ``records/``, its marker, its lock file, the folder itself. A
    reclaim calls it with the folder's lock held, remove_workdir with the lock given to it."""
    # records/ before the lock file: once .lock is unlinked, a store may open the folder (a new lock file), and
    # the records/ its open made must stay. Killed then, the marker or the lock file is left: reclaimed.
    for d in _STORE_DIRS:
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(folder, d))
    # Killed between the two: reclaimed as an older run's (its name's pid is in the lock file, which make_workdir's
    # lock wrote and a reclaim's leaves). The other order would leave a lone marker: a folder being made, left alone.
    for name in (WORKDIR_MARK, LOCK_NAME):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(folder, name))
    with contextlib.suppress(OSError):
        os.rmdir(folder)


def mapped_empty(folder: str, numel: int) -> torch.Tensor:
    """An fp32 tensor of ``numel`` elements backed by a new file in ``folder``, which is unlinked at once.

    The blocks are allocated up front, so a full disk raises ENOSPC here as an OSError, rather than killing
    the process with SIGBUS when a page of the mapping is first written."""
    if numel == 0:
        return torch.empty(0, dtype=torch.float32)
    fd, path = tempfile.mkstemp(prefix=EXPORT_PREFIX, suffix=".bin", dir=folder)
    try:
        os.posix_fallocate(fd, 0, numel * 4)
        return torch.from_file(path, shared=True, size=numel, dtype=torch.float32)
    finally:
        os.close(fd)
        os.unlink(path)
