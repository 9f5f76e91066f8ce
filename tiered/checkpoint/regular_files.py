"""A checkpoint's own files, read as regular files only: no link followed, no FIFO waited on, no more than a bound.

A link planted in a checkpoint folder never makes tiered read (or report the size of) a file outside it: every file
is opened with O_NOFOLLOW (``read_regular``) or checked by its mode where it was opened otherwise (``check_regular``,
reader.py's descriptors), and must be a regular file. A file is read up to a limit and one byte more, so a file too
long shows without reading all of it (``read_fd``); a manifest over ``MAX_MANIFEST_BYTES`` is refused before it is
parsed (``read_manifest``). Every refusal is a CheckpointFormatError that names the file and the fix.

Used by fsops.py (dating a checkpoint by its manifest), reader.py, shardmap.py and reshard.py.
"""

from __future__ import annotations

import errno
import os
import stat

from .errors import CheckpointFormatError
from .manifest import MANIFEST
from .validate import FIX

MAX_MANIFEST_BYTES = 256 << 20  # a 100B-parameter model's manifest is a few MB


def read_regular(path: str, limit: int, *, dir_fd: int | None = None) -> bytes:
    """At most ``limit + 1`` bytes of the regular file ``path`` (one more than allowed shows a file too long
    without reading all of it). A link is not followed (O_NOFOLLOW) and a FIFO is not waited on: either is a
    CheckpointFormatError, as is anything but a regular file. Other errors are the OSError of the open.
    ``dir_fd``: an open descriptor of ``path``'s folder, through which its file is opened (``path`` names it)."""
    name = path if dir_fd is None else os.path.basename(path)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise link_error(path) from None
        raise
    try:
        check_regular(path, os.fstat(fd).st_mode)
        return read_fd(fd, limit)
    finally:
        os.close(fd)


def read_fd(fd: int, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of the open file ``fd``, from its start (as ``read_regular``)."""
    parts, pos = [], 0
    while pos < limit + 1:
        part = os.pread(fd, min(limit + 1 - pos, 8 << 20), pos)
        if not part:
            break
        parts.append(part)
        pos += len(part)
    return b"".join(parts)


def link_error(path: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{path} is a symbolic link; tiered never follows a link out of a checkpoint folder: replace it with the "
        f"file itself (cp --dereference), or {FIX}"
    )


def check_regular(path: str, mode: int) -> None:
    """A CheckpointFormatError unless ``mode`` (from lstat or fstat) is a regular file's."""
    if stat.S_ISLNK(mode):
        raise link_error(path)
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, socket or device)"
        raise CheckpointFormatError(f"{path} is {kind}; a checkpoint's files are regular files: {FIX}")


def read_manifest(folder: str, fd: int | None = None) -> str:
    """The text of ``folder``'s manifest.json (read from ``fd`` where the caller opened it), refused
    (CheckpointFormatError) when it is a link or larger than ``MAX_MANIFEST_BYTES``. FileNotFoundError when there is
    none."""
    path = os.path.join(folder, MANIFEST)
    data = read_regular(path, MAX_MANIFEST_BYTES) if fd is None else read_fd(fd, MAX_MANIFEST_BYTES)
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointFormatError(
            f"{path} is larger than {MAX_MANIFEST_BYTES} bytes, more than any manifest needs: {FIX}"
        )
    return data.decode("utf-8", errors="replace")
