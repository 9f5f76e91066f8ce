"""The tensors an optimizer's state is laid out on, against those its ``param_groups`` hold now.

torch.optim steps whatever tensors ``param_groups[i]["params"]`` hold at each step, and frameworks rely on it:
accelerate's FSDP2 ``prepare`` (and HF Trainer with FSDP, through it) builds the model's sharded parameters
after the optimizer and writes them into its ``param_groups``. TieredOptimizer lays its state out once, on the
tensors it was built on, so before each step, state dict and checkpoint it compares the two (``changed``) and,
where they differ, lays its state out again over the new tensors (``follow``):

- before any step there is no state to keep but the hyperparameters, which stay in the groups;
- after steps the state is carried over: a tensor laid out takes its own wherever it now is (groups or tensors
  reordered: torch keys state by tensor), another tensor the state of the one laid out in its place (groups.placed),
  where the new tensor (its local shard) has the shape of the old one (``check_carry``); otherwise nothing changes
  and the error names the parameter and what to do;
- a parameter frozen when laid out (no state: shards.py) that has since begun to take gradients is laid out
  the same way, its state starting then, as torch.optim.AdamW's does.

A change of the number of tensors in a group is refused; a new group, added by ``add_param_group`` or appended
to a list assigned to ``opt.param_groups``, is laid out by ``add_group`` (groups.py says how an assigned list is
read).

Call order (the optimizer's ``_follow_param_set``, under its lock): ``if changed(...): follow(...)``, which
plans and checks (``plan_again``), exports the state if it is carried, releases the old parts, builds the new
and ``restore``s. ``add_param_group`` lays its new group out with ``add_group`` (its chunks planned by
``plan_new_group``), beside the others where they fit the optimizer's buffers, else by ``follow`` over the grown
groups (``_follow_param_set(undo)``: a failure lays the state before back out, ``lay_back``);
``load_state_dict`` lays out the frozen parameters its dict holds state for with ``lay_out_loaded`` (torch keeps
that state for when they thaw), and ``load_checkpoint`` those its checkpoint holds state for with
``load_checkpoint_into``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
from collections.abc import Callable
from typing import Any

import torch

from ..arguments import check_free_space, check_group, check_param, group_names, record_fused
from ..checkpoint.errors import CheckpointMismatchError
from ..checkpoint.fsops import readable
from ..checkpoint.load import prepare_checkpoint, saved_entries
from ..checkpoint.plan import mismatch_fix
from ..checkpoint.sharded import load_sharded
from ..checkpoint.validate import checkpoint_path
from ..config import TierConfig
from ..layout.chunking import Chunk, Layout
from .assembly import Planned, plan_layout, release_parts, write_initial_state
from .groups import assigned, placed
from .shards import Shards
from .state_chunks import StateChunks
from .state_dicts import export_state_dict, parse_state_dict, scatter_state
from .whole_load import LoadGuard

__all__ = ["flat", "follow_assigned", "changed", "check_carry", "follow", "lay_back", "plan_new_group",
           "fitting_chunks", "add_group", "plan_again", "lay_out_loaded", "load_checkpoint_into",
           "check_never_stepped", "restore"]  # fmt: skip


def flat(param_groups: list[dict[str, Any]]) -> list[torch.Tensor]:
    return [p for g in param_groups for p in g["params"]]


def follow_assigned(state: StateChunks, laid_out: list[int], lay_out_again: Callable[..., None],
                    add_group: Callable[[dict[str, Any]], None]) -> None:  # fmt: skip
    """The optimizer's ``_follow_param_set``: follow the groups ``state.param_groups`` holds now, ``laid_out`` the
    sizes of those the state is laid out over (kept up to date here). Other tensors in them, or the same in other
    places (groups.placed), or frozen ones thawed: ``lay_out_again(order=...)`` (the optimizer's, over ``follow``);
    groups appended to a list assigned to ``opt.param_groups``: ``add_group`` each, as ``add_param_group``."""
    groups, params = state.param_groups, state.shards.params
    extra = assigned(groups, laid_out, params)  # taken off the list
    try:
        if changed(groups, state.shards, laid_out):
            lay_out_again(order=placed(groups, laid_out, params, state.param_names))
            laid_out[:] = [len(g["params"]) for g in groups]  # tensors moved between groups
        for group in extra:
            add_group(group)
    finally:  # those not laid out back as assigned: the next call raises as this one
        groups.extend([g for g in extra if all(g is not h for h in groups)])


def changed(param_groups: list[dict[str, Any]], shards: Shards, laid_out: list[int]) -> bool:
    """Whether the state must be laid out again: other tensors in ``param_groups`` than ``shards`` were laid
    out on, or in other places (groups of other sizes than ``laid_out``), or frozen ones thawed. The groups hold as
    many parameters as laid out (groups.assigned checked)."""
    now = flat(param_groups)
    moved = [len(g["params"]) for g in param_groups] != laid_out or any(a is not b for a, b in zip(now, shards.params))
    return moved or bool(shards.thawed())


def check_carry(names: list[str], old: list[torch.Tensor], steps: list[int], new: Shards, source: list[int]) -> None:
    """The state of every parameter that has stepped fits the new (local) tensor that takes it (``source``: for
    each new tensor, the old one's index), else ValueError by name."""
    for n, i in zip(new.locals, source):
        name, o, s = names[i], old[i], steps[i]
        if s and o.shape != n.shape:
            raise ValueError(
                f"parameter {name!r} was replaced in param_groups after {s} steps by a tensor of (local) shape "
                f"{tuple(n.shape)}; its state has shape {tuple(o.shape)}: TieredOptimizer carries state over to new "
                "tensors of the same shape only. Build the optimizer after the model is wrapped (fully_shard, "
                "accelerator.prepare), or load the state into a new optimizer (load_state_dict, load_checkpoint)"
            )


def plan_new_group(state: StateChunks, layout: list[tuple[Any, Any, torch.device]], rule: Layout, chunk_numel: int,
                   gi: int, first: int) -> list[Chunk] | None:  # fmt: skip
    """The chunks of group ``gi``, whose parameters (from ``first`` on) ``add_param_group`` has just added to
    ``state.shards``: each checked as the constructor checks one, on this optimizer's device, cut as the
    constructor cuts a group (``rule``: the chunk layout's plan, assembly.plan_layout), with disk room for them.
    None where those chunks do not fit the buffers the optimizer was built for (``fitting_chunks``): the whole
    state is then laid out again. ``layout``: (shape, dtype, device) per parameter so far; ``chunk_numel``: the
    elements of its scratch rows (its largest chunk's)."""
    names = [f"group{gi}.param{pi}" for pi in range(len(state.params) - first)]
    for name, p, frozen in zip(names, state.params[first:], state.shards.frozen[first:]):
        if frozen:
            continue
        check_param(name, p)
        if layout and p.device != layout[0][2]:
            raise ValueError(f"parameter {name!r} is on {p.device}; this optimizer's parameters are on "
                             f"{layout[0][2]}: add parameters on the same device")  # fmt: skip
    chunks = fitting_chunks(state, rule, chunk_numel, gi)
    if chunks is not None:
        check_free_space(state.workdir, sum(c.nbytes for c in chunks), "the new param group's state")
    return chunks


def fitting_chunks(state: StateChunks, rule: Layout, chunk_numel: int, gi: int) -> list[Chunk] | None:
    """Group ``gi``'s chunks, cut as ``rule`` cuts a group at construction, where they fit the buffers the
    optimizer was built for: ``chunk_numel`` elements (its scratch rows) and its largest record's bytes (its
    device records, the store's stream reserve); an optimizer built without split chunks has no scratch for them,
    so bf16 parameters added to it keep full fp32 masters (as in a group that mixes dtypes). None where they do
    not fit (a pre-trained backbone added after its head; an optimizer built over no state at all): cut smaller,
    a large group would take thousands of tiny records, each streamed every step."""
    largest = max((c.nbytes for c in state.chunks), default=0)
    fitted = copy.copy(rule)
    fitted.split_masters = rule.split_masters and state.updater.splits
    chunks = [c for c in fitted.plan(state.shards.grouped(state.param_groups)) if c.group == gi]
    return chunks if all(c.nbytes <= largest and c.numel <= chunk_numel for c in chunks) else None


def add_group(state: StateChunks, layout: list[tuple[Any, Any, torch.device]], rule: Layout, group_sizes: list[int],
              chunk_numel: int, gi: int, first: int,
              lay_out_again: Callable[[Callable[[], None]], None]) -> list[Chunk]:  # fmt: skip
    """Lay out group ``gi``, which torch's ``add_param_group`` has just appended to ``state.param_groups`` (its
    parameters from ``first`` on in the flat order): its names taken and its settings checked, its tensors added to
    ``state.shards``, its chunks planned (``plan_new_group``) and their first records written (masters from the
    parameters). A failure in any of that (a full disk, a Ctrl-C) takes the group back out, its records deleted:
    nothing changed. Then the layout grows (``group_sizes``, ``layout``, the step counts, the chunks). Returns the
    new chunks.

    Where the group's chunks do not fit the optimizer's buffers (a backbone added after its head), the whole state
    is laid out again over the grown groups, as the constructor lays out every group, buffers sized for it and the
    state carried over: ``lay_out_again(undo)`` (the optimizer's ``_follow_param_set``: ``follow``, which calls
    ``undo`` to take the group back out and lays the state before back out where the new layout fails). Returns
    [] then: the new layout holds every chunk."""
    group = state.param_groups[gi]
    chunks: list[Chunk] | None = []

    def undo() -> None:  # idempotent: follow may have called it
        state.shards.truncate(first)
        del state.param_names[first:]
        del group_sizes[gi:], state.param_groups[gi:]

    try:
        names = group_names(group, gi, state.param_names)  # named ones (torch's param_names) by their names
        check_group(group, f"param group {gi}", given=True)
        record_fused(group)
        state.shards.extend(group["params"])
        chunks = plan_new_group(state, layout, rule, chunk_numel, gi, first)
        if chunks is None:
            state.shards.truncate(first)  # the layout built again takes its tensors from the groups
            state.param_names.extend(names)
            group_sizes.append(len(group["params"]))
            lay_out_again(undo)
            return []
        write_initial_state(state.store, state.strategy, chunks)
    except BaseException:
        for c in chunks or ():
            with contextlib.suppress(Exception):  # the failure that got here is the one to raise
                if c.key in state.store:
                    state.store.delete(c.key)
        undo()
        raise
    state.param_names.extend(names)
    group_sizes.append(len(group["params"]))
    layout.extend((p.shape, p.dtype, p.device) for p in state.params[first:])
    state.grown(first)
    state.chunks.extend(chunks)
    return chunks


def follow(old: StateChunks, asked: TierConfig, whole: bool, resources: list[Any],
           assemble: Callable[[Shards, Planned], StateChunks], close: Callable[[], None],
           keep: frozenset[int] = frozenset(), undo: Callable[[], None] | None = None,
           order: tuple[list[int], list[str]] | None = None) -> StateChunks:  # fmt: skip
    """Lay an optimizer's state (``old``) out again over the tensors its ``param_groups`` hold now: from scratch
    before any step (or when it is not ``whole``: a load follows), else carried over: ``order`` (groups.placed)
    gives each tensor's old index and its name, else each is at its old index (a group added after them has none).
    ``keep``: parameters laid out even if frozen. Every check runs before anything changes; then ``resources``
    (the old layout's parts) are released and ``assemble`` builds the new one, which is returned (the folder stays
    locked between them: its lock is the optimizer's, not the store's, so a sibling starting on the root meanwhile
    never takes it for a dead run's: assembly.py); a failure after
    that calls ``close`` (nothing is left to step on), or with ``undo`` (add_group's: it takes the added group
    back out of ``param_groups``) lays ``old``'s state back out over the groups as they were (``lay_back``)."""
    carry = whole and any(old.steps)
    shards, planned = plan_again(old, asked, carry, keep, order)
    saved = export_state_dict(old) if carry else {}  # files in its folder, unlinked: they outlive the store
    if order is not None:  # the state and names go where their tensors now are
        saved = {j: saved[i] for j, i in enumerate(order[0]) if i in saved}
        old.param_names[:] = order[1]  # the optimizer's list: every layout names by it
    release_parts(resources)
    try:
        new = assemble(shards, planned)
        if saved:
            restore(new, saved, old.step_count)
    except BaseException:
        if undo is None or not lay_back(old, asked, saved, resources, assemble, undo):
            close()
        raise
    logging.getLogger("tiered").info("TieredOptimizer: the tensors in param_groups changed; the state is laid out "
                                     "again over them%s", " (carried over)" if saved else "")  # fmt: skip
    return new


def lay_back(old: StateChunks, asked: TierConfig, saved: dict[int, dict[str, torch.Tensor]], resources: list[Any],
             assemble: Callable[[Shards, Planned], StateChunks], undo: Callable[[], None]) -> bool:  # fmt: skip
    """After a layout again failed part-way: ``undo`` the change of the groups, and lay ``old``'s state out again
    over them as they were (the same tensors laid out; ``saved``: its state, as ``follow`` exported it). Returns
    whether that worked (a second failure, a broken disk: the caller closes the optimizer)."""
    undo()
    try:
        release_parts(resources)  # what the failed layout had built
        shards = Shards(flat(old.param_groups), frozenset(i for i, f in enumerate(old.shards.frozen) if not f))
        new = assemble(shards, plan_layout(old.param_names, shards, old.param_groups, asked))
        if saved:
            restore(new, saved, old.step_count)
    except BaseException as e:  # noqa: BLE001 - the failure that got here is the one to raise
        logging.getLogger("tiered").warning("TieredOptimizer: laying the state back out failed: %s", e)
        return False
    return True


def plan_again(state: StateChunks, asked: TierConfig, carry: bool, keep: frozenset[int] = frozenset(),
               order: tuple[list[int], list[str]] | None = None) -> tuple[Shards, Planned]:  # fmt: skip
    """The tensors ``param_groups`` hold now, and the layout over them, for the optimizer whose state is ``state``
    (``asked``: its knobs as given). ``carry``: the state is carried over (``check_carry``). ``keep``: parameters
    laid out even if frozen (old indices). ``order``: as ``follow``'s. Every check runs here, before anything
    changes."""
    source, names = order or (list(range(len(state.steps))), state.param_names)
    if carry:
        keep |= frozenset(i for i, s in enumerate(state.steps) if s)
    keep = frozenset(j for j, i in enumerate(source) if i in keep)  # where those tensors now are
    shards = Shards(flat(state.param_groups), keep)  # a parameter with state keeps it, frozen or not
    planned = plan_layout(names, shards, state.param_groups, asked)
    if carry:
        check_carry(state.param_names, list(state.params), state.steps, shards, source)
    grown = sum(c.nbytes for c in planned.chunks) - sum(c.nbytes for c in state.chunks)
    check_free_space(state.workdir, grown, "the state laid out again")
    return shards, planned


def lay_out_loaded(state: StateChunks, sd: Any, asked: TierConfig, resources: list[Any],
                   assemble: Callable[[Shards, Planned], StateChunks], close: Callable[[], None]) -> bool:  # fmt: skip
    """Before the state dict ``sd`` (local tensors) is loaded: parameters frozen when laid out (no state, an empty
    placeholder) for which ``sd`` holds state are laid out now, as torch.optim.AdamW keeps such state for when they
    take gradients. ``sd`` is checked whole first, against their real shapes, so a dict the load would refuse
    changes nothing. Returns whether the state was laid out again: from scratch, as the load replaces it all
    (the state before is then gone, and only the load makes the optimizer whole)."""
    shards = state.shards
    rows, _, _ = parse_state_dict(state, sd, [shards.laid_out_shape(i) for i in range(len(shards.params))])
    frozen = frozenset(i for i, f in enumerate(shards.frozen) if f and rows[1][i] is not None)
    if not frozen:
        return False
    laid_out = frozenset(i for i, f in enumerate(shards.frozen) if not f)  # the layout only grows
    follow(state, asked, False, resources, assemble, close, keep=laid_out | frozen)
    return True


def load_checkpoint_into(state: StateChunks, path: str | os.PathLike[str], kw: dict[str, Any], asked: TierConfig,
                         resources: list[Any], assemble: Callable[[Shards, Planned], StateChunks],
                         close: Callable[[], None], guard: LoadGuard) -> dict[str, Any]:  # fmt: skip
    """Load the checkpoint at ``path`` into ``state`` (``kw``: ``load_checkpoint``'s options; collective under
    FSDP2), in the optimizer's load ``guard``: ``lay_out_loaded`` for a checkpoint. Parameters frozen when laid
    out (no state, an empty placeholder) for which it holds state are laid out, as torch.optim.AdamW keeps such
    state for when they take gradients. The checkpoint is checked whole first, against ``state`` seen over the
    tensors laid out with them (their real shapes), so one the load would refuse changes nothing; then the state
    is laid out again from scratch (the state before is then gone, and only the load makes the optimizer whole:
    ``guard.torn``) and the checkpoint installed into it. Returns what ``load_checkpoint`` returns."""
    path = readable(checkpoint_path(path))  # once: an aside put back, or read in place with one warning
    frozen = [i for i, f in enumerate(state.shards.frozen) if f]
    saved = saved_entries(path) if frozen else {}
    check_never_stepped(state, frozen, saved, path)
    held = frozenset(i for i in frozen if saved.get(state.param_names[i], ((), 0))[1] > 0)  # zero-size ones too
    keep = frozenset(i for i, f in enumerate(state.shards.frozen) if not f) | held  # the layout only grows
    seen = state.seen_over(Shards(flat(state.param_groups), keep)) if held else state

    def lay_out() -> StateChunks | None:
        if not held:
            return None
        new = follow(state, asked, False, resources, assemble, close, keep=keep)
        guard.torn, new.guard = True, guard
        return new

    if state.shards.distributed:
        layout = seen.shards.layout(list(state.param_names))
        return load_sharded(seen, path, layout, state.workdir, lay_out=lay_out, **kw)
    return prepare_checkpoint(seen, path, **kw).install(lay_out())


def check_never_stepped(state: StateChunks, frozen: list[int], saved: dict[str, tuple[tuple[int, ...], int]],
                        path: str) -> None:  # fmt: skip
    """Refuse, naming both shapes, a checkpoint whose entry (``saved``: shape, step by name) for a parameter frozen
    here (``frozen``: indices) was never stepped and has another shape than the parameter's real one (global under
    FSDP2). Such an entry loads as no state (``plan.loads_as_no_state``), so the check against the empty stand-in
    passes whatever its shape; but a load restores weights too, and a checkpoint of another model must be refused
    by name, as one stepped is (``seen_over``). Left alone: entries that hold no state (frozen at the save, shape
    ``[0]``: ``plan.holds_no_state``) and parameters with no elements here (none of the entry would be used)."""
    out = []
    for i in frozen:
        name, real = state.param_names[i], tuple(state.shards.params[i].shape)
        shape, step = saved.get(name, ((0,), 0))  # not in the checkpoint: the load's own check names it
        if step == 0 and shape not in ((0,), real) and math.prod(real) > 0:
            out.append(f"{name!r}: shape {list(shape)} in the checkpoint, {list(real)} here")
    if out:
        raise CheckpointMismatchError(path, out, mismatch_fix(list(state.param_names), list(saved)))


def restore(state: StateChunks, saved: dict[int, dict[str, torch.Tensor]], global_step: int) -> None:
    """Stream ``saved`` (``export_state_dict`` of the layout before) into the layout ``state`` is; the step
    counts with it."""
    groups, start = [], 0
    for g in state.param_groups:
        groups.append({"params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    rows, steps, _ = parse_state_dict(state, {"state": saved, "param_groups": groups})
    scatter_state(state, rows, fresh=[True] * len(steps))
    state.set_step_counts(steps, global_step)
