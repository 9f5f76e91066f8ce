"""Reading a checkpoint: its manifest, its objects, and its data with every byte checked against a CRC.

Call order::

    r = CheckpointReader(path)            # manifest parsed and checked; every file's size checked
    objs = r.objects(weights_only=True)   # objects.pt, CRC-checked, then torch.load
    with r.stream(io) as s:               # an IOEngine and one SegmentChecker per row file
        fut = s.read(row, first_element, out)   # async pread of out.numel() fp32 elements
        fut.result(); s.check(row, first_element, out)   # CRC of these bytes into their segments
        s.finish()                        # every segment complete and matching
    with r.stream(io) as s:               # or, for part of the data (a resharding load):
        s.read_ranges(row, [(first, out), ...])  # only the segments these ranges touch, each whole, checked
    verify_files(r, io)                   # or (verify.py): read every file once, all problems reported together

Why segments are checked from pieces: a loader with another chunk size reads ranges that straddle the
saver's segments. Each piece's CRC is taken as it arrives, and ``crc32_combine`` joins the pieces of a
segment, in offset order, once all of its bytes are in. No byte is read twice and no segment buffered.
``read_ranges`` is the exception, for a reader that wants only part of the data: a whole segment is the
least it can read and still check, so each segment it needs is read whole into a buffer of its own.
"""

from __future__ import annotations

import bisect
import errno
import io as _io
import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from io_engine import IOConfig, IOEngine, IOFuture, ShortReadError
from io_engine.errors import DirectIOUnsupportedError, IOEngineError, open_error

from ..store.checksum import Checksummer, crc32_combine
from .errors import CheckpointCorruptError, CheckpointFormatError, CheckpointNotFoundError, ManifestDamagedError
from .fsops import SHARDS, readable
from .manifest import ELEMENT_BYTES, FILES, MANIFEST, OBJECTS, ROW_FILES, FileEntry, Manifest
from .regular_files import check_regular, link_error, read_fd, read_manifest
from .validate import FIX, Invalid, check_objects, show


class CheckpointReader:
    """A complete checkpoint, opened for reading. Checks the manifest (every field: validate.py) and the files
    up front: a link or other non-regular file is refused (CheckpointFormatError), and a missing or truncated
    one reported (CheckpointCorruptError), before anything is loaded. Only the fixed file names are opened.

    Every file is opened here, once, through one descriptor of the folder, and read through those descriptors
    only (``hold``), so the reader sees one checkpoint whole: another process that commits a new checkpoint at
    ``path`` meanwhile (a rename over it, then the old one deleted) changes nothing of what this one reads, whose
    CRCs come from the manifest it opened. The descriptors close with ``close()`` or when the reader is collected.
    """

    def __init__(self, path: str | os.PathLike[str], *, check_sizes: bool = True, folder: int | None = None):
        """``folder``: a descriptor of the checkpoint's folder the caller opened (and closes), ``path`` then only
        naming it: a part of a sharded checkpoint, opened through the descriptor its map was read from."""
        self.path = os.path.abspath(os.fspath(path))
        self._fds: dict[str, int] = {}
        self._closer = weakref.finalize(self, _close_all, self._fds)
        if folder is not None:
            self._opened(folder, check_sizes)
            return
        self.path = readable(self.path)  # an interrupted overwrite left the previous checkpoint aside
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                self.path,
                "nothing there. Check the path (latest_checkpoint(root) finds the newest checkpoint in a folder)",
            ) from None
        except NotADirectoryError:
            raise CheckpointNotFoundError(
                self.path, "it is a file; a checkpoint is a folder with a manifest.json"
            ) from None
        try:
            self._opened(fd, check_sizes)
        finally:
            os.close(fd)

    def _opened(self, folder: int, check_sizes: bool) -> None:
        try:
            self._open_files(folder)
        except BaseException:
            self.close()
            raise
        if check_sizes:
            problems = self.size_problems()
            if problems:
                self.close()
                raise CheckpointCorruptError(self.path, problems)

    def _open_files(self, folder: int) -> None:
        """The manifest, read and checked, then every file it lists, opened (through ``folder``, a descriptor of
        the checkpoint's folder: all from one folder, whatever is renamed over ``path`` meanwhile)."""
        mpath = os.path.join(self.path, MANIFEST)
        try:
            fd = self._open(folder, MANIFEST)
            if fd is None:
                raise FileNotFoundError(mpath)
            try:
                text = read_manifest(self.path, fd)
            finally:
                os.close(fd)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                self.path,
                f"the folder has no {MANIFEST} (nor the {SHARDS} of one saved by several ranks), so it is not a "
                "complete checkpoint (a save into it never finished, or it is another kind of folder); it is never "
                "loaded. Load an earlier checkpoint",
            ) from None
        except OSError as e:
            raise CheckpointCorruptError(self.path, [(mpath, f"cannot be read ({e.strerror or e})")]) from e
        try:
            self.manifest = Manifest.parse(text, mpath)
        except ManifestDamagedError as e:
            raise CheckpointCorruptError(self.path, [(mpath, str(e))]) from e
        # Names are from the fixed set (Manifest.parse); none may be a link or anything but a regular file.
        for name in self.manifest.files:
            try:
                fd = self._open(folder, name)
            except OSError as e:  # unreadable (EACCES, EIO): named like any other bad file
                raise CheckpointCorruptError(
                    self.path, [(self.file(name), f"cannot be read ({e.strerror or e})")]
                ) from e
            if fd is not None:  # a missing one is reported by size_problems, or when it is read
                self._fds[name] = fd

    def _open(self, folder: int, name: str) -> int | None:
        """``name`` in ``folder`` opened for reading, or None when it is missing; a link or anything but a regular
        file is refused before it is opened (a FIFO is never waited on, a device never opened)."""
        where = os.path.join(self.path, name)  # name: manifest.json, or one Manifest.parse let through
        try:
            check_regular(where, os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode)
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:  # replaced by a link between the stat and the open
                raise link_error(where) from None
            raise
        where = os.path.join(self.path, name)  # name: manifest.json, or one Manifest.parse let through
        try:
            check_regular(where, os.fstat(fd).st_mode)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def hold(self, eng: IOEngine) -> None:
        """Make ``eng`` read this checkpoint's files through the descriptors opened with the manifest. A failure is
        named by the checkpoint's file, as the engine's own open names it (not by the /proc/self/fd path through
        which ``hold`` opens the O_DIRECT descriptor)."""
        for name, fd in self._fds.items():
            path = self.file(name)
            try:
                eng.hold(path, fd)
            except IOEngineError:
                raise
            except OSError as e:
                raise held_error(e, path, eng.config.direct) from e

    def close(self) -> None:
        """Close the files' descriptors (also done when the reader is collected)."""
        self._closer()

    def file(self, name: str) -> str:
        if name not in FILES:  # Manifest.parse let no other name through; this keeps it so
            raise CheckpointFormatError(f"{name!r} is not a file of a tiered checkpoint: {FIX}")
        return os.path.join(self.path, name)

    def size_problems(self) -> list[tuple[str, str]]:
        """(file, what) for each listed file that is missing or not the listed size (the files opened)."""
        out = []
        for name, entry in self.manifest.files.items():
            if name not in self._fds:
                out.append((self.file(name), "is missing"))
                continue
            size = os.fstat(self._fds[name]).st_size
            if size < entry.nbytes:
                out.append((self.file(name), f"is truncated: {size} of its {entry.nbytes} bytes"))
            elif size > entry.nbytes:
                out.append((self.file(name), f"has {size} bytes, the manifest lists {entry.nbytes}"))
        return out

    def objects(self, *, weights_only: bool = True, hparams: bool = True) -> dict[str, Any]:
        """objects.pt's dict ({"param_groups", "scheduler", "extra"}), checked against its CRC first, then
        against the manifest; with ``hparams`` each param group passes the optimizer constructor's checks."""
        fpath = self.file(OBJECTS)
        if weights_only and not self.manifest.objects_weights_only:
            raise CheckpointFormatError(
                f"{fpath} holds objects that torch.load(weights_only=True) refuses (in the param groups, `extra` or "
                "scheduler state saved with it): if you trust this checkpoint, load it with weights_only=False"
            )
        blob = self.objects_bytes()
        try:
            objs = torch.load(_io.BytesIO(blob), weights_only=weights_only, map_location="cpu")
        except Exception as e:  # noqa: BLE001 - whatever the unpickler refuses, the file is refused
            raise CheckpointFormatError(f"{fpath} cannot be loaded ({type(e).__name__}: {show(str(e))}): {FIX}") from e
        try:
            check_objects(
                objs,
                groups=len(self.manifest.param_groups),
                has_scheduler=self.manifest.has_scheduler,
                hparams=hparams,
            )
        except Invalid as e:
            keep = " (load_checkpoint(..., hparams='keep') keeps the optimizer's own hyperparameters)"
            raise CheckpointFormatError(f"{fpath}: {e}; {FIX}{keep if hparams else ''}") from e
        return objs

    def objects_bytes(self) -> bytes:
        """objects.pt's bytes, checked against its CRC, not unpickled: also for a part of a sharded checkpoint
        whose objects a resharding load does not use (rank 0's serve every rank), checked all the same, as a load
        at the saved layout checks its own part's (reshard.py)."""
        entry, fpath = self.manifest.files[OBJECTS], self.file(OBJECTS)
        if OBJECTS not in self._fds:
            raise CheckpointCorruptError(self.path, [(fpath, "is missing")])
        try:
            blob = read_fd(self._fds[OBJECTS], entry.nbytes)  # never more than it should hold
        except OSError as e:
            raise CheckpointCorruptError(self.path, [(fpath, f"cannot be read ({e.strerror or e})")]) from e
        if len(blob) != entry.nbytes:
            what = "is truncated" if len(blob) < entry.nbytes else f"has more than its {entry.nbytes} bytes"
            raise CheckpointCorruptError(self.path, [(fpath, what)])
        checker = SegmentChecker(fpath, entry, Checksummer(0))
        checker.add(0, memoryview(blob))
        bad = checker.finish()
        if bad:
            raise CheckpointCorruptError(self.path, bad)
        return blob

    @contextmanager
    def stream(self, io: IOConfig | None = None) -> Iterator[RowStream]:
        s = RowStream(self, io)
        try:
            yield s
        finally:
            s.close()


class SegmentChecker:
    """Checks one file's segments from pieces read in any order and split; see the module docstring."""

    def __init__(self, path: str, entry: FileEntry, crc: Checksummer):
        self.path, self.entry, self._crc = path, entry, crc
        self._starts = [s[0] for s in entry.segments]
        self._parts: list[list[tuple[int, int, int]]] = [[] for _ in entry.segments]
        self._have = [0] * len(entry.segments)
        self.bad: list[tuple[str, str]] = []

    def add(self, offset: int, data: memoryview) -> list[tuple[str, str]]:
        """CRC the bytes ``data`` found at ``offset``; returns problems of segments this completed."""
        found, pos, end = [], offset, offset + len(data)
        while pos < end:
            i = bisect.bisect_right(self._starts, pos) - 1
            seg_off, seg_n, seg_crc = self.entry.segments[i]
            take = min(end, seg_off + seg_n) - pos
            part = data[pos - offset : pos - offset + take]
            self._parts[i].append((pos, take, self._crc.compute(part)))
            self._have[i] += take
            if self._have[i] == seg_n:
                crc = 0
                for _, n, c in sorted(self._parts[i]):
                    crc = crc32_combine(crc, c, n)
                self._parts[i] = []
                if crc != seg_crc:
                    found.append(
                        (
                            self.path,
                            f"bytes {seg_off}..{seg_off + seg_n} do not match their crc32 "
                            f"({crc:#010x} read, {seg_crc:#010x} saved): the file is corrupted",
                        )
                    )
            pos += take
        self.bad += found
        return found

    def finish(self) -> list[tuple[str, str]]:
        """All problems seen; an unread segment is a bug of the caller (every byte must be read once)."""
        missing = [i for i, (s, h) in enumerate(zip(self.entry.segments, self._have)) if h != s[1]]
        if missing:
            raise RuntimeError(f"{self.path}: segments {missing[:5]} were not read completely (a loader bug)")
        return self.bad


class RowStream:
    """Async reads of fp32 ranges of the row files, checked segment by segment (``check``)."""

    def __init__(self, reader: CheckpointReader, io: IOConfig | None):
        self.reader = reader
        self._crc = Checksummer()
        try:
            self._eng = IOEngine(io if io is not None else IOConfig.from_env())
        except BaseException:
            self._crc.close()
            raise
        try:
            reader.hold(self._eng)  # the files opened with the manifest, whatever is renamed over them since
            files = reader.manifest.files
            self.checkers = [SegmentChecker(reader.file(n), files[n], self._crc) for n in ROW_FILES]
        except BaseException:  # no caller holds this stream yet to close it: its threads and descriptors go here
            self.close()
            raise

    def read(self, row: int, first: int, out: torch.Tensor) -> IOFuture:
        """Start reading ``out.numel()`` fp32 elements of row file ``row`` from element ``first``."""
        return self._eng.pread(out, self.reader.file(ROW_FILES[row]), first * ELEMENT_BYTES)

    def wait(self, fut: IOFuture, *, partial_load: bool = False) -> None:
        """``fut.result()``, a short read (the file shrank since it was opened) reported by file name."""
        try:
            fut.result()
        except ShortReadError as e:
            raise CheckpointCorruptError(
                self.reader.path, [(str(e.path), f"is truncated ({e})")], partial_load=partial_load
            ) from e
        except FileNotFoundError as e:
            raise CheckpointCorruptError(
                self.reader.path, [(str(e.filename), "is missing")], partial_load=partial_load
            ) from e
        except DirectIOUnsupportedError:
            raise  # the IOConfig asked for what this filesystem cannot do: not the checkpoint's fault
        except OSError as e:  # unreadable (EIO, EACCES): named like any other bad file
            raise CheckpointCorruptError(
                self.reader.path, [(str(e.filename), f"cannot be read ({e})")], partial_load=partial_load
            ) from e

    def check(self, row: int, first: int, data: torch.Tensor) -> list[tuple[str, str]]:
        return self.checkers[row].add(first * ELEMENT_BYTES, _bytes(data))

    def read_ranges(self, row: int, ranges: list[tuple[int, torch.Tensor]]) -> int:
        """Fill each flat fp32 ``out`` of ``ranges``, ``(first, out)`` pairs, with row file ``row``'s elements
        from ``first`` on, reading only the segments that overlap some ``out``; returns how many it read.

        Each such segment is read whole and its CRC checked before any of its bytes is copied: a CRC covers a
        whole segment, so reading less would leave the bytes unverified. Segments that overlap no range are
        never read. The next segment is read while one is checked and copied: host memory holds two.
        """
        path, entry = self.reader.file(ROW_FILES[row]), self.reader.manifest.files[ROW_FILES[row]]
        checker = SegmentChecker(path, entry, self._crc)  # its own: each segment it sees is whole, and new to it
        starts = [off for off, _, _ in entry.segments]
        need: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for first, out in ranges:
            a, b = first * ELEMENT_BYTES, (first + out.numel()) * ELEMENT_BYTES
            if b > a:  # an empty range needs no segment, not the one around its offset
                for i in range(bisect.bisect_right(starts, a) - 1, bisect.bisect_left(starts, b)):
                    need.setdefault(i, []).append((a, out))
        order = sorted(need)

        def start(k: int) -> tuple[int, torch.Tensor, IOFuture] | None:
            if k == len(order):
                return None
            off, nbytes, _ = entry.segments[order[k]]
            buf = torch.empty(nbytes, dtype=torch.uint8)
            return k, buf, self._eng.pread(buf, path, off)

        ahead = start(0)
        while ahead is not None:
            k, buf, fut = ahead
            ahead = start(k + 1)
            self.wait(fut)
            off = entry.segments[order[k]][0]
            bad = checker.add(off, _bytes(buf))
            if bad:
                raise CheckpointCorruptError(self.reader.path, bad)
            for a, out in need[order[k]]:
                lo, hi = max(a, off), min(a + out.numel() * ELEMENT_BYTES, off + len(buf))
                out.view(torch.uint8)[lo - a : hi - a] = buf[lo - off : hi - off]
        return len(order)

    def finish(self) -> list[tuple[str, str]]:
        return [p for c in self.checkers for p in c.finish()]

    def close(self) -> None:
        self._eng.close()
        self._crc.close()


def held_error(e: OSError, path: str, direct: str) -> OSError:
    """The error for a ``hold`` of the checkpoint file ``path`` that failed with ``e``, as the engine's ordinary open
    names it: under direct="on", a refused O_DIRECT descriptor is DirectIOUnsupportedError (reopening the held file
    through /proc/self/fd fails with EINVAL where the filesystem refuses O_DIRECT, or where /proc is missing)."""
    if direct == "on":
        why = (
            "this filesystem refuses O_DIRECT (ramfs, some FUSE mounts, tmpfs before Linux 6.6)"
            if e.errno == errno.EINVAL
            else f"its O_DIRECT descriptor is opened through /proc/self/fd, which failed here ({e.strerror or e})"
        )
        return DirectIOUnsupportedError(
            e.errno or errno.EINVAL, f"{why}: use direct='auto' or 'off', or a folder on a real disk", path, 0
        )
    return open_error(e, path, 0, follow_symlinks=False)


def _bytes(t: torch.Tensor) -> memoryview:
    if not t.numel():
        return memoryview(b"")
    # An ndarray is a buffer; numpy's stubs declare its __buffer__ for Python >= 3.12 only (the ignore).
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()
