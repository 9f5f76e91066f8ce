"""An optimizer's ``param_groups`` as they are now: ``Groups``, the one place every part reads them from, and
``assigned``, what a list assigned to ``opt.param_groups`` changed against the groups the state is laid out over.

torch.optim reads ``self.param_groups`` afresh at every step, state dict and ``add_param_group``, and frameworks
assign the attribute a new list: Lightning's ``BaseFinetuning`` restores its saved groups so on resume (new dicts
over the same tensors, and one group more where a layer was thawed before the checkpoint); accelerate's
``AcceleratedOptimizer`` passes such an assignment through. A part that kept the list it was built with would
step with the old dicts' hyperparameters (an LR schedule lost without a word) and load into a list nobody reads.
So ``TieredOptimizer.param_groups`` is a property over one ``Groups``, which an assignment points at the new list,
and its state (state_chunks.py) and update strategies (transfer.py) hold that ``Groups``, never a list.

A list may also hold the tensors laid out in another order: its groups reordered (user code sorting them by lr, a
framework restoring them in its saved order) or tensors moved within or between groups. torch keys its state by
tensor, so that changes nothing there; here the state is laid out by position, so ``placed`` says, for each
tensor of the list, whose state it takes: its own wherever it moved (by identity), and the state of the one laid
out in its place for a tensor the state is not laid out over (a model moved or reloaded: param_set.py). Names
follow the tensors too, but for the ones that only number a place (``group{g}.param{i}``, an unnamed parameter's):
those number the new place, as a new optimizer built over the list numbers it, so a checkpoint saved after the
reorder loads into one. The state is carried over as fp32 values (param_set.follow), so it is the same but for 8-bit
moments where tensors moved within or between groups: theirs, and those of the tensors the move shifts, fall into
other blocks of 256, quantized again with new scales (each moment within its quantization error, not bitwise).
Whole groups reordered keep their codes bitwise: each group's chunks start at a block and are cut the same wherever
the group stands.

Call order (param_set.follow_assigned, the optimizer's ``_follow_param_set``, under its lock, before each step,
load, state dict, checkpoint and ``add_param_group``): ``extra = assigned(groups.now, laid_out, params)``; where
the groups laid out changed, ``placed(...)`` and the state laid out again over them as param_set.py follows them;
then the ``extra`` groups, taken off the list, given back one by one to ``add_param_group``, as if the user had
added them so (torch's checks, their state laid out beside the rest). A group that fails there is put back, with
those after it, so the list stays as assigned and the next call raises the same error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["Groups", "GroupsAttribute", "assigned", "placed"]


class Groups:
    """The optimizer's ``param_groups`` list of now (``now``), shared by the parts that read it."""

    __slots__ = ("now",)

    def __init__(self, now: list[dict[str, Any]]) -> None:
        self.now = now


class GroupsAttribute:
    """``TieredOptimizer.param_groups``: the list of now of its one ``Groups`` (kept as ``_groups``), which an
    assignment points at the new list. torch's ``Optimizer.__init__`` assigns the first list, which makes it."""

    # By attribute, not through __dict__: Lightning's LightningOptimizer (a subclass of the optimizer's class over
    # none of its __dict__) finds ``_groups`` through its __getattr__, on the optimizer it wraps.
    def __get__(self, opt: Any, owner: type | None = None) -> Any:
        return self if opt is None else opt._groups.now

    def __set__(self, opt: Any, groups: list[dict[str, Any]]) -> None:
        if "_groups" in opt.__dict__:
            opt._groups.now = groups
        else:  # torch's Optimizer.__init__
            opt._groups = Groups(groups)


def assigned(param_groups: list[dict[str, Any]], laid_out: list[int], params: Sequence[Any]) -> list[dict[str, Any]]:
    """The groups ``param_groups`` holds beyond the ``len(laid_out)`` ones the state is laid out over (whose sizes
    ``laid_out`` gives, over the tensors ``params``), taken off the list for ``add_param_group`` to lay out. A group
    laid out must keep its number of parameters (its tensors may be others: ``placed``), unless the groups hold
    just the tensors ``params``, each once, reordered or regrouped (their state follows them): else ValueError
    naming the group and what to do, and nothing changes."""
    sizes = [len(g["params"]) for g in param_groups]
    if len(sizes) < len(laid_out):
        raise ValueError(
            f"param_groups holds {len(sizes)} groups; the optimizer's state is laid out over {len(laid_out)}: "
            "TieredOptimizer does not drop a group. Freeze the parameters that are to stop training "
            "(requires_grad_(False)), or build a new optimizer over the groups you want"
        )
    resized = [(gi, now, then) for gi, (now, then) in enumerate(zip(sizes, laid_out)) if now != then]
    if resized and not _regrouped(param_groups[: len(laid_out)], params):
        gi, now_size, then = resized[0]
        raise ValueError(
            f"param_groups[{gi}] holds {now_size} parameters; the optimizer's state is laid out over {then} there: "
            "TieredOptimizer follows other tensors in a group's places, and the same tensors in other places, not "
            "a group that grew or shrank. Add parameters as a group of their own (add_param_group(), or a group "
            "appended to param_groups), freeze the ones that are to stop training (requires_grad_(False)), or build "
            "a new optimizer"
        )
    extra = param_groups[len(laid_out) :]
    del param_groups[len(laid_out) :]
    return extra


def _regrouped(param_groups: list[dict[str, Any]], params: Sequence[Any]) -> bool:
    """Whether the groups hold just the tensors ``params``, each once: moved between groups, none new."""
    now = [p for g in param_groups for p in g["params"]]
    return len(now) == len(params) and {id(p) for p in now} == {id(p) for p in params}


def placed(param_groups: list[dict[str, Any]], laid_out: list[int], params: Sequence[Any],
           names: list[str]) -> tuple[list[int], list[str]]:  # fmt: skip
    """For each tensor of ``param_groups`` (in their flat order, after ``assigned``), the index in ``params`` (the
    tensors laid out, in groups of ``laid_out`` sizes, named ``names``) whose state it takes, and its name: a
    tensor laid out keeps its own (by identity, as torch keys state by tensor); another takes those of the one laid
    out in its place, which must then be gone from the groups. ValueError naming the tensor where it is not (which
    state it should take is unknown) or where a tensor is in two places; nothing changes."""
    where = {id(p): i for i, p in enumerate(params)}
    present = {where[id(p)]: f"param_groups[{gi}][{k}]" for gi, g in enumerate(param_groups)
               for k, p in enumerate(g["params"]) if id(p) in where}  # fmt: skip
    labels = [f"group{gi}.param{k}" for gi, n in enumerate(laid_out) for k in range(n)]
    source: list[int] = []
    out: list[str] = []
    for gi, g in enumerate(param_groups):
        for k, p in enumerate(g["params"]):
            i = where.get(id(p), len(source))
            if id(p) not in where and i in present:
                raise ValueError(
                    f"param_groups[{gi}][{k}] is a tensor the optimizer's state is not laid out over, in the place of "
                    f"{names[i]!r}, which is now at {present[i]}: TieredOptimizer carries state over "
                    "to another tensor only in the place of one that is gone (a model moved or reloaded). Put the "
                    "new tensor in the place of the one it replaces, or build a new optimizer"
                )
            if id(p) in where and present[i] != f"param_groups[{gi}][{k}]":
                raise ValueError(f"{names[i]!r} is in param_groups twice (param_groups[{gi}][{k}] and {present[i]}): "
                                 "pass each tensor once")  # fmt: skip
            source.append(i)
            out.append(f"group{gi}.param{k}" if names[i] == labels[i] else names[i])  # a place's number: the new one
    return source, out
