"""One AdamW step's work, in order, for ``TieredOptimizer.step()``: its groups checked first (``check_groups``), then
(``run_step``) the step counts, the clip, the updates backward started kept where still exact (under_backward/), the
rest streamed through the pipeline (pipeline.py), the parameters' versions taken, the step's times and bytes closed
(step_stats.py).

This module exists so that optimizer.py keeps the ``torch.optim`` contract around the step (its lock, the closure,
the gradients held by ``Shards.grads``, Ctrl-C deferred, a state left torn marked broken) and this one the order of
the work inside it, each read in one sitting.

Call order: ``TieredOptimizer.step()``, under its lock, calls ``check_groups(param_groups)``, then, with the
gradients held and Ctrl-C deferred, ``run_step(state, ..., sigint, tearing)`` once; ``tearing(True)`` says that from
there a failure leaves some chunks updated and others not, ``tearing(False)`` that every chunk is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..arguments import check_flags
from ..interrupts import Sigint
from .adamw_kernel import hyperparameters
from .clip_order import ClipOrder
from .pipeline import StepPipeline
from .shards import Shards, release_resident
from .state_chunks import StateChunks
from .step_stats import StepTimes
from .strategy import UpdateStrategy
from .under_backward.overlap import UnderBackward

__all__ = ["check_groups", "run_step"]


def check_groups(param_groups: list[dict[str, Any]]) -> None:
    """Before the step starts: what the update reads from each group, as it will read it. torch's AdamW reads its
    flags and hyperparameters from the groups at every step, so a value set since (a scheduler's None, a group
    assigned without betas, betas=0.9) is refused here, by group and key, with nothing changed; met by the update
    instead, it would fail part-way and leave the optimizer broken."""
    for gi, group in enumerate(param_groups):
        hyperparameters(group, f"param_groups[{gi}]")  # first: check_flags reads the weight decay
        check_flags(group, f"param_groups[{gi}]")


def run_step(state: StateChunks, pipeline: StepPipeline, times: StepTimes, under_backward: UnderBackward | None,
             max_grad_norm: float | None, defer_clip: bool, sigint: Sigint, tearing: Callable[[bool], None],
             clip_order: ClipOrder) -> None:  # fmt: skip
    """Update every chunk with a parameter that has a gradient, as one step of ``state``. ``under_backward``: the
    update under backward, if on; ``defer_clip``: an offloaded model's clip, applied as the update reads each
    gradient (``Shards.clip_grad_norm_``); ``clip_order``: the order that clip takes the gradients in (the model's:
    clip_order.py)."""
    shards, strategy, params = state.shards, state.strategy, state.params
    clock = times.start(state.store, _link_totals(strategy, shards))
    if under_backward is not None:  # updates backward handed over: queued before counts or grads change
        under_backward.step_began(clock)
    has_grad = [p.grad is not None for p in params]
    clipped: bool | None = False
    if max_grad_norm is not None:  # by the norm over every rank's shards, under FSDP2
        ub = under_backward  # only its started updates need to know whether it scaled: asking waits
        with clock.timed("clip_s"):
            order = clip_order(shards.params, [i for i, h in enumerate(has_grad) if h])  # the model's (clip_order.py)
            clipped = shards.clip_grad_norm_(order, max_grad_norm, answer=ub is not None and ub.started(),
                                             defer=defer_clip and ub is None)  # fmt: skip
    release_resident(shards)  # the sums backward left on the GPU that no clip took: memory back
    tearing(True)  # from here a failure leaves some chunks updated and others not
    for i, h in enumerate(has_grad):
        if h:
            state.steps[i] += 1
    state.updater.begin(state.steps, state.written_now())  # the writes before this step's own

    work = [(c, [j for j, pc in enumerate(c.pieces) if has_grad[pc.param]]) for c in state.chunks]
    work = [(c, js) for c, js in work if js]
    # The updates backward started are kept where still exact (optim/under_backward/overlap.py); the rest stream.
    streamed = work if under_backward is None else under_backward.settle(work, clipped is True, clock)
    strategy.grad_scale = shards.deferred_scale  # a deferred clip: applied as gradients are read
    strategy.device_grads = shards.device_grads  # and the copies of them it left on the GPU
    try:
        reads = pipeline.run(streamed, clock, sigint)
    finally:
        strategy.grad_scale = None
        strategy.device_grads = shards.device_grads = {}  # their memory back, the step done
    tearing(False)
    for i, h in enumerate(has_grad):
        if h:  # their masters now match the values just written
            state.versions[i] = state.version(i)

    times.finish(clock, state.store, sum(c.nbytes for c, _ in work), _link_totals(strategy, shards))
    if under_backward is not None:
        under_backward.step_ended()
    reads.next_step()  # after the store's counters were read: this read-ahead counts for the next step
    state.step_count += 1


def _link_totals(strategy: UpdateStrategy, shards: Shards) -> tuple[int, int]:
    """The bytes the update's copies and the clip's have moved up and down the link so far (optim/link.py)."""
    (up, down), (clip_up, clip_down) = strategy.link.totals(), shards.link.totals()
    return up + clip_up, down + clip_down
