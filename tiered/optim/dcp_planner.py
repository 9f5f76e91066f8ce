"""``TieredLoadPlanner``: torch.distributed.checkpoint's load planner for a TieredOptimizer's state dict.

Beside AdamW's entries, a TieredOptimizer's state dict holds an fp32 ``master`` for each bf16/fp16 parameter
(state_dicts.py), so the template ``get_state_dict(model, opt)`` gives ``dcp.load`` has those keys too. A checkpoint
without them, one torch.optim.AdamW wrote or one of fp32 parameters loaded into bf16 ones, is refused by torch's
``DefaultLoadPlanner`` ("Missing key in checkpoint state_dict: optim.state.<name>.master"), which needs every key of
the template in the checkpoint. This planner is that planner with those masters allowed to be absent: each one
absent is set to None in the template, so ``set_state_dict`` hands ``load_state_dict`` an entry without a master,
which it takes from the parameter, now holding the loaded weights (what ``opt.load_state_dict`` does with AdamW's
state dict). Every other key stays required, the model's included.

``DefaultLoadPlanner(allow_partial_load=True)`` loads such a checkpoint too, but it also lets any other key be
absent, and it leaves an absent master's template tensor as it was: the optimizer's master from before the load,
which stands wherever the loaded weight is its rounding (the masters' rule for a write to a parameter, update.py).

Call order: ``dcp.load(state, checkpoint_id=..., planner=TieredLoadPlanner())``, then ``set_state_dict`` (or
``set_optimizer_state_dict``), as with DefaultLoadPlanner, whose arguments it takes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, LoadPlan

__all__ = ["TieredLoadPlanner"]


def _is_master(path: tuple[Any, ...]) -> bool:
    """Whether ``path`` (the keys down to a value of the state dict given to ``dcp.load``) names an optimizer's
    ``master`` entry: ``(..., "state", name, "master")``, or ``(..., "state.<name>.master")`` in the layout of
    ``StateDictOptions(flatten_optimizer_state_dict=True)``."""
    last = path[-1]
    if len(path) >= 3 and last == "master" and path[-3] == "state":
        return True
    return isinstance(last, str) and last.startswith("state.") and last.endswith(".master")


class TieredLoadPlanner(DefaultLoadPlanner):
    """torch's ``DefaultLoadPlanner``, which also loads a checkpoint without TieredOptimizer's fp32 masters (one
    torch.optim.AdamW wrote over bf16/fp16 parameters): the masters then start from the loaded weights."""

    def create_local_plan(self) -> LoadPlan:
        # DefaultLoadPlanner first settles which key format the checkpoint has (torch < 2.4 named keys
        # otherwise): with partial loads allowed it plans every key the checkpoint holds and skips the rest.
        strict = not self.allow_partial_load
        self.allow_partial_load = True
        try:
            plan = super().create_local_plan()
        finally:
            self.allow_partial_load = not strict
        assert self.metadata is not None  # set_up_planner gave it; DefaultLoadPlanner has raised otherwise
        saved = self.metadata.state_dict_metadata
        for fqn, value in self.state_dict.items():
            if fqn in saved:
                continue
            path = self.mappings.get(fqn, (fqn,)) if self.flatten_state_dict else (fqn,)
            if isinstance(value, torch.Tensor) and _is_master(path):
                parent: Any = self.original_state_dict  # dicts and lists down the path
                for key in path[:-1]:
                    parent = parent[key]
                parent[path[-1]] = None  # no master: load_state_dict takes it from the parameter
            elif strict:
                raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")  # DefaultLoadPlanner's words
        return plan
