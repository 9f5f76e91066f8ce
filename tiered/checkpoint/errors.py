"""Errors of tiered.checkpoint. Each names the checkpoint (and the file, where one is to blame) and the fix.

They subclass the builtin a caller would catch anyway: ``OSError`` for what is wrong on disk (missing,
corrupted, truncated, no space), ``ValueError`` for what does not fit (names, shapes, format version).
"""

from __future__ import annotations

import errno
import os
from typing import Any, TypeVar

E = TypeVar("E", bound=BaseException)


class CheckpointError(Exception):
    """Base of every checkpoint error (mixed into the OSError / ValueError subclasses below).

    ``partial_load``: the load had begun to change the optimizer when it failed, so the optimizer holds neither
    its old state nor the checkpoint's (the caller marks it broken); False for every failure found before that.
    """

    partial_load = False

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (a launcher passing a rank's exception on: concurrent.futures, multiprocessing, Ray) and copied
        # without the constructor, whose arguments (a path, a list of problems) are not the args the builtin keeps
        return rebuild_error, (type(self), *error_state(self))


def error_state(err: BaseException) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """An error's args (an OSError's filename among them: it keeps it beside its args) and attributes."""
    args = err.args
    if isinstance(err, OSError) and err.filename is not None and len(args) == 2:
        args += (err.filename,)
    return args, dict(err.__dict__)


def rebuild_error(cls: type[E], args: tuple[Any, ...], attrs: dict[str, Any]) -> E:
    """``cls``'s error of ``args`` and ``attrs``, its own constructor not called (``error_state``'s inverse)."""
    err = cls.__new__(cls, *args)
    (OSError if issubclass(cls, OSError) else BaseException).__init__(err, *args)
    err.__dict__.update(attrs)
    return err


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No complete checkpoint at the path: nothing there, or a folder without a manifest (a save into it
    never finished; such a folder is never loaded)."""

    def __init__(self, path: str | os.PathLike[str], why: str):
        self.path = os.fspath(path)
        self.message = f"no checkpoint at {self.path}: {why}"
        super().__init__(errno.ENOENT, self.message, self.path)

    def __str__(self) -> str:
        return self.message


class CheckpointCorruptError(CheckpointError, OSError):
    """One or more files of a checkpoint are corrupted, truncated or missing.

    ``problems`` lists ``(file, what)`` pairs; ``path`` is the first bad file. The message says to load
    another (earlier) checkpoint, or restore the file from a copy.
    """

    def __init__(self, checkpoint: str, problems: list[tuple[str, str]], *, partial_load: bool = False):
        self.checkpoint = checkpoint
        self.problems = list(problems)
        self.partial_load = partial_load
        first_file = problems[0][0] if problems else checkpoint
        lines = [f"  {f}: {what}" for f, what in problems[:20]]
        if len(problems) > 20:
            lines.append(f"  ... and {len(problems) - 20} more")
        fix = "Load an earlier checkpoint (or restore the file(s) from a copy)."
        if partial_load:
            fix = (
                "The optimizer now holds a partly loaded state: load an intact checkpoint into it before "
                "training, or build a new one. " + fix
            )
        # ``report``: what `tiered-bench verify` says, which is that command; the message adds where to run it.
        self.report = f"checkpoint {checkpoint} is damaged:\n" + "\n".join(lines) + "\n" + fix
        self.message = self.report + " `tiered-bench verify PATH` lists every bad file."
        super().__init__(errno.EIO, self.message, first_file)
        self.path = first_file

    def __str__(self) -> str:
        return self.message


class CheckpointPathError(CheckpointError, FileExistsError):
    """The target path holds something that is not a tiered checkpoint; a save never overwrites that."""


class CheckpointCommittedError(CheckpointError, OSError):
    """A save that committed, then failed: the new checkpoint is in place at ``path``, whole (the one it replaced
    there is deleted), but a step after the commit failed (``__cause__``): the fsync of the folder that makes the
    rename durable, or the pruning of older checkpoints (``keep_last``). ``errno`` is the cause's. Training may go
    on from it; the message says what the failed step leaves undone."""

    def __init__(self, path: str, what: str, cause: OSError):
        self.path = path
        self.message = f"the checkpoint {path} was saved and is in place, but {what}: {cause}"
        super().__init__(cause.errno if cause.errno is not None else errno.EIO, self.message, path)

    def __str__(self) -> str:
        return self.message


class CheckpointNotSharedError(CheckpointError, FileNotFoundError):
    """A collective (FSDP2) save whose ranks wrote their parts where rank 0 cannot see them: the folder is on a
    disk of each node's own, not one every rank shares. Nothing is committed."""

    def __init__(self, path: str, ranks: list[int]):
        self.path, self.ranks = path, list(ranks)
        self.message = (
            f"no part of rank(s) {self.ranks} is in {path}, though every rank wrote its part: the ranks do not share "
            "that folder (a disk local to each node?). Save to a folder that every rank sees, on a shared filesystem"
        )
        super().__init__(errno.ENOENT, self.message, path)

    def __str__(self) -> str:
        return self.message


class CheckpointFormatError(CheckpointError, ValueError):
    """The manifest is not a tiered checkpoint manifest this version can read."""


class ManifestDamagedError(CheckpointFormatError):
    """manifest.json is not valid JSON or fails its own CRC: readers turn it into a CheckpointCorruptError."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint's parameters do not fit the optimizer: ``mismatches`` lists each difference."""

    def __init__(self, checkpoint: str, mismatches: list[str], fix: str):
        self.checkpoint = checkpoint
        self.mismatches = list(mismatches)
        shown = [f"  {m}" for m in mismatches[:30]]
        if len(mismatches) > 30:
            shown.append(f"  ... and {len(mismatches) - 30} more")
        super().__init__(
            f"checkpoint {checkpoint} does not fit this optimizer ({len(mismatches)} mismatch"
            f"{'es' if len(mismatches) != 1 else ''}):\n" + "\n".join(shown) + f"\n{fix}"
        )


class InsufficientMemoryError(CheckpointError, OSError):
    """A checkpoint's tensors, asked for in host memory (``export_torch_state_dict``), cannot fit there: refused
    before anything is allocated, with the way that needs no such memory."""

    def __init__(self, path: str, need: int, available: int, fix: str):
        from io_engine import format_size

        self.path, self.need, self.available = path, need, available
        self.message = (
            f"the checkpoint {path} needs {format_size(need)} of host memory for its tensors, and "
            f"{format_size(available)} is available: {fix}"
        )
        super().__init__(errno.ENOMEM, self.message, path)

    def __str__(self) -> str:
        return self.message


class InsufficientSpaceError(CheckpointError, OSError):
    """The target filesystem cannot hold the checkpoint. Raised before any data is written (or as soon as
    the disk fills), with the temporary folder removed and any previous checkpoint untouched. ``previous``:
    whether a checkpoint is at ``path`` (an overwrite), so that the message says it is intact only where one is."""

    def __init__(self, path: str, need: int, free: int | None, detail: str = "", *, previous: bool = False):
        from io_engine import format_size

        have = "" if free is None else f", {format_size(free)} free"
        self.path, self.need, self.free = path, need, free
        left = "the previous checkpoint there is intact" if previous else "nothing was saved there"
        self.message = (
            f"not enough space for the checkpoint {path}: it needs {format_size(need)}{have}{detail}. "
            f"Free space there (e.g. prune old checkpoints with keep_last=N) or save to another disk; {left}"
        )
        super().__init__(errno.ENOSPC, self.message, path)

    def __str__(self) -> str:
        return self.message
