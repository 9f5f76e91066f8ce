"""load_checkpoint: a checkpoint's state, streamed by parameter name into a TieredOptimizer's store.

``opt`` is seen only as a ``plan.ChunkedState`` (this package never imports the optimizer), laid out by the
same plan as the save (``plan.optimizer_params``, ``plan.chunk_runs``).

Call order: build the optimizer on the same model (any chunk_bytes, host_budget or nvme_path), then
``info = load_checkpoint(opt, path, scheduler=sched)`` before the first step; ``info["extra"]`` is your dict.
Given a TieredOptimizer, that is its own ``opt.load_checkpoint`` (``plan.own_load``), which comes back here.
``load_checkpoint`` is ``prepare_checkpoint`` (every check) then ``install``; an optimizer that lays its state
out again between the two (frozen parameters the checkpoint holds state for) installs into the new layout.

Everything that can be checked without reading the data is checked before the optimizer is touched: the
manifest (its own CRC, then every name and number: validate.py), every file's presence, type (no links)
and size, objects.pt's CRC and its param groups (the constructor's checks, unless ``hparams="keep"``), and
that the names, shapes and param groups fit. Then the chunk scan (``tiered.store.scan.windowed``, two chunks
open, so that chunk i+1 is read while chunk i is installed) over the target chunks::

    open chunk i+1:   pread each run of its rows into the other staging buffer, by name:
                      file element = checkpoint offset of the parameter + start
    close chunk i:    wait for its reads, then
    CRC the bytes into the saver's segments (reader.SegmentChecker): a bad segment raises, naming the file
    opt.install_chunk_rows(chunk, rows)       store.put (split masters first split against the weights);
                                              the parameters get the loaded master weights (cast)

The chunk's old contents are never read (``put`` replaces the record), so a load reads each byte of the
checkpoint once and nothing else. Host memory: the store's budget plus two chunk-sized staging buffers
(one when the optimizer runs its serial twin).

A corrupted segment is found when its last byte is read. With ``verify="stream"`` (one pass over the
data) that may be after earlier chunks were loaded: the error then says the optimizer is partly loaded.
``verify="first"`` reads and checks the whole checkpoint before touching anything (two passes).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal

import torch

from io_engine import IOConfig, IOFuture, PinnedBufferPool, pool_bytes

from ..layout.chunking import STATE_ROWS, Chunk
from ..progress import progress
from ..store.scan import windowed
from .errors import CheckpointCorruptError, CheckpointMismatchError
from .fsops import readable
from .manifest import ParamEntry
from .plan import (
    ChunkedState,
    check_chunked_state,
    chunk_runs,
    holds_no_state,
    mismatch_fix,
    mismatches,
    optimizer_params,
    own_load,
)
from .reader import CheckpointReader, RowStream
from .reshard import Gathered, Parts, gather, scratch_folder, whole_layout
from .shardmap import is_sharded
from .validate import checkpoint_path, restore_groups
from .verify import verify_files


def load_checkpoint(
    opt: ChunkedState,
    path: str | os.PathLike[str],
    *,
    scheduler: Any = None,
    hparams: Literal["checkpoint", "keep"] = "checkpoint",
    verify: Literal["stream", "first"] = "stream",
    weights_only: bool = True,
    io: IOConfig | None = None,
) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``opt``: master weights (and so the parameters), moments, step
    counts, hyperparameters, and ``scheduler``'s state when given. Parameters are matched by name.

    ``opt``: a TieredOptimizer, which loads through its own ``opt.load_checkpoint`` (one way to load into it: under
    its lock, all or nothing, state the checkpoint holds for a parameter frozen there laid out first), or a
    ``plan.ChunkedState`` (``opt.chunked_state``, a test fake), loaded into as it is laid out.

    ``hparams="keep"`` keeps ``opt``'s own param groups and hyperparameters (e.g. a new lr; the checkpoint
    may then have other groups). ``verify``: "stream" or "first" (see the module docstring).
    ``weights_only``: how objects.pt is unpickled (False only for checkpoints you trust).

    A checkpoint saved by several ranks (FSDP2) loads here as world size 1: every parameter is gathered whole
    from the ranks' parts (reshard.py), each record read and checked before the optimizer is touched.

    Returns ``{"path", "step", "extra", "scheduler"}`` (``scheduler``: the saved scheduler state dict).
    Raises CheckpointNotFoundError, CheckpointCorruptError (names the file), CheckpointMismatchError
    (lists every name/shape/group difference), CheckpointFormatError.
    """
    path = checkpoint_path(path)  # first: "" (an unset variable) is refused, not taken for the current folder
    kw = dict(scheduler=scheduler, hparams=hparams, verify=verify, weights_only=weights_only, io=io)
    own = own_load(opt)
    if own is not None:  # a TieredOptimizer: its own load (lock, all or nothing, frozen parameters laid out first)
        return own(path, **kw)
    return prepare_checkpoint(check_chunked_state(opt), path, **kw).install()


def prepare_checkpoint(opt: ChunkedState, path: str | os.PathLike[str], *, scheduler: Any = None,
                       hparams: str = "checkpoint", verify: str = "stream", weights_only: bool = True,
                       io: IOConfig | None = None) -> PreparedLoad | Gathered:  # fmt: skip
    """``load_checkpoint``'s first half: the arguments and the checkpoint at ``path`` (sharded or not) checked
    against ``opt``, nothing of it changed; ``.install()`` loads it. ``install(into)`` loads it into ``into``
    instead: ``opt`` laid out again once this has checked it (TieredOptimizer.load_checkpoint, for state the
    checkpoint holds for parameters frozen there: ``opt`` then shows them with their shapes)."""
    check_load_arguments(scheduler, hparams, verify)
    path = readable(checkpoint_path(path))  # an aside put back first, or read where it is: sharded too
    if is_sharded(path):
        kw = dict(scheduler=scheduler, hparams=hparams, weights_only=weights_only, io=io)
        return gather(opt, path, whole_layout(opt), scratch_folder(opt), **kw)
    return prepare_load(opt, path, scheduler=scheduler, hparams=hparams, verify=verify, weights_only=weights_only,
                        io=io)  # fmt: skip


def saved_entries(path: str | os.PathLike[str]) -> dict[str, tuple[tuple[int, ...], int]]:
    """Each parameter of the checkpoint at ``path`` (saved by one process or several) by name: its shape (the
    global one of a sharded checkpoint; ``[0]`` for one frozen at the save) and its step count. It holds state for
    those stepped, zero-size ones among them. An entry never stepped holds none, as in a state dict (torch's AdamW
    keeps none): frozen at the save (``plan.holds_no_state``), or frozen after the state was laid out but before
    any step (its shape saved, zero moments). Read from its manifest, or its map and first part's manifest, alone
    (checked)."""
    with Parts(checkpoint_path(path)) as parts:
        first = parts.reader(0)
        try:
            steps = {p.name: p.step for p in first.manifest.params}  # every rank counts every parameter
        finally:
            first.close()
        return {s.name: (tuple(s.shape), steps.get(s.name, 0)) for s in parts.held[0]}


def check_load_arguments(scheduler: Any, hparams: str, verify: str) -> None:
    if hparams not in ("checkpoint", "keep"):
        raise ValueError(f"hparams must be 'checkpoint' (restore the saved param groups) or 'keep', got {hparams!r}")
    if verify not in ("stream", "first"):
        raise ValueError(f"verify must be 'stream' (check while loading) or 'first' (check, then load), got {verify!r}")
    if scheduler is not None and not callable(getattr(scheduler, "load_state_dict", None)):
        raise TypeError(f"scheduler must have load_state_dict() (a torch lr scheduler), got {type(scheduler).__name__}")


class PreparedLoad:
    """A single-process checkpoint checked against an optimizer (``prepare_load``); ``install`` streams it in."""

    def __init__(self, opt: ChunkedState, reader: CheckpointReader, objs: dict[str, Any], *, scheduler: Any,
                 hparams: str, io: IOConfig | None) -> None:  # fmt: skip
        self.opt, self.reader, self.objs = opt, reader, objs
        self.scheduler, self.hparams, self.io = scheduler, hparams, io

    def install(self, into: ChunkedState | None = None) -> dict[str, Any]:
        """Stream the checkpoint into the state it was checked against, or ``into``: that state laid out again
        since (the same names, groups and shapes: ``prepare_checkpoint``)."""
        # Everything was checked (steps >= 0, hyperparameters as the constructor wants them): from here only a
        # CRC that fails mid-stream can stop the load, and that error says the optimizer is partly loaded.
        opt, reader, objs = into or self.opt, self.reader, self.objs
        saved = {p.name: p for p in reader.manifest.params}
        # A stand-in of a parameter frozen here that the checkpoint lacks (plan.mismatches let it through): no state.
        entries = [saved.get(n) or ParamEntry(n, (0,), "float32", 0, 0, 0, 0) for n in opt.param_names]
        steps = [e.step for e in entries]
        fresh = [holds_no_state(e) and p.numel() > 0 for e, p in zip(entries, opt.params)]
        unused = [(e.offset, e.numel) for e, p in zip(entries, opt.params) if not p.numel()]
        here = set(opt.param_names)  # entries never stepped for no parameter here: their rows are only checked
        unused += [(e.offset, e.numel) for n, e in saved.items() if n not in here]
        stream_into(opt, reader, [e.offset for e in entries], self.io, fresh, unused)
        opt.set_step_counts(steps, reader.manifest.step)
        if self.hparams == "checkpoint":
            restore_groups(opt.param_groups, objs["param_groups"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(objs["scheduler"])
        m = reader.manifest
        return {"path": reader.path, "step": m.step, "extra": objs["extra"], "scheduler": objs["scheduler"]}


def prepare_load(
    opt: ChunkedState,
    path: str | os.PathLike[str] | CheckpointReader,
    *,
    scheduler: Any = None,
    hparams: str = "checkpoint",
    verify: str = "stream",
    weights_only: bool = True,
    io: IOConfig | None = None,
) -> PreparedLoad:
    """Every check of a single-process checkpoint that touches nothing of ``opt`` (with ``verify="first"``,
    every byte's CRC too); ``.install()`` then loads it. The arguments are ``load_checkpoint``'s, checked;
    ``path`` may be a reader opened already (a rank's part of a sharded checkpoint, through its map's folder)."""
    # Every field of the manifest checked, and every file's type and size.
    reader = path if isinstance(path, CheckpointReader) else CheckpointReader(path)
    objs = reader.objects(weights_only=weights_only, hparams=hparams == "checkpoint")
    saved = {p.name: p for p in reader.manifest.params}
    saved_groups = len(objs["param_groups"]) if hparams == "checkpoint" else None
    problems = mismatches(optimizer_params(opt), saved, saved_groups, len(opt.param_groups))
    if problems:
        raise CheckpointMismatchError(reader.path, problems, mismatch_fix(list(opt.param_names), list(saved)))
    if scheduler is not None and objs["scheduler"] is None:
        raise ValueError(
            f"checkpoint {reader.path} holds no scheduler state (it was saved without scheduler=): "
            "load without scheduler=, or build the scheduler afresh"
        )
    if verify == "first":
        verify_files(reader, io)
    return PreparedLoad(opt, reader, objs, scheduler=scheduler, hparams=hparams, io=io)


RunReads = list[tuple[int, int, torch.Tensor, IOFuture]]  # (row, first file element, destination view, its read)


def stream_into(opt: ChunkedState, reader: CheckpointReader, first_of_param: list[int], io: IOConfig | None,
                fresh: list[bool] | None = None, unused: Sequence[tuple[int, int]] = ()) -> None:  # fmt: skip
    """Read every chunk of ``opt`` from the row files (by the given element offsets) into its store.
    ``fresh[i]``: parameter ``i`` has no state in the checkpoint (``plan.holds_no_state``): nothing is read for it,
    it starts as torch's AdamW starts a parameter (master = the parameter, zero moments). ``unused``: ranges of the
    row files (first element, count) that no chunk takes (``plan.loads_as_no_state``), read first and only checked,
    so that every segment's CRC is (a bad one is found before anything is installed).

    The chunk scan (``tiered.store.scan.windowed``) over the row files: opening chunk i starts its preads into
    staging buffer ``i % slots``; closing it waits for them, checks their CRCs and installs it. Two buffers,
    two chunks open: chunk i+1 is read while chunk i is checked and installed. One, strictly serial, when the
    optimizer runs its serial twin (``prefetch_depth == 0``).
    """
    chunks = list(opt.chunks)
    if not chunks:  # every parameter frozen or zero-size: the checkpoint's rows, if any, are unused ones
        with reader.stream(io) as stream:
            most = min(max((n for _, n in unused), default=0), opt.chunk_bytes // 4)  # a staging buffer's worth
            _check_unused(stream, unused, torch.empty(max(1, most), dtype=torch.float32))
            stream.finish()  # which this proves: it raises if a row file holds a segment after all (a loader bug)
        return
    slots = 2 if opt.prefetch_depth else 1
    row_bytes = [len(STATE_ROWS) * 4 * c.numel for c in chunks]  # fp32 rows, whatever the store's layout
    largest = max(row_bytes)
    # The stream (its engine) closes before the pool: no read can land in a freed buffer, whatever fails.
    with PinnedBufferPool(slots * pool_bytes([largest])) as pool, reader.stream(io) as stream:
        bufs = [pool.acquire(largest) for _ in range(slots)]

        def open_item(i: int) -> tuple[torch.Tensor, RunReads]:
            chunk = chunks[i]  # its buffer is free: the chunk that used it last was installed (closed) already
            rows = bufs[i % slots].tensor[: row_bytes[i]].view(torch.float32).view(len(STATE_ROWS), chunk.numel)
            reads: RunReads = []
            for pc in chunk.pieces:
                if fresh is not None and fresh[pc.param]:
                    rows[:, pc.in_chunk] = 0
                    rows[0, pc.in_chunk] = opt.params[pc.param].detach().reshape(-1)[pc.in_param]
            try:
                for r in range(len(STATE_ROWS)):
                    for run in chunk_runs(chunk, first_of_param, fresh):
                        view = rows[r, run.in_chunk]
                        reads.append((r, run.first, view, stream.read(r, run.first, view)))
            except BaseException:
                _land(reads)
                raise
            return rows, reads

        def close_item(i: int, item: tuple[torch.Tensor, RunReads], failed: bool) -> None:
            rows, reads = item
            if failed:  # reads in flight land before their buffers go back
                _land(reads)
                return
            bar.update(row_bytes[i])
            try:
                _install(opt, stream, chunks[i], rows, reads, partial_load=i > 0)
            except BaseException:
                _land(reads)  # a failed wait leaves the chunk's other reads in flight
                raise

        try:
            _check_unused(stream, unused, bufs[0].tensor[:largest].view(torch.float32))
            with progress(sum(row_bytes), "tiered: loading the checkpoint") as bar:
                windowed(len(chunks), slots, open_item, close_item)
            bad = stream.finish()
            if bad:
                raise CheckpointCorruptError(reader.path, bad, partial_load=True)
        finally:
            for b in bufs:
                b.release()


def _check_unused(stream: RowStream, unused: Sequence[tuple[int, int]], buf: torch.Tensor) -> None:
    """Read the row-file ranges ``unused`` (first element, count) through ``buf`` (flat fp32: a staging buffer),
    only to check their CRCs (a segment they share with a range the load takes completes there)."""
    for r in range(len(STATE_ROWS)):
        for first, n in unused:
            for at in range(first, first + n, buf.numel()):
                view = buf[: min(buf.numel(), first + n - at)]
                stream.wait(stream.read(r, at, view))
                bad = stream.check(r, at, view)
                if bad:
                    raise CheckpointCorruptError(stream.reader.path, bad)


def _land(reads: RunReads) -> None:
    """Wait for every read of a chunk to end, failed or not."""
    for *_, fut in reads:
        fut.exception()


def _install(
    opt: ChunkedState,
    stream: RowStream,
    chunk: Chunk,
    rows: torch.Tensor,
    reads: RunReads,
    *,
    partial_load: bool,
) -> None:
    """Wait for a chunk's reads, check their CRCs, then hand the chunk to the store and the parameters.

    ``partial_load``: earlier chunks are in already, so an error here leaves the optimizer partly loaded.
    """
    for _, _, _, fut in reads:
        stream.wait(fut, partial_load=partial_load)
    for r, first, view, _ in reads:
        bad = stream.check(r, first, view)
        if bad:
            raise CheckpointCorruptError(stream.reader.path, bad, partial_load=partial_load)
    event = opt.install_chunk_rows(chunk, rows)  # the store copies; the H2D copy may still read rows
    if event is not None:
        event.synchronize()  # the H2D copy reads the staging buffer, which the next chunk reuses
