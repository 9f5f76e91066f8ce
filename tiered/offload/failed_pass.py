"""An offloaded model after a forward or backward that raised part-way (out of memory, Ctrl-C), made to go on as the
model without FSDP2 would.

FSDP2 leaves two things behind such a pass (its own docs call its per-iteration state undefined then):

- its bookkeeping of the pass: the final callback of backward marked as queued (so the next backward queues none,
  and the root's gradients are never reduced), training states, the order of the forward;
- the gradients autograd made on the gathered weights of units whose reduction had not run yet (the root unit's
  reduces at backward's end): they sit on FSDP2's unsharded parameters, where ``zero_grad`` does not reach them.

Plain, those gradients sit in ``.grad``: the user drops them with ``zero_grad`` (the usual way to skip the batch),
or keeps them, and the next backward adds to them. So, once a pass failed:

- at ``zero_grad`` (the model's, or TieredOptimizer's for the models its parameters belong to), the bookkeeping is
  reset and the gradients on the gathered weights are dropped;
- at the next forward without one, the bookkeeping is reset and those gradients kept: the next backward adds its
  own to them on the gathered weights, and FSDP2's reduction takes the sum, as plain ``.grad`` would hold.

Only the bookkeeping tells a failed pass: gradients on the gathered weights are no sign of one. Under no-sync
accumulation (``set_requires_gradient_sync(False)`` on all micro-batches but the last) FSDP2 keeps them there on
purpose after a backward that ended well, for the next to add to; resetting its state then, and saying a pass
failed, would be wrong each micro-batch. ``zero_grad`` drops them all the same, failed pass or not, as it drops
plain ``.grad``.

The reset is FSDP2's ``reset_iter_state`` where torch has it (2.14 on); before, the same fields it resets, each
only where it exists. Its state is FSDP2's private state, so each step of it is guarded: what a torch version
lacks is left alone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from torch import nn

_log = logging.getLogger("tiered")

__all__ = ["failed", "forget_failed_pass"]


def _states(model: nn.Module) -> Iterator[Any]:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            yield module._get_fsdp_state()  # type: ignore[operator]


def _groups(state: Any) -> list[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch before grouped modules: one group a state, or none
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return [g for g in groups if g is not None]


def _idle(obj: Any) -> bool:
    return getattr(getattr(obj, "_training_state", None), "name", "IDLE") == "IDLE"


def failed(model: nn.Module) -> bool:
    """Whether the model's last forward or backward was left part-way: FSDP2's final callback still marked as
    queued, or a unit not idle. Gradients on gathered weights alone are not (no-sync keeps them there)."""
    for state in _states(model):
        ctx = getattr(state, "_state_ctx", None)
        if ctx is not None and getattr(ctx, "post_backward_final_callback_queued", False):
            return True
        if not _idle(state) or not all(_idle(g) for g in _groups(state)):
            return True
    return False


def _drop_gathered_grads(states: list[Any]) -> None:
    """Drop the gradients no reduction took yet, on the gathered weights (``unsharded_accumulated_grad``: those
    FSDP2 keeps in its reduce dtype under no-sync)."""
    for state in states:
        for group in _groups(state):
            for p in group.fsdp_params:
                unsharded = getattr(p, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None
                if getattr(p, "unsharded_accumulated_grad", None) is not None:
                    p.unsharded_accumulated_grad = None


def forget_failed_pass(model: nn.Module, *, drop_grads: bool) -> bool:
    """After a failed pass: reset FSDP2's bookkeeping of it. ``drop_grads`` (``zero_grad``): the gradients on the
    gathered weights are dropped, a failed pass's or no-sync's; without (a forward), they stay for the next
    backward to add to. Returns whether there was a failed pass."""
    states = list(_states(model))
    if drop_grads:
        _drop_gathered_grads(states)
    if not failed(model):
        return False
    reset = getattr(model, "reset_iter_state", None)
    if callable(reset):
        reset()
    else:
        _reset_fields(states)
    _log.warning("tiered: the offloaded model's last forward or backward raised part-way: FSDP2's state of it reset, "
                 "%s", "its gradients not yet reduced dropped (zero_grad)" if drop_grads else
                 "its gradients not yet reduced kept for the next backward to add to")  # fmt: skip
    return True


def _reset_fields(states: list[Any]) -> None:
    """``reset_iter_state``'s fields, on a torch without it: every unit idle and resharded, the forward's order
    and root forgotten, backward's final callback no longer marked as queued."""
    for state in states:
        if hasattr(state, "_training_state"):
            state._training_state = type(state._training_state).IDLE
        getattr(state, "_modules_to_run_forward", set()).clear()
        for group in _groups(state):
            if hasattr(group, "_training_state"):
                group._training_state = type(group._training_state).IDLE
            getattr(group, "_post_forward_indices", []).clear()
            group.reshard()
        comm = getattr(state, "_comm_ctx", None)
        getattr(comm, "post_forward_order", []).clear()
        ctx = getattr(state, "_state_ctx", None)
        if ctx is not None:
            ctx.iter_forward_root = None
            ctx.post_backward_final_callback_queued = False
