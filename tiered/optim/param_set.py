"""The tensors an optimizer's state is laid out on, against those its ``param_groups`` hold now.

torch.optim steps whatever tensors ``param_groups[i]["params"]`` hold at each step, and frameworks rely on it:
accelerate's FSDP2 ``prepare`` (and HF Trainer with FSDP, through it) builds the model's sharded parameters
after the optimizer and writes them into its ``param_groups``. TieredOptimizer lays its state out once, on the
tensors it was built on, so before each step, state dict and checkpoint it compares the two (``changed``) and,
where they differ, lays its state out again over the new tensors (``follow``):

- before any step there is no state to keep but the hyperparameters, which stay in the groups;
- after steps the state is carried over position by position (as torch keys it), where each new tensor (its
  local shard) has the shape of the old one (``check_carry``); otherwise nothing changes and the error names
  the parameter and what to do;
- a parameter frozen when laid out (no state: shards.py) that has since begun to take gradients is laid out
  the same way, its state starting then, as torch.optim.AdamW's does.

A change of the number of tensors in a group is refused: a new group goes through ``add_param_group``.

Call order (the optimizer's ``_follow_param_set``, under its lock): ``if changed(...): follow(opt)``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..arguments import check_free_space
from .assembly import plan_layout, release_parts
from .shards import Shards
from .state_dicts import export_state_dict, parse_state_dict, scatter_state

__all__ = ["flat", "changed", "check_carry", "follow", "restore"]


def flat(param_groups: list[dict[str, Any]]) -> list[torch.Tensor]:
    return [p for g in param_groups for p in g["params"]]


def changed(param_groups: list[dict[str, Any]], shards: Shards, group_sizes: list[int]) -> bool:
    """Whether the state must be laid out again: other tensors in ``param_groups`` than ``shards`` were laid
    out on, or frozen ones thawed. Raises ValueError where the groups' sizes changed."""
    sizes = [len(g["params"]) for g in param_groups]
    if sizes != group_sizes:
        raise ValueError(f"the param groups now hold {sizes} parameters, the optimizer was built for {group_sizes}: "
                         "add parameters with add_param_group(), or build a new optimizer")  # fmt: skip
    now = flat(param_groups)
    return any(a is not b for a, b in zip(now, shards.params)) or bool(shards.thawed())


def check_carry(names: list[str], old: list[torch.Tensor], steps: list[int], new: Shards) -> None:
    """The state of every parameter that has stepped fits its new (local) tensor, else ValueError by name."""
    for name, o, n, s in zip(names, old, new.locals, steps):
        if s and o.shape != n.shape:
            raise ValueError(
                f"parameter {name!r} was replaced in param_groups after {s} steps by a tensor of (local) shape "
                f"{tuple(n.shape)}; its state has shape {tuple(o.shape)}: TieredOptimizer carries state over to new "
                "tensors of the same shape only. Build the optimizer after the model is wrapped (fully_shard, "
                "accelerator.prepare), or load the state into a new optimizer (load_state_dict, load_checkpoint)"
            )


def follow(opt: Any) -> None:
    """Lay ``opt``'s state out again over the tensors its ``param_groups`` hold now: from scratch before any
    step (or when it is broken: a load follows), else carried over position by position. Every check runs
    before anything changes; a failure after that closes the optimizer (nothing is left to step on)."""
    carry = opt._broken is None and any(opt._steps)
    keep = frozenset(i for i, s in enumerate(opt._steps) if s) if carry else frozenset()
    shards = Shards(flat(opt.param_groups), keep)  # a parameter with state keeps it, frozen or not
    planned = plan_layout(opt.param_names, shards, opt.param_groups, opt._asked)
    if carry:
        check_carry(opt.param_names, opt._params, opt._steps, shards)
    grown = sum(c.nbytes for c in planned.chunks) - opt.state_bytes
    check_free_space(opt.workdir, grown, "the state laid out again")
    state = export_state_dict(opt) if carry else {}  # files in its folder, unlinked: they outlive the store
    release_parts(opt._resources)
    try:
        opt._steps = [0] * len(shards.locals)
        opt._assemble(shards, planned)
        if state:
            restore(opt, state)
    except BaseException:
        opt._finalizer()
        raise
    logging.getLogger("tiered").info("TieredOptimizer: the tensors in param_groups changed; the state is laid out "
                                     "again over them%s", " (carried over)" if state else "")  # fmt: skip


def restore(opt: Any, state: dict[int, dict[str, torch.Tensor]]) -> None:
    """Stream ``state`` (``export_state_dict`` of the layout before) into the layout now; step counts with it."""
    groups, start = [], 0
    for g in opt.param_groups:
        groups.append({"params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    rows, steps, _ = parse_state_dict(opt, {"state": state, "param_groups": groups})
    scatter_state(opt, rows, fresh=[True] * len(steps))
    opt.set_step_counts(steps, opt.global_step)
