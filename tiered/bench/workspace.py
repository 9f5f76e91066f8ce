"""Workspace: a private folder for benchmark files that is removed on every way out, Ctrl-C included.

Call order: ``with Workspace(dir) as ws:`` -> ``ws.require_free(nbytes, why)`` -> ``ws.path(name)`` ...
On exit it deletes its private folder, then the folders it had to create (innermost first, only if
empty), so a run leaves the disk as it found it. A folder the user already had, or another run made while
this one started, is never removed. So a new folder two runs shared stays, empty, where the run that made it
ended first (the other's files were in it; the other cannot tell it from one of the user's): --help says so.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from io_engine import format_size

from .common import UsageError

# Room left on top of what a run writes: filesystems refuse writes before `free` reaches 0 (reserved
# blocks, metadata), and a benchmark that fills the user's disk to the brim is a bad guest.
FREE_MARGIN = 256 << 20


class Workspace:
    def __init__(self, root: str | os.PathLike, *, flag: str = "--dir"):
        if not os.fspath(root):  # an unset variable (`--dir "$SCRATCH"`): "" would name the current folder
            raise UsageError(f'{flag} is empty (""): name the folder on the disk to measure')
        self.root = Path(root).expanduser().absolute()
        self._flag = flag
        self._created: list[Path] = []  # folders this run made, outermost first
        self.dir: Path | None = None

    def __enter__(self) -> Workspace:
        try:
            self._makedirs(self.root)
            self.dir = Path(tempfile.mkdtemp(prefix="tiered-bench-", dir=self.root))
        except OSError as e:
            self.close()
            raise UsageError(
                f"cannot write benchmark files in {self._flag} {self.root}: {e.strerror or e} "
                f"({e.filename or self.root}). Name a writable folder on the disk to measure."
            ) from e
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _makedirs(self, path: Path) -> None:
        missing: list[Path] = []
        p = path
        while not p.exists():
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:  # another run on the same new folder made it first: it is that run's
                continue  # (a file there fails the next mkdir, or mkdtemp, as any other blocker does)
            self._created.append(d)

    def path(self, name: str) -> Path:
        if self.dir is None:
            raise RuntimeError("Workspace.path() called outside `with Workspace(...)`")
        return self.dir / name

    def require_free(self, nbytes: int, why: str, *, or_else: str = "", size_flag: str = "--size") -> None:
        """Raise UsageError, stating the need, unless the folder's filesystem has room for `nbytes`. `or_else`:
        another way to need less (flags), named beside a smaller `size_flag` and another folder."""
        free = shutil.disk_usage(self.dir or self.root).free
        need = nbytes + FREE_MARGIN
        if free < need:
            fixes = f"a smaller {size_flag}, another {self._flag} or {or_else}" if or_else else \
                f"a smaller {size_flag} or another {self._flag}"  # fmt: skip
            raise UsageError(
                f"{self._flag} {self.root} has {format_size(free)} free; this run needs {format_size(need)} "
                f"({why}, plus {format_size(FREE_MARGIN)} to spare). Use {fixes}."
            )

    def close(self) -> None:
        """Remove everything this workspace made. Idempotent; safe after a failed __enter__."""
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        for d in reversed(self._created):
            try:
                os.rmdir(d)  # only if empty: something the user put there meanwhile stays
            except OSError:
                break
        self._created = []
