"""``TieredOptimizer(model)`` leaves out the parameters frozen when it is built (README: from a module, frozen
parameters are left out), so one thawed later takes gradients and is never updated. ``LeftOut`` says so, once a
parameter, at the first step where it has a gradient, naming it and the fix. (A list of parameters, as torch's
AdamW takes them, keeps frozen ones and follows them when thawed: param_set.py.)"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch

__all__ = ["LeftOut"]


class LeftOut:
    def __init__(self, params: Any):
        """``params``: the optimizer's first argument; only a module leaves parameters out."""
        self._waiting: list[tuple[str, weakref.ref[torch.Tensor]]] = []
        if isinstance(params, torch.nn.Module):  # held weakly: a parameter the model drops is no concern of ours
            self._waiting = [(n, weakref.ref(p)) for n, p in params.named_parameters() if not p.requires_grad]

    def check(self, stepped: list[dict[str, Any]]) -> None:
        """Before a step: warn once about each left-out parameter that now has a gradient and is in none of the
        ``stepped`` param groups (one added with add_param_group, as the warning advises, is updated)."""
        if not self._waiting:
            return
        added = {id(p) for g in stepped for p in g["params"]}
        took = [n for n, ref in self._waiting if (p := ref()) is not None and p.grad is not None and id(p) not in added]
        if not took:
            return
        self._waiting = [(n, ref) for n, ref in self._waiting if n not in took and ref() is not None]
        warnings.warn(
            f"parameter(s) {', '.join(map(repr, took))} of the model now have gradients, but were frozen when "
            "TieredOptimizer(model) was built, which leaves frozen parameters out: they are not updated. Build it "
            "from list(model.parameters()) (frozen ones are then followed once thawed, as torch.optim.AdamW does), "
            "or add them with add_param_group()",
            UserWarning,
            stacklevel=3,
        )
