"""CheckpointWriter: one checkpoint folder, written into a hidden temp folder and committed by a rename.

Call order::

    w = CheckpointWriter(path, numel=N, objects=blob, io=cfg, keep_last=3)  # target checked, leftovers swept
    with w:                                  # space checked, temp folder made, objects.pt written, files reserved
        fut = w.write(row, first, tensor)    # async pwrite of fp32 elements; its CRC is taken meanwhile
        w.wait(fut)                          # before the tensor's memory is reused
        path = w.commit(manifest)            # fsync, manifest.json last, rename in, prune to keep_last
    # an exception inside the block removes the temp folder once the writes in flight have ended (a Ctrl-C in that
    # wait stops it, and the removal waits for them again, held; one meanwhile is raised after it is gone); the
    # previous checkpoint is never touched before the commit; an exception after it (the folder's fsync, prune) is
    # CheckpointCommittedError: the new one is in

Each ``write`` is one CRC segment of its row file, so a saver that writes one range per state chunk
records one segment per chunk. The CRC runs on the caller's thread (in parallel segments) while the
I/O threads write the same bytes: the checksum costs no extra pass over memory bandwidth-bound time.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import time
import warnings
import weakref
from typing import Any

import torch

from io_engine import IOConfig, IOEngine, IOFuture, format_size, round_up

from ..interrupts import deferred_sigint
from ..store.checksum import Checksummer
from .errors import CheckpointCommittedError, CheckpointPathError, InsufficientSpaceError
from .fsops import (
    commit,
    free_bytes,
    fsync_dir,
    is_checkpoint,
    makedirs_durable,
    manifest_created,
    recover,
    reserve,
    retire_folder,
    series_key,
    sweep,
    test_hook,
    write_file,
)
from .hidden import check_target, ended, hidden_name
from .manifest import ELEMENT_BYTES, MANIFEST, OBJECTS, ROW_FILES, FileEntry, Manifest, Segment
from .validate import checkpoint_path

SPACE_MARGIN = 16 << 10  # bytes kept free beyond the estimate: directory blocks, the manifest's growth
BLOCK = 4096  # files take whole filesystem blocks


class CheckpointWriter:
    """See the module docstring for the call order."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        numel: int,
        objects: bytes,
        io: IOConfig | None = None,
        keep_last: int | None = None,
        manifest_bytes: int = 0,
    ) -> None:
        self.path = checkpoint_path(path)  # "" refused: it would name the current folder, which the commit replaces
        check_keep_last(keep_last)
        if io is not None and not isinstance(io, IOConfig):
            raise TypeError(f"io must be an io_engine.IOConfig or None, got {type(io).__name__}")
        self.parent = os.path.dirname(self.path)
        self.numel, self.objects, self.keep_last = numel, objects, keep_last
        self.io = io if io is not None else IOConfig.from_env()
        self.need = sum(_blocks(n) for n in (*[numel * ELEMENT_BYTES] * len(ROW_FILES), len(objects), manifest_bytes))
        check_target(self.path)
        makedirs_durable(self.parent, self.path)
        recover(self.path)  # an overwrite killed between its renames: the old checkpoint goes back first
        if os.path.lexists(self.path) and not is_checkpoint(self.path) and not _empty_dir(self.path):
            raise CheckpointPathError(
                f"{self.path} exists and is not a tiered checkpoint (no {MANIFEST}); a save replaces only a "
                "checkpoint. Choose another path, or move that one away"
            )
        sweep(self.parent)
        self.temp: str | None = None
        self._segments: list[list[Segment]] = [[] for _ in ROW_FILES]
        self._eng: IOEngine | None = None
        self._crc: Checksummer | None = None

    # ----------------------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> CheckpointWriter:
        test_hook("start")
        free = free_bytes(self.parent)
        if free < self.need + SPACE_MARGIN:
            raise InsufficientSpaceError(self.path, self.need + SPACE_MARGIN, free, previous=is_checkpoint(self.path))
        # Ctrl-C is held from the temp folder's name to its end (commit or abort), and let through between (the
        # writes, the caller's block, the wait for the writes in flight): a second press as the abort began, or as
        # it waited for those writes (long for a large checkpoint), left before any cleanup ran, and the folder, its
        # row files at full size and its lock stayed, marked as under way in this process, so no later save here
        # swept them. A press held while the name is taken is raised once the save ends.
        self._hold = deferred_sigint(lets_through=True)
        sigint = self._sigint = self._hold.__enter__()
        sigint.exit_of = weakref.ref(self)  # a press pending as __exit__ begins is held too (interrupts.py)
        try:
            temp = self.temp = hidden_name(self.path, "tmp")
            sigint.through = True
            os.mkdir(temp)
            self._space_guard(write_file, os.path.join(temp, OBJECTS), self.objects)
            test_hook("objects")
            for name in ROW_FILES:
                self._space_guard(self._create, os.path.join(temp, name))
            test_hook("reserved")
            self._eng = IOEngine(self.io)
            self._crc = Checksummer()
        except BaseException:
            sigint.through = False  # first: no call before it, where a press would be raised
            try:
                self._abort()
            finally:
                self._hold.__exit__(None, None, None)  # a press held meanwhile is raised now
            raise
        return self  # presses pass through the caller's block; __exit__ ends the hold

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        sigint = self._sigint
        sigint.through = False  # first (one pending as this method began is held: exit_of)
        sigint.exit_of = None  # so that the wait below lets presses through, though it runs under this method
        try:
            sigint.through = True  # waiting for the writes in flight, which a stalled disk makes last for ever
            self._close()
        finally:
            sigint.through = False  # first: the abort runs whole, whatever presses land (raised after it)
            try:
                if self.temp is not None:  # not committed
                    self._abort()
            finally:
                self._hold.__exit__(None, None, None)

    def _create(self, path: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            reserve(fd, self.numel * ELEMENT_BYTES)
        except OSError as e:  # fallocate's errno alone (EFBIG under `ulimit -f`, EIO): the file and checkpoint named
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise  # _space_guard says a full disk its own way
            nbytes = format_size(self.numel * ELEMENT_BYTES)
            raise OSError(e.errno, f"{e.strerror}: reserving {nbytes} for checkpoint {self.path}", path) from e
        finally:
            os.close(fd)

    def _space_guard(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, a full disk (ENOSPC, EDQUOT) reported as InsufficientSpaceError."""
        try:
            return fn(*args)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                free, previous = _free_or_none(self.parent), is_checkpoint(self.path)
                detail = f" (the disk filled while writing: {e})"
                raise InsufficientSpaceError(self.path, self.need, free, detail, previous=previous) from e
            raise

    def _close(self) -> None:
        if self._eng is not None:
            # Waits for the writes in flight: nothing writes into a removed folder. Dropped only once closed: a press
            # in that wait (let through) leaves it closing, its writes running, and the abort's call, held, waits for
            # them again and joins its threads (IOEngine.close can be called again) before the folder goes.
            self._eng.close()
            self._eng = None
        if self._crc is not None:
            self._crc.close()
            self._crc = None

    def _abort(self) -> None:
        """Under the hold of ``__enter__``, not letting presses through: each is raised after the abort."""
        try:
            self._close()
        finally:
            if self.temp is not None:
                try:
                    shutil.rmtree(self.temp, ignore_errors=True)
                finally:
                    ended(self.temp)  # whatever rmtree could not remove: this process's next save sweeps it
                    self.temp = None

    # -------------------------------------------------------------------------------------------- data
    def write(self, row: int, first: int, data: torch.Tensor) -> IOFuture:
        """Write fp32 ``data`` (contiguous, CPU) at element ``first`` of row file ``row``; one CRC segment.

        The caller keeps ``data`` alive and unchanged until ``wait`` on the returned future.
        """
        if self._eng is None or self._crc is None or self.temp is None:
            raise RuntimeError("CheckpointWriter.write outside its with-block")
        if data.dtype != torch.float32 or not data.is_contiguous() or data.device.type != "cpu":
            raise TypeError(f"checkpoint rows are contiguous fp32 CPU tensors, got {data.dtype} on {data.device}")
        if first < 0 or first + data.numel() > self.numel:
            raise ValueError(f"elements {first}..{first + data.numel()} fall outside the {self.numel} of a row")
        fut = self._eng.pwrite(data, os.path.join(self.temp, ROW_FILES[row]), first * ELEMENT_BYTES)
        crc = self._crc.compute(data)  # meanwhile the I/O threads write the same bytes
        self._segments[row].append((first * ELEMENT_BYTES, data.numel() * ELEMENT_BYTES, crc))
        return fut

    def wait(self, fut: IOFuture) -> None:
        self._space_guard(fut.result)

    # ------------------------------------------------------------------------------------------ commit
    def commit(self, manifest: Manifest) -> str:
        """Make the checkpoint durable and visible; returns its path. ``manifest.files`` is filled in here."""
        temp = self.temp
        if self._eng is None or temp is None:
            raise RuntimeError("CheckpointWriter.commit outside its with-block, or twice")
        self._space_guard(self._eng.flush)  # waits for every write and fsyncs the row files
        test_hook("data")
        nbytes = self.numel * ELEMENT_BYTES
        files = {name: FileEntry.from_segments(name, nbytes, segs) for name, segs in zip(ROW_FILES, self._segments)}
        blob_crc = Checksummer(0).compute(self.objects)
        files[OBJECTS] = FileEntry.from_segments(OBJECTS, len(self.objects), [(0, len(self.objects), blob_crc)])
        manifest.files = files
        if not manifest.created_unix:
            manifest.created_unix = time.time()
        self._space_guard(write_file, os.path.join(temp, MANIFEST), manifest.dumps().encode())
        fsync_dir(temp)  # the files' directory entries are durable before the folder gets its name
        test_hook("manifest")
        self._close()
        # A Ctrl-C in the commit lands once the series is pruned too: raised as the commit ended, it left one
        # checkpoint more than keep_last (for good, where the run ended there). The commit's own block is nested
        # in this one, so it holds the press on to here.
        with deferred_sigint():
            try:
                commit(temp, self.path)  # deletes the checkpoint it replaced
            except CheckpointCommittedError:
                self.temp = None  # committed, then failed: temp is gone, nothing to abort
                raise
            self.temp = None  # committed: nothing to abort any more
            if self.keep_last is not None:
                prune(self.path, self.keep_last)
        test_hook("done")
        return self.path


def check_keep_last(keep_last: Any) -> None:
    """``keep_last``: an int >= 1 or None (a save's, one process's or the ranks' together: sharded.py)."""
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(
            f"keep_last must be an int >= 1 (checkpoints of this series to keep) or None, got {keep_last!r}"
        )


def prune(path: str, keep_last: int) -> list[str]:
    """Delete the oldest checkpoints of ``path``'s series (siblings whose names differ only in their last number,
    so "step-300" prunes "step-100" but never "best" nor "seed2-step-100": ``fsops.series_key``) beyond the newest
    ``keep_last``, ``path`` included.
    Order is the manifests' save time. A sibling whose manifest cannot be read is left alone. Called once ``path``
    is committed: a failure (a folder it may not delete) is CheckpointCommittedError, which says so."""
    parent, name = os.path.split(path)
    key = series_key(name)
    dated = []
    for entry in os.listdir(parent):
        full = os.path.join(parent, entry)
        if entry.startswith(".") or entry == name or series_key(entry) != key or not is_checkpoint(full):
            continue
        created = manifest_created(full)
        if created is None:
            continue
        dated.append((created, entry))
    dated.sort(reverse=True)
    if not dated and keep_last > 0:
        _say_none_pruned(parent, name, keep_last)
    removed = []
    for _, entry in dated[keep_last - 1 :]:
        try:
            retire_folder(os.path.join(parent, entry))
        except OSError as e:
            why = f"deleting {entry}, an older checkpoint of its series (keep_last={keep_last}), failed (a later save "
            raise CheckpointCommittedError(path, why + "tries again)", e) from e
        removed.append(os.path.join(parent, entry))
    return removed


def _say_none_pruned(parent: str, name: str, keep_last: int) -> None:
    """``keep_last`` found no other checkpoint of ``name``'s series: where checkpoints beside it differ from it in
    another number than the last ("gpt-step-100-bf16" beside "gpt-step-200-bf16"), its step count is likely not
    last, and no save would ever prune: say so (once a process, as warnings do) rather than fill the disk."""
    digits = re.compile(r"\d+")
    like = digits.sub("#", name)
    others = sorted(e for e in os.listdir(parent) if e != name and not e.startswith(".") and digits.sub("#", e) == like)
    if len(others) >= keep_last:
        warnings.warn(
            f"keep_last={keep_last} pruned nothing in {parent}: {len(others)} checkpoints there ({others[0]!r}, ...) "
            f"differ from {name!r} in a number other than its last, and only names that differ in their last number "
            "are one series (so that another run's checkpoints are never deleted). If they are this run's, put the "
            "step last in the name (gpt-bf16-step-100)",
            UserWarning,
            stacklevel=6,  # the user's save_checkpoint (optimizer, save.py, commit, prune, here)
        )


def _blocks(nbytes: int) -> int:
    return round_up(nbytes, BLOCK)


def _empty_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.listdir(path)


def _free_or_none(path: str) -> int | None:
    try:
        return free_bytes(path)
    except OSError:
        return None
