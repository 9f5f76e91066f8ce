"""Durable small writes: fsync of a folder, and a JSON file replaced atomically (the one copy of each)."""

from __future__ import annotations

import json
import os
from typing import Any


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
    both opens, the temp file's and the folder's. With ``indent`` the JSON ends with a newline.
    """
    path = os.fspath(path)
    tmp = f"{path}.tmp" if tmp is None else os.fspath(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC) | flags, mode)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=indent)
        if indent is not None:
            f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".", flags=getattr(os, "O_DIRECTORY", 0) | flags)
