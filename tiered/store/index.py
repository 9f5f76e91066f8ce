"""The store's folder on disk: ``index.json`` and one file per record under ``records/``.

Layout::

    nvme_path/.lock                  # FolderLock (lock.py); .lock.<random> for an instant while it is made
    nvme_path/index.json             # {"format": "tiered.store", "version": 1, "checksum": ALGORITHM, "records": {...}}
    nvme_path/records/<key>.bin      # the record's raw bytes; <key> percent-quoted (see record_file_name)

The index lists only records whose file is whole (``Record.on_disk``), each with its shape, dtype, nbytes
and the checksum taken when it was written. It is replaced atomically, so a reader sees the last flush.

Links. The folder may sit on a shared scratch disk where someone else could have made it, or could plant
links in it, hoping a (root) run writes through them. So ``prepare_folder`` refuses a folder or
``records/`` that is a symbolic link, and an existing folder holding anything but the files above; and
every file here is opened with O_NOFOLLOW (the index and its temp file here, the lock in lock.py, the
record files through an engine made with ``follow_symlinks=False``). Folders the store creates are
private (mode 0700). Links in the folders above ``nvme_path`` are the user's own choice and are followed.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import urllib.parse
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from hashlib import sha256
from typing import Any

import torch

from io_engine import write_json_atomic

from .checksum import ALGORITHM
from .lock import LOCK_NAME, LOCK_TEMP_PREFIX
from .records import Record, check_key
from .workdir import WORKDIR_MARK, file_in_the_way

__all__ = ["INDEX_FILE", "RECORDS_DIR", "StoreFolderError", "prepare_folder", "record_file_name", "record_path",
           "index_entry", "write_index", "save_index", "read_index", "reclaim_leftovers",
           "replacement_path"]  # fmt: skip

INDEX_FILE = "index.json"
INDEX_TMP = INDEX_FILE + ".tmp"
RECORDS_DIR = "records"
_OWN_FILES = (LOCK_NAME, INDEX_FILE, INDEX_TMP)
_OPEN = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class StoreFolderError(OSError):
    """The store's folder, or a file in it, is not what a store keeps there (a link, someone else's file)."""

    def __init__(self, err: int, path: str, message: str):
        super().__init__(err, message, path)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _not_ours(path: str, st: os.stat_result) -> StoreFolderError:
    """The error for a file or folder of the store's that is a link or of the wrong kind."""
    if stat.S_ISLNK(st.st_mode):
        why = "a store never follows links in its folder (was it planted there?)"
        return StoreFolderError(errno.ELOOP, path, f"{path} is a symbolic link: {why}. Remove it, or give the "
                                "store another folder")  # fmt: skip
    return StoreFolderError(errno.EEXIST, path, f"{path} is not a file this store made (a store's own are single-"
                            "link regular files): move it away, or give the store another folder")  # fmt: skip


def _is_own_file(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def _make_dir(path: str, what: str) -> None:
    """Create the folder ``path`` (private), or check that the one there is a real folder, not a link."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise StoreFolderError(errno.ELOOP, path, f"{what} {path} is a symbolic link: a store never follows links "
                               "to its folders. Give nvme_path the real folder, or another one")  # fmt: skip
    if not stat.S_ISDIR(st.st_mode):
        raise StoreFolderError(errno.ENOTDIR, path, f"{what} {path} is not a folder: move it away, or give "
                               "nvme_path another folder")  # fmt: skip


def prepare_folder(folder: str) -> None:
    """Create the store folder and its ``records/``, or check existing ones (see "Links" above).

    Raises ``StoreFolderError`` (naming the folder, the offending names and the fix) for a link, or for an
    existing folder holding anything a store does not keep there; nothing is created in it then.
    """
    try:
        os.makedirs(os.path.dirname(folder), exist_ok=True)
    except OSError as e:
        blocker = file_in_the_way(os.path.dirname(folder))
        if blocker is None:
            raise
        raise StoreFolderError(errno.ENOTDIR, blocker, f"the store folder {folder} cannot be made: {blocker} is a "
                               "file, not a folder. Give nvme_path a path of folders, or move the file "
                               "away") from e  # fmt: skip
    _make_dir(folder, "the store folder")
    records, foreign = os.path.join(folder, RECORDS_DIR), []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        st = os.lstat(path)
        if name == RECORDS_DIR:
            _make_dir(records, "the store's records folder")  # only checks: it exists
        elif name not in _OWN_FILES and name != WORKDIR_MARK and not name.startswith(LOCK_TEMP_PREFIX):
            foreign.append(name)  # (the marker: a run's private folder, workdir.py; the prefix: a lock being made)
        elif not _is_own_file(st):
            raise _not_ours(path, st)
    if os.path.isdir(records):
        for name in sorted(os.listdir(records)):
            if not (name.endswith(".bin") and _is_own_file(os.lstat(os.path.join(records, name)))):
                foreign.append(f"{RECORDS_DIR}/{name}")
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise StoreFolderError(errno.EEXIST, folder, f"the store folder {folder} holds {shown}, which a TieredStore "
                               f"does not keep there (only {', '.join(_OWN_FILES)} and {RECORDS_DIR}/*.bin, each "
                               "a plain file of one link): give nvme_path a new or empty folder, or move those "
                               "out")  # fmt: skip
    _make_dir(records, "the store's records folder")


def record_file_name(key: str) -> str:
    safe = urllib.parse.quote(key, safe="-_.")  # injective: distinct keys get distinct names
    if safe.startswith("."):  # a hidden name, which read_index refuses: quoted (quote keeps "." bare: still injective)
        safe = "%2E" + safe[1:]
    if len(safe) > 180:  # keep under NAME_MAX (255) with room to spare
        safe = f"{safe[:100]}~{sha256(key.encode()).hexdigest()[:24]}"
    return f"{safe}.bin"


def record_path(folder: str, key: str) -> str:
    """Where record ``key`` of the store at ``folder`` keeps its bytes."""
    return os.path.join(folder, RECORDS_DIR, record_file_name(key))


def index_entry(rec: Record) -> dict[str, Any]:
    """``rec``'s line in the index. Call it under the store's lock, so the entry is one consistent state."""
    return {"file": os.path.basename(rec.path), "shape": list(rec.shape), "nbytes": rec.nbytes,
            "dtype": str(rec.dtype).removeprefix("torch."), "checksum": rec.checksum}  # fmt: skip


def write_index(folder: str, entries: dict[str, dict[str, Any]]) -> None:
    """Write index.json atomically: a temp file, fsync, rename (the commit), fsync of the folder.

    The temp file is always a new file (O_EXCL): a leftover regular file is unlinked first, a link there
    raises ``StoreFolderError``, so nothing outside the folder is ever written through it.
    """
    path, tmp = os.path.join(folder, INDEX_FILE), os.path.join(folder, INDEX_TMP)
    try:
        st = os.lstat(tmp)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISREG(st.st_mode):
            raise _not_ours(tmp, st)
        os.unlink(tmp)  # a failed flush's leftover, or a hard link to someone's file: never written into
    doc = {"format": "tiered.store", "version": 1, "checksum": ALGORITHM, "records": entries}
    try:
        write_json_atomic(path, doc, tmp=tmp, exclusive=True, flags=_OPEN, mode=0o644)
    except FileExistsError as e:  # planted between the unlink and the open
        raise _not_ours(tmp, os.lstat(tmp)) from e


def save_index(folder: str, recs: Mapping[str, Record], lock: AbstractContextManager[Any]) -> None:
    """Save the index of the records whose files are whole, as one consistent snapshot (taken under ``lock``,
    the store's)."""
    with lock:
        entries = {k: index_entry(r) for k, r in recs.items() if r.on_disk}
    write_index(folder, entries)


def read_index(folder: str) -> Iterator[Record]:
    """The records of the index at ``folder`` (none when it has no index), on NVMe only, in index order.

    Lazy: a malformed entry raises ``ValueError`` (naming the record and the fix) only once the entries
    before it have been yielded.
    """
    path = os.path.join(folder, INDEX_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | _OPEN)
    except FileNotFoundError:
        return
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _not_ours(path, os.lstat(path)) from e
        raise
    fix = "restore it from a copy, or move the folder aside and start a new store"
    try:
        with os.fdopen(fd) as f:
            data = json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not a TieredStore index ({err}): {fix}") from err
    if not isinstance(data, dict) or data.get("format") != "tiered.store" or data.get("version") != 1:
        raise ValueError(f"{path} is not a version-1 TieredStore index: {fix}")
    if data.get("checksum") != ALGORITHM:
        raise ValueError(f"{path} uses checksum {data.get('checksum')!r}; this version reads {ALGORITHM!r}")
    for key, entry in data.get("records", {}).items():
        try:
            dtype, shape = getattr(torch, entry["dtype"]), tuple(int(s) for s in entry["shape"])
            if not isinstance(dtype, torch.dtype) or int(entry["nbytes"]) != math.prod(shape) * dtype.itemsize:
                raise ValueError("its dtype and shape do not match its nbytes")
            if os.sep in entry["file"] or entry["file"].startswith("."):
                raise ValueError(f"bad file name {entry['file']!r}")
            rec = Record(
                check_key(key), os.path.join(folder, RECORDS_DIR, entry["file"]), shape, dtype, entry["nbytes"]
            )
            rec.on_disk, rec.checksum = True, int(entry["checksum"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{path}: the entry for record {key!r} is malformed ({exc}): {fix}") from exc
        yield rec


def reclaim_leftovers(folder: str, listed: set[str]) -> int:
    """Remove the record files in ``folder`` that its index does not list (``listed``: the paths it does), and
    return their bytes: a run killed before it flushed left them, and no later store would ever read or free them.
    Only for the store holding the folder's lock, right after reading the index: no other store writes there."""
    records, freed = os.path.join(folder, RECORDS_DIR), 0
    try:
        names = os.listdir(records)
    except FileNotFoundError:
        return 0
    for name in names:
        path = os.path.join(records, name)
        if name.endswith(".bin") and path not in listed:
            try:
                st = os.lstat(path)
                if stat.S_ISREG(st.st_mode):
                    os.unlink(path)
                    freed += st.st_size
            except FileNotFoundError:
                pass
    return freed


def replacement_path(folder: str, key: str, current: str) -> str:
    """Where a record replacing ``key``'s record at ``current`` writes its bytes: the other of the key's two file
    names, so the old file stays whole until the new one is (a failed replace keeps the old record). The second
    name ends in ``%1.bin``: a percent-quoted name never holds ``%`` but before two hex digits, so no key's first
    name is another key's second."""
    first = record_path(folder, key)
    return first[: -len(".bin")] + "%1.bin" if current == first else first
