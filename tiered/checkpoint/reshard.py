"""A checkpoint's rows gathered for a layout of shards other than the one it was saved at; no process group.

A sharded checkpoint (shardmap.py) loaded at another world size, or by a plain process (world size 1: every
parameter whole), and a single-process checkpoint loaded under FSDP2: each is the same problem. The target
layout (per parameter: its global shape, the first row and the rows this process holds) is filled from the
saved parts whose rows overlap it. FSDP2 shards dimension 0, so a parameter's rows are contiguous in every
shard, and so are its elements in a part's row files.

Call order::

    gathered = gather(opt, path, layout, scratch, ...)   # every read and check; the optimizer untouched
    info = gathered.install()                             # then the chunks, steps, param groups, scheduler

``gather`` checks the map (shardmap.py), each part it opens against the map (its manifest's own record of
the rows it holds), the names, shapes and param groups against the optimizer, and reads of each part only
the records (CRC segments, one a chunk at save time) that hold rows it needs, each read whole and checked
before any of it is used, into disk-backed memory in ``scratch``. Every part it opens has its objects.pt
checked against its CRC too (only rank 0's is unpickled: the run's objects and step counts), as a load at the
saved layout checks its own part's: a damaged one is refused whatever the world size. A part with no row of ours
is never opened, rank 0's excepted, and those of this process's ``share`` (part k where k % world == rank): so
the ranks of a collective load together check every part's objects.pt, and a plain process checks them all. A
failure anywhere is found before the optimizer changes, which is what lets a collective load agree before any
rank installs (sharded.py).
``install`` can then fail only on the optimizer's side; its error says the optimizer is partly loaded.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Any

import torch

from io_engine import IOConfig

from ..store.workdir import mapped_empty
from .errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError, CheckpointNotFoundError
from .fsops import SHARDS, readable
from .manifest import MANIFEST, ParamEntry
from .plan import ChunkedState, holds_no_state, mismatch_fix, mismatches, optimizer_params
from .reader import CheckpointReader
from .regular_files import MAX_MANIFEST_BYTES, read_regular
from .shardmap import Layout, Shard, ShardMap, check_part, rank_dir, read_map, row_numel, total_rows
from .validate import checkpoint_path, restore_groups

__all__ = ["Gathered", "Parts", "gather", "gather_parts", "whole_layout", "scratch_folder"]


def whole_layout(opt: ChunkedState) -> Layout:
    """A plain process's layout: every parameter whole (world size 1)."""
    return [(n, tuple(p.shape), 0, total_rows(tuple(p.shape))) for n, p in zip(opt.param_names, opt.params)]


def scratch_folder(opt: ChunkedState) -> str:
    """Where the gathered rows live: the optimizer's own folder on the NVMe tier, else the temp folder."""
    folder = getattr(opt, "workdir", None)
    return folder if isinstance(folder, str) and os.path.isdir(folder) else tempfile.gettempdir()


class Parts:
    """A checkpoint, sharded or not, opened for reading its parts: the folder is opened once, and the map and every
    part are read through that one descriptor. Another process that commits a new checkpoint at ``root`` meanwhile
    (a rename over it) changes nothing of what this reads: a load takes the map and every part from the one
    checkpoint it opened, never rows of two. Where that checkpoint is deleted meanwhile (the old one, after such a
    commit, or a keep_last pruning it), a part not yet opened is gone: ``reader`` says so, and nothing is mixed.

    ``shards`` is the map (None for a checkpoint saved by one process), ``held[k]`` the rows part k holds
    (the whole of every parameter for a single-process checkpoint, its one part), ``identity()`` which save wrote
    it. Use as a context manager."""

    def __init__(self, root: str):
        root = readable(root)  # an interrupted overwrite left the previous checkpoint aside: put back, or read there
        self.root = root
        self._first: CheckpointReader | None = None  # a single-process checkpoint's one part, opened with it
        try:
            self._fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            CheckpointReader(root)  # names a missing path, or a file, as a single-process load does
            raise
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        try:
            os.stat(SHARDS, dir_fd=self._fd, follow_symlinks=False)
            sharded = True
        except FileNotFoundError:
            sharded = False
        self.shards: ShardMap | None = None
        if sharded:
            self.shards = read_map(self.root, self._fd)
            self.held = self.shards.ranks
            return
        try:
            os.stat(MANIFEST, dir_fd=self._fd, follow_symlinks=False)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                self.root,
                f"the folder has neither {SHARDS} (a checkpoint saved by several ranks) nor {MANIFEST} (one saved by a "
                "single process), so it is not a complete checkpoint (a save into it never finished, or it is another "
                "kind of folder); it is never loaded. Load an earlier checkpoint",
            ) from None
        self._first = CheckpointReader(self.root, folder=self._fd)
        self.held = [[Shard(p.name, p.shape, 0, total_rows(p.shape)) for p in self._first.manifest.params]]

    def reader(self, k: int, *, check_sizes: bool = True) -> CheckpointReader:
        """Part ``k``, checked as a checkpoint of its own and, in a sharded checkpoint, against the map."""
        if self.shards is None:
            assert self._first is not None and k == 0
            return self._first
        folder = os.path.join(self.root, rank_dir(k))
        try:  # read_map found a folder there, no link: O_NOFOLLOW keeps it so
            fd = os.open(rank_dir(k), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._fd)
        except OSError as e:
            raise self._gone(e) or CheckpointCorruptError(
                self.root, [(folder, f"cannot be opened ({e.strerror or e})")]
            ) from e
        try:
            reader = CheckpointReader(folder, check_sizes=check_sizes, folder=fd)
        except CheckpointError as e:
            gone = self._gone(e)
            if gone is None:
                raise
            raise gone from e
        finally:
            os.close(fd)
        m = reader.manifest
        check_part(self.shards, k, m.source, m.params, os.path.join(reader.path, MANIFEST))
        return reader

    def identity(self) -> str:
        """Which save wrote the checkpoint opened: the same for every process that opened this one, another for any
        other save at the same path (ranks that load one path agree on it before any installs: sharded.py). Its
        save id (manifest.py); for one saved before save ids, a digest of its (first part's) manifest, whose bytes
        hold its save time and every CRC of its data."""
        if self.shards is not None and self.shards.save_id is not None:
            return self.shards.save_id
        if self._first is not None and self._first.manifest.save_id is not None:
            return self._first.manifest.save_id
        folder = self.root if self.shards is None else os.path.join(self.root, rank_dir(0))
        fpath = os.path.join(folder, MANIFEST)
        fd = -1
        try:
            if self.shards is not None:  # read_map found a folder there, no link: O_NOFOLLOW keeps it so
                fd = os.open(rank_dir(0), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._fd)
            text = read_regular(fpath, MAX_MANIFEST_BYTES, dir_fd=self._fd if fd < 0 else fd)
        except OSError as e:
            raise self._gone(e) or CheckpointCorruptError(
                self.root, [(fpath, f"cannot be read ({e.strerror or e})")]
            ) from e
        finally:
            if fd >= 0:
                os.close(fd)
        return "manifest-sha256:" + hashlib.sha256(text).hexdigest()

    def _gone(self, e: Exception) -> CheckpointError | None:
        """The error for a part that failed to open because the checkpoint was deleted or replaced since it was
        opened (``root`` names another folder now, or none), else None: the part's own error stands."""
        try:
            same = os.path.samestat(os.fstat(self._fd), os.stat(self.root))
        except OSError:
            same = False
        if same:
            return None
        return CheckpointNotFoundError(
            self.root,
            f"another process replaced or deleted this checkpoint while it was read (a save over {self.root}, or "
            f"keep_last pruning it), so its remaining parts are gone ({e}); nothing of two checkpoints was mixed. "
            "Load it again",
        )

    def close(self) -> None:
        """Close the folder's descriptor. The readers handed out stay open: each is its caller's to close."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Parts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Gathered:
    """Rows read and checked for this process's shards; ``install`` hands them to the optimizer."""

    def __init__(self, opt: ChunkedState, rows: list[list[torch.Tensor]], steps: list[int], info: dict[str, Any],
                 groups: list[dict[str, Any]] | None, scheduler: Any) -> None:  # fmt: skip
        self.opt, self.rows, self.steps, self.info = opt, rows, steps, info
        self.groups, self.scheduler = groups, scheduler

    def install(self, into: ChunkedState | None = None) -> dict[str, Any]:
        """Replace the optimizer's state chunk by chunk, then its step counts, param groups and scheduler. ``into``:
        the state the rows were gathered for, laid out again since (load.prepare_checkpoint)."""
        opt, rows = into or self.opt, self.rows
        most = max((c.numel for c in opt.chunks), default=0)
        buf = torch.empty(3, most, dtype=torch.float32)  # one buffer: put() copies it
        for chunk in opt.chunks:
            new = buf[:, : chunk.numel]
            for pc in chunk.pieces:
                for k in range(3):
                    new[k, pc.in_chunk] = rows[k][pc.param][pc.in_param]
            event = opt.install_chunk_rows(chunk, new)
            if event is not None:
                event.synchronize()  # the parameters' upload read it: then it may be filled again
        opt.set_step_counts(self.steps, self.info["step"])
        if self.groups is not None:
            restore_groups(opt.param_groups, self.groups)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(self.info["scheduler"])
        self.rows = []  # the disk-backed rows go as soon as the caller drops this
        return dict(self.info)


def gather(
    opt: ChunkedState,
    path: str | os.PathLike[str],
    layout: Layout,
    scratch: str,
    *,
    scheduler: Any = None,
    hparams: str = "checkpoint",
    weights_only: bool = True,
    io: IOConfig | None = None,
) -> Gathered:
    """Read and check every row of ``layout`` from the checkpoint at ``path`` (sharded or not); see the module
    docstring. Nothing of ``opt`` changes here."""
    with Parts(checkpoint_path(path)) as parts:  # the map and every part from the one checkpoint
        return gather_parts(opt, parts, layout, scratch, scheduler=scheduler, hparams=hparams,
                            weights_only=weights_only, io=io)  # fmt: skip


def gather_parts(opt: ChunkedState, parts: Parts, layout: Layout, scratch: str, *, scheduler: Any = None,
                 hparams: str = "checkpoint", weights_only: bool = True, io: IOConfig | None = None,
                 share: tuple[int, int] = (0, 1)) -> Gathered:  # fmt: skip
    """``gather`` from the checkpoint ``parts`` opened (a caller that looked at it first: sharded.py). ``share``:
    this rank and the world size of a collective load, whose ranks split the check of the parts' objects.pt (the
    module docstring)."""
    first = parts.reader(0)
    try:
        return _gather(opt, parts, first, layout, scratch, scheduler=scheduler, hparams=hparams,
                       weights_only=weights_only, io=io, share=share)  # fmt: skip
    finally:
        first.close()


def _gather(opt: ChunkedState, parts: Parts, first: CheckpointReader, layout: Layout, scratch: str, *,
            scheduler: Any, hparams: str, weights_only: bool, io: IOConfig | None,
            share: tuple[int, int]) -> Gathered:  # fmt: skip
    root = parts.root
    names = [n for n, *_ in layout]
    want = {n: (tuple(s), r0, r) for n, s, r0, r in layout}
    objs = first.objects(weights_only=weights_only, hparams=hparams == "checkpoint")
    _check_fit(opt, root, layout, parts.held[0], first, len(objs["param_groups"]) if hparams == "checkpoint" else None)
    if scheduler is not None and objs["scheduler"] is None:
        raise ValueError(
            f"checkpoint {root} holds no scheduler state (it was saved without scheduler=): load without "
            "scheduler=, or build the scheduler afresh"
        )
    saved_steps = {p.name: p.step for p in first.manifest.params}  # every rank counts every parameter
    info = {"path": root, "step": first.manifest.step, "extra": objs["extra"], "scheduler": objs["scheduler"]}
    rows = [[mapped_empty(scratch, p.numel()).view(-1) for p in opt.params] for _ in range(3)]
    covered = [0] * len(names)
    saved = {s.name: ParamEntry(s.name, s.shape, "", 0, 0, 0, saved_steps.get(s.name, 0)) for s in parts.held[0]}
    for i, (n, p) in enumerate(zip(names, opt.params)):
        if n in saved and holds_no_state(saved[n]) and want[n][2] > 0:  # frozen at the save: starts fresh, as torch
            rows[0][i].copy_(p.detach().reshape(-1))
            rows[1][i].zero_()
            rows[2][i].zero_()
            covered[i] = want[n][2]
    for k, held in enumerate(parts.held):
        theirs = {s.name: s for s in held}
        hits = [i for i, n in enumerate(names) if n in theirs and _overlap(want[n], theirs[n])[1] > 0]
        if not hits and k % share[1] != share[0]:
            continue
        reader = first if k == 0 else parts.reader(k)
        try:
            if reader is not first:  # first's was read whole above, unpickled
                reader.objects_bytes()  # checked, as a load at the saved layout checks its part's: unused here
            if hits:
                _read_part(reader, hits, names, want, theirs, rows, covered, io)
        finally:
            if reader is not first:
                reader.close()  # its descriptors: one part's open at a time, whatever the world size saved
    short = [f"{n}: {covered[i]} of {want[n][2]} rows found" for i, n in enumerate(names) if covered[i] != want[n][2]]
    if short:  # the map tiles every parameter (shardmap.py) and _check_fit matched them: not reached
        raise CheckpointError(f"checkpoint {root}: rows missing after a checked map ({'; '.join(short)}): a bug")
    groups = objs["param_groups"] if hparams == "checkpoint" else None
    return Gathered(opt, rows, [saved_steps.get(n, 0) for n in names], info, groups, scheduler)


def _read_part(reader: CheckpointReader, hits: list[int], names: list[str], want: dict[str, Any],
               theirs: dict[str, Shard], rows: list[list[torch.Tensor]], covered: list[int],
               io: IOConfig | None) -> None:  # fmt: skip
    """Our rows ``hits`` (indices into ``names``) that part ``reader`` holds, read into ``rows``."""
    entries = {p.name: p for p in reader.manifest.params}
    ranges = []  # (first element in the part's row files, the views of ours it fills: one a row file)
    for i in hits:
        n = names[i]
        (shape, r0, _), saved = want[n], theirs[n]
        start, count = _overlap(want[n], saved)
        row = row_numel(shape)
        mine = slice((start - r0) * row, (start - r0 + count) * row)
        ranges.append((entries[n].offset + (start - saved.first) * row, [rows[r][i][mine] for r in range(3)]))
        covered[i] += count
    # Only the saved records (CRC segments: one a chunk) that hold rows of ours are read, each whole.
    with reader.stream(io) as s:
        for r in range(3):
            s.read_ranges(r, [(at, views[r]) for at, views in ranges])


def _check_fit(opt: ChunkedState, root: str, layout: Layout, saved: list[Shard], first: CheckpointReader,
               saved_groups: int | None) -> None:  # fmt: skip
    """Names, global shapes and (``saved_groups``) param groups, as a plain load checks them: every difference."""
    groups = {p.name: p for p in first.manifest.params}
    theirs = {
        s.name: ParamEntry(s.name, s.shape, groups[s.name].dtype, 0, 0, groups[s.name].group, groups[s.name].step)
        for s in saved
    }
    mine = [
        ParamEntry(n, tuple(s), p.dtype, 0, 0, p.group, 0) for (n, s, _, _), p in zip(layout, optimizer_params(opt))
    ]
    problems = mismatches(mine, theirs, saved_groups, len(opt.param_groups))
    if problems:
        raise CheckpointMismatchError(root, problems, mismatch_fix(list(opt.param_names), list(theirs)))


def _overlap(mine: tuple[tuple[int, ...], int, int], theirs: Shard) -> tuple[int, int]:
    """The first global row and the count of rows two shards of one parameter share."""
    start = max(mine[1], theirs.first)
    return start, max(0, min(mine[1] + mine[2], theirs.first + theirs.rows) - start)
