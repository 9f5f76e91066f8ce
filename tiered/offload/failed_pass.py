"""An offloaded model after a forward or backward that raised part-way (out of memory, Ctrl-C), made to go on as the
model without FSDP2 would.

FSDP2 leaves two things behind such a pass (its own docs call its per-iteration state undefined then):

- its bookkeeping of the pass: the final callback of backward marked as queued (so the next backward queues none,
  and the root's gradients are never reduced), training states, the order of the forward;
- the gradients autograd made on the gathered weights of units whose reduction had not run yet (the root unit's
  reduces at backward's end): they sit on FSDP2's unsharded parameters, where ``zero_grad`` and an optimizer's
  step do not reach them.

Plain, those gradients sit in ``.grad``: the user drops them with ``zero_grad`` (the usual way to skip the batch),
or keeps them, and the next backward adds to them, or the step takes them (a loop that catches an out-of-memory
error in its last micro-batch and steps anyway). So, once a pass failed:

- at ``zero_grad`` (the model's, or TieredOptimizer's for the models its parameters belong to), the bookkeeping is
  reset and the gradients on the gathered weights are dropped (``forget_failed_pass``);
- at the next forward without one, or any optimizer's step over the model's parameters before it, the failed
  backward is ended where it stopped (``keep_failed_pass``): FSDP2's own end of backward runs, in a backward of
  one node made for it, with FSDP2's settings as the pass began (a no-sync loop has set the next micro-batch's
  since), and reduces those gradients into the sums as it would have; then the bookkeeping is reset. ``.grad``
  then holds what plain ``.grad`` holds, summed in its order (the earlier micro-batches' sum plus the failed
  pass's gradients, to which the next backward adds, or which the step takes): bitwise. Only a read of the
  gradients between the failure and that forward or step (a clip or GradScaler's unscale_ by hand) sees the sums
  without them: the log says so where the step ended the pass.

Only the bookkeeping tells a failed pass: gradients on the gathered weights are no sign of one. Under no-sync
accumulation (``set_requires_gradient_sync(False)`` on all micro-batches but the last) FSDP2 keeps them there on
purpose after a backward that ended well, for the next to add to; resetting its state then, and saying a pass
failed, would be wrong each micro-batch. ``zero_grad`` drops them all the same, failed pass or not, as it drops
plain ``.grad``; ending a failed pass under no-sync leaves them there, as its backward would have.

The reset is FSDP2's ``reset_iter_state`` where torch has it (2.14 on); before, the same fields it resets, each
only where it exists. Its state is FSDP2's private state, so each step of it is guarded: what a torch version
lacks is left alone. The end of backward is FSDP2's ``_root_post_backward_final_callback``, which every torch with
FSDP2 has (2.4 on); without it a failed pass is refused rather than kept part-way.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

_log = logging.getLogger("tiered")

__all__ = ["Settings", "failed", "forget_failed_pass", "keep_failed_pass", "settings"]


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


def forget_failed_pass(model: nn.Module) -> bool:
    """``zero_grad``: the gradients on the gathered weights are dropped, a failed pass's or no-sync's, and FSDP2's
    bookkeeping of a failed pass reset. Returns whether there was a failed pass."""
    states = list(_states(model))
    _drop_gathered_grads(states)
    if not failed(model):
        return False
    _reset(model, states)
    _log.warning("tiered: the offloaded model's last forward or backward raised part-way: FSDP2's state of it reset, "
                 "its gradients not yet reduced dropped (zero_grad)")  # fmt: skip
    return True


# FSDP2's settings a backward reads as it goes and at its end (set_requires_gradient_sync, set_requires_all_reduce,
# set_reshard_after_backward on each unit's groups; set_is_last_backward on the root's context).
_GROUP_SETTINGS = ("reduce_grads", "all_reduce_grads", "reshard_after_backward")

Settings = list[Any]  # their values, in ``_slots``' order: no reference to FSDP2's objects (nor so to the model)


def _slots(model: nn.Module) -> list[tuple[Any, str]]:
    slots: list[tuple[Any, str]] = []
    for state in _states(model):
        ctx = getattr(state, "_state_ctx", None)
        if ctx is not None and hasattr(ctx, "is_last_backward") and not any(o is ctx for o, _ in slots):
            slots.append((ctx, "is_last_backward"))
        slots.extend((g, name) for g in _groups(state) for name in _GROUP_SETTINGS if hasattr(g, name))
    return slots


def settings(model: nn.Module) -> Settings:
    """FSDP2's settings for the model's pass, as they are now: what ``keep_failed_pass`` ends a pass with."""
    return [getattr(obj, name) for obj, name in _slots(model)]


@contextlib.contextmanager
def _set(model: nn.Module, values: Settings | None) -> Iterator[None]:
    slots = _slots(model)
    if values is None or len(values) != len(slots):  # none taken (or the model's units changed since): as they are
        yield
        return
    now = [getattr(obj, name) for obj, name in slots]
    try:
        for (obj, name), value in zip(slots, values):
            setattr(obj, name, value)
        yield
    finally:
        for (obj, name), value in zip(slots, now):
            setattr(obj, name, value)


def keep_failed_pass(model: nn.Module, ran_with: Settings | None = None, *, at_step: bool = False) -> bool:
    """Before a forward, or a step over the model's parameters: a failed pass's backward is ended where it stopped,
    the gradients it made that no reduction took yet reduced into the sums (as plain ``.grad`` keeps them), and
    FSDP2's bookkeeping of it reset. ``ran_with``: FSDP2's settings as the pass began (``settings``), which the end
    of its backward reads, not those set for the next one since (a no-sync loop's ``set_requires_gradient_sync``
    before the next forward).
    ``at_step``: before an optimizer's step rather than a forward (what the log says). Returns whether there was a
    failed pass."""
    if not failed(model):
        return False
    from torch.distributed.fsdp import FSDPModule

    state = model._get_fsdp_state() if isinstance(model, FSDPModule) else None  # type: ignore[operator]
    end = getattr(state, "_root_post_backward_final_callback", None)
    if not callable(end):
        raise RuntimeError("tiered: the offloaded model's last forward or backward raised part-way, and this torch's "
                           "FSDP2 has no end of backward to reduce its gradients with: call zero_grad() to skip the "
                           "batch (then run it again)")  # fmt: skip
    # FSDP2's end of backward reduces the gradients each unit made that it finds not reduced (calling the reduce
    # hooks, and the parameters' post-accumulate-grad hooks) as at a backward's end: run it as one, so that what
    # those hooks expect of a backward (its id, callbacks queued for its end) holds. Under no_grad or
    # inference_mode too (an evaluation's forward after the failed pass).
    with _set(model, ran_with), torch.inference_mode(False), torch.enable_grad():
        _EndOfBackward.apply(torch.zeros((), requires_grad=True), end).backward()
    _reset(model, list(_states(model)))
    # Plain .grad held them from the failure on: a read of the gradients since (a clip or unscale by hand before
    # the step) saw the sums without them, which only this log can tell.
    when = ("before this optimizer step (a clip or unscale of the gradients by hand since the failure saw the sums "
            "without them)" if at_step else "before the next forward")  # fmt: skip
    _log.warning("tiered: the offloaded model's last forward or backward raised part-way: its backward ended %s, "
                 "the gradients it made summed in and kept (as plain .grad keeps them), FSDP2's state of it reset",
                 when)  # fmt: skip
    return True


class _EndOfBackward(torch.autograd.Function):
    """A backward of one node, at whose end ``end`` runs as backward's final callback."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, end: Any) -> torch.Tensor:
        ctx.end = end
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        torch.autograd.Variable._execution_engine.queue_callback(ctx.end)  # type: ignore[attr-defined]
        return grad, None


def _reset(model: nn.Module, states: list[Any]) -> None:
    reset = getattr(model, "reset_iter_state", None)
    if callable(reset):
        reset()
    else:
        _reset_fields(states)


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
