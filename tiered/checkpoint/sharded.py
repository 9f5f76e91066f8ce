"""Collective NVMe-tier checkpoints of an optimizer whose parameters FSDP2 shards across ranks.

Layout: one folder, committed as a whole by rank 0, holding one complete single-process checkpoint per
rank (save.py writes it: streamed through that rank's pinned buffers, checksummed) and ``shards.json``, the
map from each rank's local shards to the global parameters::

    path/
      shards.json      {"format": 1, "world_size": W, "ranks": [{"dir": "rank-00000",
                          "params": [[name, global_shape, first_row, rows], ...]}, ...]}
      rank-00000/      manifest.json, the row files, objects.pt: rank 0's shards as a checkpoint of their own
      rank-00001/ ...

Save, every rank: rank 0 prepares a hidden temp folder beside ``path`` (fsops.py's protocol) and
broadcasts its name; each rank saves its own checkpoint into it; the ranks' outcomes are all-gathered, so a
failure on any rank is raised on every rank and nothing is committed; rank 0 writes ``shards.json``, fsyncs
and renames the temp folder into place (an atomic exchange over a previous checkpoint). A kill -9 of any
rank at any point before that rename leaves the previous checkpoint at ``path`` untouched.

Load, every rank, at any world size: with the same layout (world size and every shard's rows), each rank
loads its own subfolder through load.py. Otherwise each rank rebuilds the rows of its shards, in
disk-backed memory in its own folder, from the saved shards that overlap them: FSDP2 shards dimension 0,
so the rows of a parameter are contiguous in every shard, and so are its elements in a part's row files.
Of each saved part it reads only the records (the row files' CRC segments, one per chunk at save time) that
hold rows it needs, each read whole and checked (a CRC covers a whole record), one or two in host memory
at a time; the others are never read. Then it installs its chunks one at a time. The outcomes are
all-gathered: a failure on any rank (a damaged record it needed, say) is raised on every rank.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from typing import Any

import torch

from io_engine import fsync_dir

from ..workdir import mapped_empty
from .errors import CheckpointError, CheckpointFormatError, CheckpointMismatchError, CheckpointNotFoundError
from .fsops import SHARDS, commit, hidden_name, is_checkpoint, makedirs_durable, recover, sweep, write_file
from .load import load_checkpoint
from .plan import ChunkedState
from .reader import CheckpointReader
from .save import save_checkpoint
from .writer import prune

__all__ = ["SHARDS", "Layout", "save_sharded", "load_sharded", "is_sharded"]

FORMAT = 1
Layout = list[tuple[str, tuple[int, ...], int, int]]  # per parameter: name, global shape, first row, rows


def is_sharded(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, SHARDS))


def _rank_dir(rank: int) -> str:
    return f"rank-{rank:05d}"  # rank 0's is fsops.FIRST_PART, whose manifest dates the whole (prune, latest)


def _all(dist: Any, outcome: tuple[str, Any]) -> list[tuple[str, Any]]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, outcome)
    return out


def _from_rank0(dist: Any, fn: Any) -> Any:
    """``fn()`` on rank 0, its result (or its error, raised) on every rank."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box = [("ok", fn())]
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others wait forever
            box = [("error", f"{type(e).__name__}: {e}")]
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise CheckpointError(f"rank 0: {value}")
    return value


def save_sharded(opt: ChunkedState, path: str | os.PathLike[str], layout: Layout, **kw: Any) -> str:
    """Save every rank's shards under ``path`` (collective: every rank calls it). ``layout``: this rank's
    shards (``Shards.layout()``); ``**kw``: as ``save_checkpoint`` (``extra``, ``scheduler``, ``io``)."""
    import torch.distributed as dist

    keep_last = kw.pop("keep_last", None)
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(
            f"keep_last must be an int >= 1 (checkpoints of this series to keep) or None, got {keep_last!r}"
        )
    final = os.path.abspath(os.fspath(path))
    rank = dist.get_rank()

    def prepare() -> str:
        makedirs_durable(os.path.dirname(final))
        recover(final)
        if os.path.lexists(final) and not (is_sharded(final) or is_checkpoint(final)) and os.listdir(final):
            raise CheckpointError(f"{final} exists and is not a tiered checkpoint; choose another path")
        sweep(os.path.dirname(final))
        temp = hidden_name(final, "tmp")
        os.mkdir(temp)
        return temp

    temp = _from_rank0(dist, prepare)
    try:
        save_checkpoint(opt, os.path.join(temp, _rank_dir(rank)), **kw)
        outcome: tuple[str, Any] = ("ok", [[n, list(s), r0, r] for n, s, r0, r in layout])
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        outcome = ("error", f"rank {rank}: {type(e).__name__}: {e}")
    outcomes = _all(dist, outcome)
    failed = [msg for status, msg in outcomes if status == "error"]
    if failed:
        if rank == 0:
            shutil.rmtree(temp, ignore_errors=True)
        raise CheckpointError("the collective save failed, nothing was committed: " + "; ".join(failed))

    def publish() -> str:
        ranks = [{"dir": _rank_dir(k), "params": params} for k, (_, params) in enumerate(outcomes)]
        doc = {"format": FORMAT, "world_size": len(outcomes), "ranks": ranks}
        write_file(os.path.join(temp, SHARDS), json.dumps(doc).encode())
        fsync_dir(temp)
        old = commit(temp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        if keep_last is not None:
            prune(final, keep_last)
        return final

    return _from_rank0(dist, publish)


def read_shards(path: str) -> dict[str, Any]:
    """``shards.json``, every field checked before it is believed."""
    fpath = os.path.join(path, SHARDS)
    try:
        with open(fpath, "rb") as f:
            doc = json.loads(f.read(64 << 20))
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path} is not a sharded checkpoint (no {SHARDS})") from None
    except (OSError, ValueError) as e:
        raise CheckpointFormatError(f"{fpath} cannot be read as JSON: {e}") from None
    bad = CheckpointFormatError(f"{fpath} is not a tiered shards map (format {FORMAT})")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("ranks"), list):
        raise bad
    if doc.get("world_size") != len(doc["ranks"]) or not doc["ranks"]:
        raise bad
    for k, r in enumerate(doc["ranks"]):
        if not isinstance(r, dict) or r.get("dir") != _rank_dir(k) or not isinstance(r.get("params"), list):
            raise bad
        for entry in r["params"]:
            ok = isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)
            ok = ok and isinstance(entry[1], list) and all(isinstance(d, int) and d >= 0 for d in entry[1])
            ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in entry[2:])
            if not ok or (entry[1] and entry[2] + entry[3] > entry[1][0]):
                raise bad
    return doc


def load_sharded(opt: ChunkedState, path: str | os.PathLike[str], layout: Layout, scratch: str, **kw: Any
                 ) -> dict[str, Any]:  # fmt: skip
    """Load a checkpoint saved by ``save_sharded`` at any world size (collective). ``layout``: this rank's
    shards; ``scratch``: a folder of this rank's for the disk-backed rows; ``**kw``: ``io``, ``weights_only``.
    A failure on any rank is raised on every rank: there its own error, elsewhere a CheckpointError naming it."""
    import torch.distributed as dist

    root = os.path.abspath(os.fspath(path))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        doc = read_shards(root)
        mine = [[n, list(s), r0, r] for n, s, r0, r in layout]
        if doc["world_size"] == world and doc["ranks"][rank]["params"] == mine:
            out = load_checkpoint(opt, os.path.join(root, _rank_dir(rank)), **kw)
        else:
            out = _reshard(opt, root, doc, layout, scratch, **kw)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others wait in the gather forever
        _all(dist, ("error", f"rank {rank}: {type(e).__name__}: {e}"))
        raise
    # Every rank has loaded before any goes on to train, and none trains on when another failed.
    failed = [msg for status, msg in _all(dist, ("ok", None)) if status == "error"]
    if failed:
        raise CheckpointError("the collective load failed: " + "; ".join(failed))
    return out


def _reshard(opt: ChunkedState, root: str, doc: dict[str, Any], layout: Layout, scratch: str, **kw: Any
             ) -> dict[str, Any]:  # fmt: skip
    names = [n for n, *_ in layout]
    want = {n: (tuple(s), r0, r) for n, s, r0, r in layout}
    rows = [[mapped_empty(scratch, p.numel()).view(-1) for p in opt.params] for _ in range(3)]
    covered = [0] * len(names)
    for k, saved in enumerate(doc["ranks"]):
        theirs = {n: (tuple(s), r0, r) for n, s, r0, r in saved["params"]}
        hits = [i for i, n in enumerate(names) if n in theirs and _overlap(want[n], theirs[n])[1] > 0]
        if k > 0 and not hits:
            continue
        reader = CheckpointReader(os.path.join(root, saved["dir"]))
        if k == 0:  # the run's own objects (param groups, extra, scheduler) and steps, from the first part
            objs = reader.objects(weights_only=kw.get("weights_only", True))
            out = {"path": root, "step": reader.manifest.step, "extra": objs["extra"], "scheduler": objs["scheduler"],
                   "param_groups": objs["param_groups"]}  # fmt: skip
            saved_steps = {p.name: p.step for p in reader.manifest.params}  # every rank counts every parameter
            steps = [saved_steps.get(n, 0) for n in names]
        if not hits:
            continue
        entries = {p.name: p for p in reader.manifest.params}
        ranges = []  # (first element in the row files, this rank's rows it fills: one view a row file)
        for i in hits:
            n = names[i]
            (shape, r0, _), (saved_shape, s0, saved_rows) = want[n], theirs[n]
            if saved_shape != shape:
                fix = "load into a model with the parameters it was saved from"
                raise CheckpointMismatchError(root, [f"{n}: shape {list(saved_shape)} saved, {list(shape)} here"], fix)
            entry = entries.get(n)
            # Rows are found by offset in the part's row files: a shard of another shape would give others' bytes.
            if entry is None or tuple(entry.shape) != (saved_rows, *shape[1:]):
                held = "nothing" if entry is None else f"shape {list(entry.shape)}"
                problem = f"{n}: {SHARDS} lists {saved_rows} rows in {saved['dir']}, which holds {held}"
                raise CheckpointMismatchError(root, [problem], "save again")
            start, count = _overlap(want[n], theirs[n])
            row = math.prod(shape[1:])  # elements a row
            mine = slice((start - r0) * row, (start - r0 + count) * row)
            ranges.append((entry.offset + (start - s0) * row, [rows[r][i][mine] for r in range(3)]))
            covered[i] += count
        # Only the saved records (CRC segments: one a chunk) that hold rows of ours are read, each whole.
        with reader.stream(kw.get("io")) as s:
            for r in range(3):
                s.read_ranges(r, [(first, views[r]) for first, views in ranges])
    short = [f"{n}: {covered[i]} of {want[n][2]} rows found" for i, n in enumerate(names) if covered[i] != want[n][2]]
    if short:
        raise CheckpointMismatchError(root, short, "load into a model with the parameters it was saved from")
    scratch = torch.empty(3, max((c.numel for c in opt.chunks), default=0))  # one buffer: put() copies it
    for chunk in opt.chunks:
        new = scratch[:, : chunk.numel]
        for pc in chunk.pieces:
            for k in range(3):
                new[k, pc.chunk_start : pc.chunk_start + pc.numel] = rows[k][pc.param][
                    pc.param_start : pc.param_start + pc.numel
                ]
        event = opt.install_chunk_rows(chunk, new)
        if event is not None:
            event.synchronize()  # the parameters' upload read it: then it may be filled again
    opt.set_step_counts(steps, out["step"])
    for group, saved_group in zip(opt.param_groups, out.pop("param_groups")):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    if kw.get("scheduler") is not None and out["scheduler"] is not None:
        kw["scheduler"].load_state_dict(out["scheduler"])
    return out


def _overlap(mine: tuple[tuple[int, ...], int, int], theirs: tuple[tuple[int, ...], int, int]) -> tuple[int, int]:
    """The first global row and the count of rows two shards of one parameter share."""
    start = max(mine[1], theirs[1])
    return start, max(0, min(mine[1] + mine[2], theirs[1] + theirs[2]) - start)
