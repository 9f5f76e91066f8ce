"""The order ``max_grad_norm`` takes the gradients' norms in: the model's, where the optimizer was built from it.

torch's ``clip_grad_norm_`` stacks one norm a gradient in the order it is given them and takes the norm of that
vector, whose rounding depends on the order. Users and frameworks clip with ``clip_grad_norm_(model.parameters())``,
while ``param_groups`` may list the same tensors in another order: a layer thawed and added with
``add_param_group`` comes after the head it precedes in the model. Summed in group order, the norm differed in its
last bit and the weights drifted from the first clipped step. So where the optimizer was built from a module
(``TieredOptimizer(model)``), the clip takes the gradients in ``model.parameters()`` order, those of tensors the
module lacks after them, in group order. Built from a list or groups (HF Trainer's decay/no-decay groups), the
optimizer knows no other order than the groups': that one.

Every path of the clip takes the gradients in the order it is given (``Shards.clip_grad_norm_``: one rank's
``get_total_norm``, a deferred clip's norm on the GPU, FSDP2's all-reduced vector of squares, torch's DTensor norm
under tensor parallel), so all of them follow this one; every rank builds the same model, so under FSDP2 the ranks'
vectors line up as before.

Call order: ``ClipOrder(params)`` with the optimizer's first argument, held for good; per clipped step
``order(shards.params, indices)``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["ClipOrder"]


class ClipOrder:
    def __init__(self, params: Any):
        """``params``: the optimizer's first argument; only a module gives an order, held weakly (the optimizer
        does not keep the model alive)."""
        self._module = weakref.ref(params) if isinstance(params, torch.nn.Module) else None

    def __call__(self, params: list[torch.Tensor], indices: list[int]) -> list[int]:
        """``indices`` (into ``params``, the tensors as the user passed them: DTensors under FSDP2) in the module's
        order, the others after them in their own. Read at each clip: tensors swapped into the model and the
        groups (param_set.follow) are found where they are now."""
        module = None if self._module is None else self._module()
        if module is None:
            return indices
        at = {id(p): k for k, p in enumerate(module.parameters())}
        last = len(at)
        return sorted(indices, key=lambda i: (at.get(id(params[i]), last), i))
