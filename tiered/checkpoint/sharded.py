"""Collective NVMe-tier checkpoints of an optimizer whose parameters FSDP2 shards across ranks.

Layout: one folder, committed as a whole by rank 0, holding one complete single-process checkpoint per
rank (save.py writes it: streamed through that rank's pinned buffers, checksummed, its manifest recording the
rows it holds) and ``shards.json``, the checksummed map from each rank's local shards to the global
parameters (shardmap.py)::

    path/
      shards.json      {"format": 2, "world_size": W, "shards_crc32": C, "save_id": S, "ranks": [{"dir":
                          "rank-00000", "params": [[name, global_shape, first_row, rows], ...]}, ...]}
      rank-00000/      manifest.json, the row files, objects.pt: rank 0's shards as a checkpoint of their own
      rank-00001/ ...

Save, every rank: rank 0 prepares a hidden temp folder beside ``path`` (fsops.py's protocol); its name and the save's
identity (a random save id, in the map and in every part's manifest) are all-gathered with every rank's ``path``
(absolute), and ranks that passed different paths are refused on every rank (ValueError, naming each rank's; rank 0
removes the folder); each rank saves its own checkpoint into it; the ranks' outcomes are all-gathered, so a failure
on any rank is raised on every rank and nothing is committed; rank 0 checks that every rank's part is in the temp
folder (ranks that do not share the folder, each on a disk of its own node, wrote theirs where rank 0 cannot see
them: refused, CheckpointNotSharedError) and the map (the ranks' rows tile every parameter), writes ``shards.json``,
fsyncs and renames the temp folder into place (an atomic exchange over a previous checkpoint). A kill -9 of any rank
at any point before that rename leaves the previous checkpoint at ``path`` untouched. A collective that fails because
a rank is gone is raised on the survivors with its class, naming ``path`` (``collective_lost``); rank 0 removes the
temp folder, the others leave their parts in it (rank 0 may still commit it; if rank 0 died, the next save on its
host sweeps it). A Ctrl-C on a rank is its failure, told at the next collective (each holds it to its end,
``_gather``): it raises its KeyboardInterrupt, the others one naming it, nothing committed (``_raise_failed``). One
held in the outcomes' gather (its outcome sent) is told in a third gather, of who was pressed (so four collectives a
save: three gathers and rank 0's commit broadcast); one held in that third gather is on rank 0 its failure, told in
the broadcast, nothing committed, and on another rank lands after the commit, as one held over the broadcast or over
rank 0's commit does (saying it committed).

Load, every rank, at any world size, in two phases with an agreement between them:

1. Check, touching nothing of the optimizer. With the same layout (world size and every shard's rows) a rank
   checks its own part as a single-process load does and reads all of it once against its CRCs
   (``verify="first"``); otherwise it gathers its rows from the parts that overlap them (reshard.py: only
   the records it needs, each checked, into disk-backed memory in its folder), and checks the objects.pt of
   each part it opens and of its share of the others, so that the ranks together check every part's. A
   single-process checkpoint is a part of itself: it loads under FSDP2 too.
2. The outcomes are all-gathered, with the identity of the checkpoint each rank opened (``Parts.identity``) and
   the path it was given (absolute). Ranks given different paths are refused on every rank (ValueError, naming
   each rank's), whatever each found there. If any rank failed, every rank raises (the one that failed its own
   error, the others an error of its class naming it: rank_errors.py) and no optimizer has changed. If the ranks
   opened different checkpoints at one path (another job committed a new one at ``path`` between their opens:
   each is whole, and each rank would load its rows of its own), every rank raises CheckpointNotFoundError,
   saying to load again, and no optimizer has changed. Otherwise each rank installs its chunks; the outcomes are
   gathered again, and a failure there (which only the optimizer's side can cause) is raised on every rank with
   ``partial_load`` set: the ranks together hold a torn state. Either gather failing because a rank is gone is
   raised on the survivors with its class, naming ``path`` (``collective_lost``); in the second, after they
   installed, with ``partial_load`` set.

A failed save, or a failed load's phase, raises on every rank the class of the first rank that failed (an
InsufficientSpaceError stays an OSError, a bad argument a TypeError: rank_errors.py), with a message that lists
every rank's failure and names the user's path, never the hidden temp folder.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable
from typing import Any, NoReturn

from io_engine import fsync_dir

from ..interrupts import deferred_sigint
from .errors import CheckpointNotFoundError, CheckpointPathError
from .fsops import commit, is_checkpoint, makedirs_durable, recover, sweep, write_file
from .hidden import check_target, ended, hidden_name
from .load import PreparedLoad, check_load_arguments, prepare_load
from .manifest import new_save_id
from .parts import check_parts, discard_part, lost_part
from .plan import ChunkedState
from .rank_errors import Failure, collective_lost, rank_error
from .reshard import Gathered, Parts, gather_parts
from .save import write_checkpoint
from .shardmap import SHARDS, Layout, Shard, ShardMap, is_sharded, rank_dir
from .validate import checkpoint_path
from .writer import check_keep_last, prune

__all__ = ["SHARDS", "Layout", "save_sharded", "load_sharded", "is_sharded"]


def _all(dist: Any, outcome: tuple[Any, ...]) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, outcome)
    return out


def _gather(dist: Any, outcome: tuple[Any, ...]) -> tuple[list[Any], KeyboardInterrupt | None]:
    """``_all`` with a Ctrl-C held until the all-gather is done (one landing between the two exchanges of
    ``all_gather_object`` left the other ranks waiting in the second), and handed back with its result, for this
    rank to report at the save's next collective."""
    out: list[Any] | None = None
    try:
        with deferred_sigint():
            out = _all(dist, outcome)
    except KeyboardInterrupt as e:
        if out is None:
            raise
        return out, e
    return out, None


INTERRUPTED = "interrupted (Ctrl-C: KeyboardInterrupt)"


def _failure(rank: int, e: BaseException, rename: tuple[str, str] | None = None) -> Failure:
    """``Failure.of``; a Ctrl-C says so (a KeyboardInterrupt's message is empty)."""
    failure = Failure.of(rank, e, rename)
    return dataclasses.replace(failure, text=INTERRUPTED) if isinstance(e, KeyboardInterrupt) else failure


def _raise_failed(failures: list[Failure], what: str, own: BaseException | None) -> NoReturn:
    """Raise the gathered ``failures`` on this rank (``own``: its own failure, or a Ctrl-C that came meanwhile). A
    Ctrl-C on any rank stops every rank: the interrupted one raises its KeyboardInterrupt, the others one saying
    which rank was interrupted (so an ``except KeyboardInterrupt`` runs on every rank, and an ``except Exception``
    on one does not go on into a collective the interrupted rank has left)."""
    if isinstance(own, KeyboardInterrupt):
        raise own
    if any(f.module == "builtins" and f.qualname == "KeyboardInterrupt" for f in failures):
        raise KeyboardInterrupt(f"{what}: " + "; ".join(f.line() for f in failures)) from own
    raise rank_error(failures, what) from own


def _same_path(paths: list[str], call: str, unchanged: str) -> None:
    """Refuse, on every rank (each sees every rank's ``paths``, absolute), a collective ``call`` whose ranks
    passed different paths: a save would go to rank 0's alone and tell the others it saved to theirs; a load
    would open several checkpoints, or fail on the ranks whose path holds none, and blame that instead."""
    if len(set(paths)) == 1:
        return
    ranks: dict[str, list[int]] = {}
    for k, p in enumerate(paths):
        ranks.setdefault(p, []).append(k)
    which = "; ".join(f"rank{'s' if len(ks) > 1 else ''} {', '.join(map(str, ks))}: {p}" for p, ks in ranks.items())
    raise ValueError(
        f"the ranks passed different paths to {call} ({which}): it is collective under FSDP2, and every rank must "
        f"pass the same path, one they all see (a shared filesystem); {unchanged}"
    )


def _from_rank0(dist: Any, fn: Any, what: str, rename: tuple[str, str] | None = None, *, done: str = "",
                lost: str = "", landed: str = "", failed: Callable[[], None] = lambda: None) -> Any:  # fmt: skip
    """``fn()`` on rank 0, its result (or its error, raised with its class: rank_errors.py, after ``failed()``) on
    every rank. Where the broadcast itself fails (a rank gone), rank 0 raises its own error, or says ``done``
    (``fn`` succeeded), and the other ranks, which cannot know which, say ``lost`` (``collective_lost``). A Ctrl-C
    held over the broadcast after ``fn`` succeeded is raised once it is done, saying ``landed``."""
    box: list[Any] = [None]
    own: BaseException | None = None
    late: KeyboardInterrupt | None = None
    rank = dist.get_rank()
    if rank == 0:
        try:
            box = [("ok", fn())]
        except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - every rank must learn of it (a Ctrl-C too), or the others wait
            own = e
            box = [("error", _failure(0, e, rename))]
    try:
        with deferred_sigint():  # a Ctrl-C lands once every rank knows the outcome (below)
            dist.broadcast_object_list(box, src=0)
    except KeyboardInterrupt as e:
        if box[0] is None:
            raise
        late = e
    except Exception as e:
        if rank == 0 and own is not None:
            failed()
            if isinstance(own, KeyboardInterrupt):
                raise own from None
            # its own failure says more than the lost rank
            raise rank_error([box[0][1]], _said(what, box[0][1])) from own
        raise collective_lost(e, done if rank == 0 else lost) from e
    status, value = box[0]
    if status == "error":
        failed()
        _raise_failed([value], _said(what, value), own or late)
    if late is not None:
        raise KeyboardInterrupt(landed) if landed else late
    return value


def _said(what: str, failure: Failure) -> str:
    """``what``, unless ``failure`` came after the commit point, which ``what`` ("nothing was committed") would belie:
    its own message names the path and what is there."""
    return "the collective save committed, then failed" if failure.qualname == "CheckpointCommittedError" else what


def _shards(layout: Layout) -> list[Shard]:
    return [Shard(n, tuple(s), int(r0), int(r)) for n, s, r0, r in layout]


def save_sharded(opt: ChunkedState, path: str | os.PathLike[str], layout: Layout, *,
                 extra: dict[str, Any] | None = None, scheduler: Any = None, keep_last: int | None = None,
                 io: Any = None) -> str:  # fmt: skip
    """Save every rank's shards under ``path`` (collective: every rank calls it). ``layout``: this rank's shards
    (``Shards.layout()``); the options are ``save_checkpoint``'s, by name (a typo fails at once, before the save)."""
    import torch.distributed as dist

    kw = dict(extra=extra, scheduler=scheduler, io=io)  # each rank's part's; keep_last is the whole checkpoint's
    check_keep_last(keep_last)
    final = checkpoint_path(path)
    rank = dist.get_rank()

    failed_save = f"the collective save to {final} failed, nothing was committed"

    def prepare() -> tuple[str, str]:
        check_target(final)
        makedirs_durable(os.path.dirname(final), final)
        recover(final)
        if os.path.lexists(final) and not (is_sharded(final) or is_checkpoint(final)) and os.listdir(final):
            raise CheckpointPathError(
                f"{final} exists and is not a tiered checkpoint; a save replaces only a checkpoint. Choose another "
                "path, or move that one away"
            )
        sweep(os.path.dirname(final))
        sigint.through = False  # the name is taken held: the ``finally`` below ends it, whatever comes
        made.append(hidden_name(final, "tmp"))
        sigint.through = True
        os.mkdir(made[0])
        return made[0], new_save_id()

    # Rank 0 holds Ctrl-C from its temp folder's name to its end, and lets presses through between (the collectives
    # hold their own), as writer.py does: a press as a failed save's folder was removed stopped the removal, and the
    # folder and its lock stayed beside the checkpoint. A press held there is raised once the folder is gone.
    made: list[str] = []  # this process's temp folder, from its name on
    with deferred_sigint(lets_through=True) as sigint:
        sigint.through = True
        try:
            # The save's first collective: rank 0's temp folder and save id (or why it could not make them), gathered
            # with every rank's path, so that paths that differ are refused on every rank before any rank writes.
            own: BaseException | None = None
            start: tuple[str, Any] = ("ok", None)
            if rank == 0:
                try:
                    start = ("ok", prepare())
                except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - every rank must learn of it, or the others wait
                    own, start = e, ("error", _failure(0, e))
            return _save(dist, opt, final, layout, start, own, keep_last, failed_save, **kw)
        finally:
            sigint.through = False  # first: the removal runs whole, whatever presses land (raised after it)
            if made:  # committed (renamed away: nothing to remove), or failed: removed whole, then its name ended
                shutil.rmtree(made[0], ignore_errors=True)
                ended(made[0])  # what rmtree could not remove is swept by the next save


def _save(dist: Any, opt: ChunkedState, final: str, layout: Layout, start: tuple[str, Any], own: BaseException | None,
          keep_last: int | None, failed_save: str, **kw: Any) -> str:  # fmt: skip
    """``save_sharded`` from its first collective on, ``start``: rank 0's temp folder and save id, or its failure
    (``own``). A collective that fails (a rank gone) is raised naming ``final`` (``collective_lost``), rank 0's temp
    folder removed (``parts.lost_part``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        asked, late = _gather(dist, (final, start))
    except Exception as e:
        if rank == 0 and start[0] == "ok":  # another rank's ``start`` holds no folder: ("ok", None)
            lost_part(start[1][0], rank)
        if isinstance(own, KeyboardInterrupt):
            raise own from None
        raise collective_lost(e, failed_save) from own or e
    paths, (status, value) = [p for p, _ in asked], asked[0][1]
    if rank == 0 and status == "ok" and len(set(paths)) > 1:
        shutil.rmtree(value[0], ignore_errors=True)  # refused on every rank, next: nothing of the save is left
    _same_path(paths, "save_checkpoint", "nothing was saved")
    if status == "error":
        _raise_failed([value], failed_save, own or late)
    temp, save_id = value
    try:  # a Ctrl-C here (or one held in the gather: ``late``) is this rank's failure, told to every rank below
        if late is not None:
            raise late
        mine = [s.to_json() for s in _shards(layout)]
        record = {"rank": rank, "world_size": world, "params": mine}  # ShardMap.part_record(rank), known here
        write_checkpoint(opt, os.path.join(temp, rank_dir(rank)), shard=record, save_id=save_id, **kw)
        outcome: tuple[str, Any] = ("ok", mine)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - reported to every rank below
        own, outcome = e, ("error", _failure(rank, e, (temp, final)))
    try:
        outcomes, late = _gather(dist, outcome)
    except Exception as e:
        lost_part(temp, rank)
        if isinstance(own, KeyboardInterrupt):
            raise own from None
        if own is not None:  # this rank's own failure says more than the lost rank
            raise rank_error([outcome[1]], failed_save) from own
        raise collective_lost(e, failed_save) from e
    failed = [f for status, f in outcomes if status == "error"]
    if failed:
        discard_part(temp, rank)
        _raise_failed(failed, failed_save, own or late)
    # A Ctrl-C held in that gather came after this rank's outcome was sent: who was pressed is gathered once more
    # before rank 0 commits, so that a press on any rank stops every rank, nothing committed.
    try:
        pressed, last = _gather(dist, (late is not None,))
    except Exception as e:
        lost_part(temp, rank)
        raise (late or collective_lost(e, failed_save)) from e
    stopped = [_failure(k, KeyboardInterrupt()) for k, (was,) in enumerate(pressed) if was]
    if stopped:
        discard_part(temp, rank)
        _raise_failed(stopped, failed_save, late)
    late = last  # held in this last gather: rank 0's is told in publish, another rank's lands after the commit
    committed: list[KeyboardInterrupt] = []  # a Ctrl-C held over the commit: raised once every rank is told

    def publish() -> str:
        if late is not None:
            raise late  # came in the gather: told to every rank as a failure, nothing committed
        # A failure here: the folder is removed by ``failed`` below, and whole, Ctrl-C held, by ``save_sharded``
        check_parts(temp, final, world)  # a folder the ranks do not share holds rank 0's part alone
        text = ShardMap.from_layouts([params for _, params in outcomes], save_id).dumps()
        ShardMap.parse(text, os.path.join(final, SHARDS))  # the ranks' rows tile every parameter, or no commit
        write_file(os.path.join(temp, SHARDS), text.encode())
        fsync_dir(temp)
        try:  # held to the end of the pruning (writer.py says why); landing here, it is raised after the broadcast
            with deferred_sigint():
                commit(temp, final)  # a failure after its commit point is CheckpointCommittedError: said below
                if keep_last is not None:
                    prune(final, keep_last)
        except KeyboardInterrupt as e:  # the block completed: committed and pruned
            committed.append(e)
        return final

    # A broadcast that fails on another rank (a rank gone) may leave rank 0 committing: that rank's part stays
    # (rank 0 commits or removes the folder; if it died, the next save on its host sweeps it).
    done = f"the checkpoint {final} was committed, whole, but the other ranks could not be told"
    lost = (
        f"the collective save to {final} failed as rank 0 committed it: whether {final} holds the new checkpoint or "
        "the previous one (each whole), this rank cannot tell"
    )
    landed = f"interrupted (Ctrl-C) as the collective save committed {final}: it holds the new checkpoint, whole"
    saved = _from_rank0(dist, publish, failed_save, (temp, final), done=done, lost=lost, landed=landed,
                        failed=lambda: discard_part(temp, rank))  # fmt: skip
    if committed or late is not None:  # rank 0 told the others of its own ``late`` in ``publish``: here another's
        raise KeyboardInterrupt(landed) from None
    return saved


def load_sharded(opt: ChunkedState, path: str | os.PathLike[str], layout: Layout, scratch: str, *,
                 lay_out: Callable[[], ChunkedState | None] | None = None, scheduler: Any = None,
                 hparams: str = "checkpoint", verify: str = "stream", weights_only: bool = True,
                 io: Any = None) -> dict[str, Any]:  # fmt: skip
    """Load a checkpoint saved by ``save_sharded`` (or by one process) at any world size (collective).
    ``layout``: this rank's shards; ``scratch``: a folder of this rank's for disk-backed rows; the options are
    ``load_checkpoint``'s, by name (``scheduler``, ``hparams``, ``verify``, ``weights_only``, ``io``). ``lay_out``: run
    once every rank has checked the checkpoint, before anything is installed; it returns the state to install
    into (``opt`` laid out again: load.prepare_checkpoint), or None: ``opt``.

    Every rank checks everything it will read before any rank changes its optimizer (the module docstring):
    a failure found then is raised on every rank, there its own error, elsewhere one of its class naming it,
    and every optimizer is as it was. A failure while installing, or a rank lost then, is raised on every rank
    with ``partial_load`` set."""
    import torch.distributed as dist

    root = checkpoint_path(path)
    rank = dist.get_rank()
    prepared: PreparedLoad | Gathered | None = None
    opened: tuple[str, int] | None = None
    own: Exception | None = None
    try:
        prepared, opened = _prepare(opt, root, layout, scratch, rank, dist.get_world_size(), scheduler=scheduler,
                                    hparams=hparams, verify=verify, weights_only=weights_only, io=io)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others wait in the gather forever
        own = e
    unchanged = f"the collective load of {root} failed, no rank's optimizer was changed"
    # A rank gone mid-gather may leave another rank past it, installing: this rank can answer for itself alone
    lost = f"the collective load of {root} failed, this rank's optimizer was not changed"
    failed, everyone = _agree(dist, rank, own, unchanged, opened, path=root, lost=lost)
    if failed:
        if own is not None:
            raise own
        raise rank_error(failed, unchanged)
    assert prepared is not None  # no failure on this rank: it prepared
    if len({identity for identity, _ in everyone}) > 1:
        raise CheckpointNotFoundError(root, _replaced(everyone))
    try:
        out = prepared.install(lay_out() if lay_out is not None else None)
        out["path"] = root
    except Exception as e:  # noqa: BLE001 - as above
        own = e
    torn = (
        f"the collective load of {root} failed part-way, after every rank had checked the checkpoint; the ranks' "
        "optimizers together hold a partly loaded state: load an intact checkpoint on every rank before training"
    )
    failed, _ = _agree(dist, rank, own, torn, partial_load=True)
    if failed:
        raise rank_error(failed, torn, partial_load=True) from own
    return out


def _agree(dist: Any, rank: int, own: Exception | None, what: str, value: Any = None, path: str | None = None, *,
           partial_load: bool = False, lost: str | None = None) -> tuple[list[Failure], list[Any]]:  # fmt: skip
    """Every rank's failure and, where none failed, every rank's ``value``, in rank order: one all-gather.
    ``path``: this rank's checkpoint, gathered too: paths that differ are refused on every rank (``_same_path``),
    before any failure, which a rank whose path holds no checkpoint would have. Where the all-gather fails (a rank
    gone): this rank's own failure, as if only it had failed (it says more than the lost rank), else the
    collective's error naming the load (``lost``, else ``what``; ``partial_load``: this rank installed), as a
    save's."""
    outcome = ("ok", value, path) if own is None else ("error", Failure.of(rank, own), path)
    try:
        outcomes = _all(dist, outcome)
    except Exception as e:
        if own is not None:
            return [outcome[1]], []
        raise collective_lost(e, lost or what, call="load", partial_load=partial_load) from e
    if path is not None:
        _same_path([p for *_, p in outcomes], "load_checkpoint", "no rank's optimizer was changed")
    return [v for status, v, _ in outcomes if status == "error"], [v for _, v, _ in outcomes]


def _replaced(opened: list[tuple[str, int]]) -> str:
    """Why a load whose ranks opened different checkpoints at one path (``opened``: each rank's identity and
    step) refuses, naming which ranks opened which."""
    ranks: dict[str, list[int]] = {}
    for k, (identity, _) in enumerate(opened):
        ranks.setdefault(identity, []).append(k)
    which = "; ".join(
        f"rank{'s' if len(ks) > 1 else ''} {', '.join(map(str, ks))}: the one of step {opened[ks[0]][1]}"
        for ks in ranks.values()
    )
    return (
        f"another save replaced it while the ranks opened it, so they opened different checkpoints ({which}), "
        "each whole, and each rank would have loaded its rows of its own; no rank's optimizer was changed. Load it "
        "again"
    )


def _prepare(opt: ChunkedState, root: str, layout: Layout, scratch: str, rank: int, world: int, *,
             scheduler: Any = None, hparams: str = "checkpoint", verify: str = "stream", weights_only: bool = True,
             io: Any = None) -> tuple[PreparedLoad | Gathered, tuple[str, int]]:  # fmt: skip
    """Phase 1 on this rank: everything read and checked, the optimizer untouched. Returns it with the identity
    and step of the checkpoint it opened (once: the map, every part and the identity from one checkpoint,
    whatever is committed at ``root`` meanwhile)."""
    check_load_arguments(scheduler, hparams, verify)
    with Parts(root) as parts:
        identity, shards = parts.identity(), parts.shards
        prepared: PreparedLoad | Gathered
        if shards is not None and shards.world_size == world and shards.ranks[rank] == _shards(layout):
            # Its own part, as saved (checked against the map). verify="first": every CRC is checked before
            # the agreement, not while installing.
            prepared = prepare_load(opt, parts.reader(rank), scheduler=scheduler, hparams=hparams, verify="first",
                                    weights_only=weights_only, io=io)  # fmt: skip
            step = prepared.reader.manifest.step
        else:
            prepared = gather_parts(opt, parts, layout, scratch, scheduler=scheduler, hparams=hparams,
                                    weights_only=weights_only, io=io, share=(rank, world))  # fmt: skip
            step = prepared.info["step"]
    return prepared, (identity, step)
