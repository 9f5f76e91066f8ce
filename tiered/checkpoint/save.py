"""save_checkpoint: a TieredOptimizer's state, streamed from its store's pinned buffers into a checkpoint.

Call order: between steps (not during one), ``save_checkpoint(opt, path, extra=..., scheduler=...)``. ``opt``
is seen only as a ``plan.ChunkedState`` (this package never imports the optimizer); what goes where in the
row files (parameters end to end, chunk runs) is planned in ``plan.py``, which load uses too.

Data path, per state chunk, in scan order, reads running ahead as in the step (tiered.store.scan's one rule)::

    reads.through(i)                          NVMe -> pinned buffer (io_engine threads) for the next
                                              ``prefetch_depth`` chunks that live on NVMe, within host_budget
    with pinned_in_host(store, chunk i) as t:
        writer.write(r, first, rows[r])       rows = state.chunk_state_rows(chunk, t): pinned buffer -> row file r
    ... wait for chunk i-1's writes, unpin it, store.retire(chunk i-1)

So the state moves file to file through the store's own pinned buffers: no GPU memory, no copy, and no
host memory beyond the host budget (the CRCs are taken from the pinned buffers while they are written).
Chunks that split their masters (master_split.py) are the exception for one row: their fp32 masters are
joined with the parameters into one chunk-sized tensor, written from there; and a chunk kept in HBM
(``gpu_budget``) stays there and is written from a host copy of it.
A chunk covers consecutive elements of consecutive parameters, so each of its rows is one contiguous range
of a row file: one pwrite per chunk and row.

Why not hard links or reflinks of the store's record files: the store rewrites a record file in place
when the chunk is written back, so a hard link would change under the checkpoint. A reflink (FICLONE)
would be safe, but works only on btrfs/XFS, within one filesystem, with block-aligned ranges; the store's
files interleave the three rows per chunk (so the checkpoint would take the chunk layout, and lose
portability across chunk sizes), and dirty chunks in host memory would have to be flushed first. See
bench/checkpoint_bench.py for the figures behind this choice.
"""

from __future__ import annotations

import io as _io
import numbers
import os
import warnings
from contextlib import ExitStack
from typing import Any

import torch

from io_engine import IOConfig, IOFuture

from ..layout.chunking import STATE_ROWS
from ..progress import progress
from ..store.scan import pinned_in_host, read_ahead, windowed
from .fsops import test_hook
from .manifest import Manifest, json_view, new_save_id
from .plan import ChunkedState, check_chunked_state, chunk_runs, optimizer_params, own_save
from .validate import checkpoint_path
from .writer import CheckpointWriter


def plain(value: Any) -> Any:
    """A hyperparameter as a plain Python number: the constructor accepts one-element tensors (betas, eps,
    weight_decay, as torch's AdamW does) and numpy scalars (an lr from np.sqrt or np.logspace), which load
    (``weights_only=True``, and validate.py's checks) refuses; tiered's update reads them as floats anyway. Tuples
    and lists (betas) are converted element by element; a tensor or numpy array of several elements (betas as one
    of two, which the step takes as torch's does) becomes a tuple of its numbers, one of one element (a 0-d numpy
    lr) its number; anything else is kept."""
    if isinstance(value, torch.Tensor) or _is_array(value):
        return plain(value.item()) if _size(value) == 1 else plain(tuple(value.tolist()))
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return type(value)(plain(v) for v in value) if isinstance(value, (tuple, list)) else value
    return int(value) if isinstance(value, numbers.Integral) else float(value)  # numpy's too: numbers registers them


def _is_array(value: Any) -> bool:
    """A numpy array or scalar, told by what it has: numpy need not be imported for it."""
    return callable(getattr(value, "tolist", None)) and isinstance(getattr(value, "shape", None), tuple)


def _size(value: Any) -> int:
    return value.numel() if isinstance(value, torch.Tensor) else int(value.size)


def saved_groups(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The param groups as a checkpoint holds them: without their parameters, every value ``plain``."""
    return [{k: plain(v) for k, v in g.items() if k != "params"} for g in param_groups]


def _saved(obj: Any) -> bytes:
    buf = _io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads_safely(blob: bytes) -> bool:
    try:
        torch.load(_io.BytesIO(blob), weights_only=True)
        return True
    except Exception:  # noqa: BLE001 - any refusal means "needs weights_only=False"
        return False


def objects_blob(param_groups: list[dict[str, Any]], scheduler_state: Any, extra: Any) -> tuple[bytes, bool]:
    """torch.save of the small objects; and whether torch.load(weights_only=True) can read them back."""
    blob = _saved({"param_groups": saved_groups(param_groups), "scheduler": scheduler_state, "extra": extra})
    return blob, _loads_safely(blob)


def unsafe_parts(param_groups: list[dict[str, Any]], scheduler_state: Any, extra: Any) -> list[str]:
    """Which of the small objects torch.load(weights_only=True) refuses, for the warning to name."""
    parts = {"param_groups": saved_groups(param_groups), "the scheduler state": scheduler_state, "extra": extra}
    return [name for name, obj in parts.items() if not _loads_safely(_saved(obj))]


def versions() -> dict[str, str]:
    from .._version import __version__

    return {"tiered": __version__, "torch": torch.__version__}


def manifest_estimate(n_params: int, n_segments: int) -> int:
    return 4096 + 320 * n_params + 3 * 48 * n_segments


def save_checkpoint(
    opt: ChunkedState,
    path: str | os.PathLike[str],
    *,
    extra: dict[str, Any] | None = None,
    scheduler: Any = None,
    keep_last: int | None = None,
    io: IOConfig | None = None,
) -> str:
    """Save ``opt``'s full training state to the folder ``path``, atomically; returns its absolute path.

    Holds the fp32 master weights (the model's trained parameters come from them), AdamW's moments and
    step counts, the param groups' hyperparameters, ``scheduler.state_dict()`` when a scheduler is given,
    and ``extra`` (a dict of your own: epoch, data position, RNG states). Overwriting an existing
    checkpoint is safe; ``keep_last=N`` then deletes the oldest checkpoints of the same series (sibling
    folders whose names differ only in their last number: "step-200" prunes "step-100", never "best" nor
    "seed2-step-100") beyond N. ``io``: the IOConfig for the files
    (default ``IOConfig.from_env()``).

    ``opt``: a TieredOptimizer, which saves through its own ``opt.save_checkpoint`` (one way to save it: under its
    lock, refused while it is broken, writes through ``opt.state[p]`` included, collectively under FSDP2), or a
    ``plan.ChunkedState`` (``opt.chunked_state``, a test fake), saved as it is.

    Raises InsufficientSpaceError (before writing) when the disk cannot hold it, CheckpointPathError when
    ``path`` holds something else; after any failure before the commit (the rename into place) the previous
    checkpoint at ``path`` is intact. A failure after it (the folder's fsync, pruning) is CheckpointCommittedError,
    which says that ``path`` holds the new checkpoint, whole.
    """
    path = checkpoint_path(path)  # first: "" (an unset variable) is refused, not taken for the current folder
    kw = dict(extra=extra, scheduler=scheduler, keep_last=keep_last, io=io)
    own = own_save(opt)
    if own is not None:  # a TieredOptimizer: its own save (lock, broken check, opt.state writes, FSDP2's collective)
        return own(path, **kw)
    return write_checkpoint(opt, path, **kw)


def write_checkpoint(
    opt: ChunkedState,
    path: str | os.PathLike[str],
    *,
    extra: dict[str, Any] | None = None,
    scheduler: Any = None,
    keep_last: int | None = None,
    io: IOConfig | None = None,
    shard: dict[str, Any] | None = None,
    save_id: str | None = None,
) -> str:
    """``save_checkpoint``; ``shard``: a rank's part of a sharded checkpoint records which rows it holds
    (``ShardMap.part_record``) in its manifest, under the manifest's CRC, for loaders to check the map by;
    ``save_id``: the collective save's identity, which every part shares with the map (a new one otherwise)."""
    opt = check_chunked_state(opt)
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict (e.g. {{'epoch': 3}}) or None, got {type(extra).__name__}")
    if scheduler is not None and not callable(getattr(scheduler, "state_dict", None)):
        raise TypeError(
            f"scheduler must have a state_dict() method (a torch lr scheduler), got {type(scheduler).__name__}"
        )
    params = optimizer_params(opt)
    sched_state = None if scheduler is None else scheduler.state_dict()
    blob, weights_only = objects_blob(opt.param_groups, sched_state, extra)
    if not weights_only:
        where = " and ".join(unsafe_parts(opt.param_groups, sched_state, extra))
        warnings.warn(
            f"the checkpoint {os.fspath(path)} holds objects (in {where}) that torch.load(weights_only=True) "
            "refuses: load it with weights_only=False, or keep plain values (numbers, strings, lists, dicts, "
            f"tensors) in {where}",
            RuntimeWarning,
            stacklevel=2,
        )
    numel = sum(p.numel for p in params)
    writer = CheckpointWriter(
        path,
        numel=numel,
        objects=blob,
        io=io,
        keep_last=keep_last,
        manifest_bytes=manifest_estimate(len(params), len(opt.chunks)),
    )
    with writer:
        stream_chunks(opt, writer, [p.offset for p in params])
        manifest = Manifest(
            step=int(opt.global_step),
            params=params,
            files={},
            param_groups=[json_view(g) for g in saved_groups(opt.param_groups)],
            has_scheduler=scheduler is not None,
            extra_keys=sorted(str(k) for k in (extra or {})),
            objects_weights_only=weights_only,
            source={
                "chunk_bytes": int(opt.chunk_bytes),
                "host_budget": int(opt.host_budget),
                "chunks": len(opt.chunks),
                "prefetch_depth": int(opt.prefetch_depth),
                "save_id": save_id or new_save_id(),
                **({} if shard is None else {"shard": shard}),
            },
            versions=versions(),
        )
        return writer.commit(manifest)


def stream_chunks(opt: ChunkedState, writer: CheckpointWriter, first_of_param: list[int]) -> None:
    """Write every chunk's three rows, pipelined as described in the module docstring.

    Reads run ahead by tiered.store.scan's rule: ``prefetch_depth`` chunks that must come from NVMe, resident ones
    not counted (they need no read). With ``prefetch_depth == 0`` (the optimizer's serial twin, or a host
    budget of one chunk) it is serial too: each chunk read when pinned, one pinned at a time. Otherwise two
    chunks are pinned (one being written, one being set up) and ``prefetch_depth`` are on their way, which
    is what the optimizer's own step holds at most.
    """
    store, chunks = opt.store, opt.chunks
    depth = int(opt.prefetch_depth)
    reads = read_ahead(store, [c.key for c in chunks], depth)

    def open_item(i: int) -> tuple[ExitStack, list[IOFuture]]:
        futs: list[IOFuture] = []
        chunk, stack = chunks[i], ExitStack()
        try:
            t = stack.enter_context(pinned_in_host(store, chunk.key))  # a chunk in HBM stays there
            # fp32 rows: views of the pinned record, except split masters, joined into a new tensor that
            # the stack keeps alive until the writes that read it have landed.
            rows = opt.chunk_state_rows(chunk, t)
            stack.callback(lambda rows=rows: None)  # type: ignore[misc]  # mypy infers no lambda with a default
            for r in range(len(STATE_ROWS)):
                for run in chunk_runs(chunk, first_of_param):
                    futs.append(writer.write(r, run.first, rows[r][run.in_chunk]))
            bar.update(12 * chunk.numel)  # fp32 rows, whatever the record's layout
            test_hook("chunk")
        except BaseException:
            with stack:  # the writes started so far land before the chunk is unpinned
                settle(futs)
            raise
        return stack, futs

    def close_item(i: int, item: tuple[ExitStack, list[IOFuture]], failed: bool) -> None:
        stack, futs = item
        with stack:  # unpins only after every write of the chunk has landed, failed or not
            error = settle(futs)
        if failed:
            return
        if error is not None:
            writer.wait(error)  # raises it, a full disk as InsufficientSpaceError
        store.retire(chunks[i].key)  # a streaming chunk leaves host memory again; a resident one stays

    with progress(sum(12 * c.numel for c in chunks), "tiered: saving the checkpoint") as bar:
        windowed(len(chunks), 2 if depth else 1, open_item, close_item, ahead=reads.through)


def settle(futs: list[IOFuture]) -> IOFuture | None:
    """Wait for every future; return the first that failed (None if none did)."""
    failed = None
    for f in futs:
        if f.exception() is not None and failed is None:
            failed = f
    return failed
