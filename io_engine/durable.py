"""Durable small writes: fsync of a folder, and a JSON file replaced atomically (the one copy of each)."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

from .errors import IOEngineError


def fsync_dir(path: str | os.PathLike, *, flags: int = 0) -> None:
    """fsync the folder ``path``, so the names made, renamed or removed in it survive a crash.

    ``flags`` are added to the ``os.open`` (e.g. ``O_NOFOLLOW``, to refuse a link in place of the folder).
    """
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(
    path: str | os.PathLike,
    doc: Any,
    *,
    tmp: str | os.PathLike | None = None,
    indent: int | None = None,
    exclusive: bool = False,
    flags: int = 0,
    mode: int = 0o666,
) -> None:
    """Write ``doc`` as JSON to ``path`` atomically: a temp file, fsync, rename (the commit), fsync of the folder.

    ``tmp`` defaults to ``PATH.tmp``. With ``exclusive`` the temp file must be new (``O_EXCL``: a file there
    raises ``FileExistsError``, which the caller checks first); else it is truncated. ``flags`` are added to
    both opens, the temp file's and the folder's. With ``indent`` the JSON ends with a newline. A failed write
    or fsync of the temp file (a full disk) raises ``IOEngineError`` naming it, the offset and the errno (and,
    ``exclusive``, removes it); ``path`` is untouched.
    """
    path = os.fspath(path)
    tmp = f"{path}.tmp" if tmp is None else os.fspath(tmp)
    data = (json.dumps(doc, indent=indent) + ("\n" if indent is not None else "")).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC) | flags, mode)
    done = 0
    try:  # unbuffered, so a full disk is raised here, by name, not by a buffered flush that knows no path
        while done < len(data):
            done += os.write(fd, data[done:])
        os.fsync(fd)
    except OSError as e:
        if exclusive:  # made here, so ours to remove: no half-written temp file is left
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise IOEngineError.from_oserror(e, tmp, done, "write") from e
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".", flags=getattr(os, "O_DIRECTORY", 0) | flags)
