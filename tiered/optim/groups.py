"""An optimizer's ``param_groups`` as they are now: ``Groups``, the one place every part reads them from, and
``assigned``, what a list assigned to ``opt.param_groups`` changed against the groups the state is laid out over.

torch.optim reads ``self.param_groups`` afresh at every step, state dict and ``add_param_group``, and frameworks
assign the attribute a new list: Lightning's ``BaseFinetuning`` restores its saved groups so on resume (new dicts
over the same tensors, and one group more where a layer was thawed before the checkpoint); accelerate's
``AcceleratedOptimizer`` passes such an assignment through. A part that kept the list it was built with would
step with the old dicts' hyperparameters (an LR schedule lost without a word) and load into a list nobody reads.
So ``TieredOptimizer.param_groups`` is a property over one ``Groups``, which an assignment points at the new list,
and its state (state_chunks.py) and update strategies (transfer.py) hold that ``Groups``, never a list.

Call order (the optimizer's ``_follow_param_set``, under its lock, before each step, load, state dict, checkpoint
and ``add_param_group``): ``extra = assigned(groups.now, laid_out)``; the groups laid out followed as param_set.py
follows them; then the ``extra`` groups, taken off the list, given back one by one to ``add_param_group``, as if
the user had added them so (torch's checks, their state laid out beside the rest). A group that fails there is
put back, with those after it, so the list stays as assigned and the next call raises the same error.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Groups", "assigned"]


class Groups:
    """The optimizer's ``param_groups`` list of now (``now``), shared by the parts that read it."""

    __slots__ = ("now",)

    def __init__(self, now: list[dict[str, Any]]) -> None:
        self.now = now


def assigned(param_groups: list[dict[str, Any]], laid_out: list[int]) -> list[dict[str, Any]]:
    """The groups ``param_groups`` holds beyond the ``len(laid_out)`` ones the state is laid out over (whose sizes
    ``laid_out`` gives), taken off the list for ``add_param_group`` to lay out. A group laid out must keep its
    number of parameters (its tensors may be others: param_set.changed), as the state is carried by position
    in it: else ValueError naming the group and what to do, and nothing changes."""
    sizes = [len(g["params"]) for g in param_groups]
    if len(sizes) < len(laid_out):
        raise ValueError(
            f"param_groups holds {len(sizes)} groups; the optimizer's state is laid out over {len(laid_out)}: "
            "TieredOptimizer does not drop a group. Freeze the parameters that are to stop training "
            "(requires_grad_(False)), or build a new optimizer over the groups you want"
        )
    for gi, (now, then) in enumerate(zip(sizes, laid_out)):
        if now != then:
            raise ValueError(
                f"param_groups[{gi}] holds {now} parameters; the optimizer's state is laid out over {then} there: "
                "TieredOptimizer follows other tensors in a group's places, not a group that grew or shrank. Add "
                "parameters as a group of their own (add_param_group(), or a group appended to param_groups), "
                "freeze the ones that are to stop training (requires_grad_(False)), or build a new optimizer"
            )
    extra = param_groups[len(laid_out) :]
    del param_groups[len(laid_out) :]
    return extra
