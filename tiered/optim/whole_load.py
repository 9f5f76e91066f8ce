"""Loads all or nothing, as a step is: ``load_state_dict`` and ``load_checkpoint`` replace the state chunk by chunk,
so a load stopped part-way leaves some chunks loaded and the others as they were, a state that is neither.

- Ctrl-C: while a load runs it is counted (interrupts.deferred_sigint) and delivered once the load has ended, the
  state whole. One pressed before the load changed anything stops it at the first chunk, nothing changed; a second
  one stops it at the next chunk, the state torn. Not in a collective load (FSDP2): a rank that stopped alone
  would leave the others waiting for it, so there the load always ends first. A SIGTERM's or SIGUSR1's Python
  handler (interrupts.HELD) is held to the end as well, so the save a preemption handler makes holds the load whole.
- Any exception once a chunk has changed (a second Ctrl-C, a failed write, a damaged checkpoint found late): the
  optimizer is marked broken (``OptimizerBrokenError`` from ``step``, ``state_dict`` and ``save_checkpoint``, as
  after a step that failed part-way) until a load ends whole. An exception before that leaves it as it was.

Call order (the optimizer, under its lock): ``with whole_load(what, state, mark_broken, collective) as guard:``
around the load; ``state.guard`` is ``guard`` for the block, and every chunk a load replaces calls
``guard.chunk()`` first (``StateChunks.install_chunk_rows``, state_dicts.scatter_state); work that replaces the
state otherwise (the state laid out again) sets ``guard.torn``; the load clears it once the state is whole again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..interrupts import Sigint, deferred_sigint

__all__ = ["LoadGuard", "NO_GUARD", "OptimizerBrokenError", "torn", "whole_load"]


class OptimizerBrokenError(RuntimeError):
    """A step or a load failed part-way; the state is torn until a checkpoint or state dict is loaded."""

    def __init__(self, why: str):
        super().__init__(
            f"{why}, so some chunks of the state are changed and others not: restore a whole state with "
            "load_checkpoint() or load_state_dict() before step(), state_dict() or save_checkpoint() (or build a new "
            "optimizer)"
        )


def torn(what: str, e: BaseException) -> str:
    """Why the state is torn: ``what`` (``"step()"``) failed or was stopped part-way by ``e``."""
    return (
        f"{what} failed part-way ({type(e).__name__}: {e})"
        if str(e)
        else f"{what} was stopped part-way ({type(e).__name__})"
    )


class LoadGuard:
    """One load's progress: whether the state is torn (``torn``: a chunk replaced, not yet all), and where a
    Ctrl-C stops it."""

    def __init__(self, sigint: Sigint | None = None, collective: bool = False):
        self.sigint, self.collective, self.torn = sigint, collective, False

    def chunk(self) -> None:
        """A chunk's state is about to be replaced: stop here if Ctrl-C asks to (see the module docstring)."""
        if self.sigint is not None and not self.collective:
            pressed = self.sigint.pressed()
            if pressed >= 2 or pressed and not self.torn:
                raise KeyboardInterrupt
        self.torn = True


NO_GUARD = LoadGuard()  # outside a load: no Ctrl-C counted, nothing to stop


@contextmanager
def whole_load(what: str, state: Callable[[], Any], mark_broken: Callable[[str], None],
               collective: bool = False) -> Iterator[LoadGuard]:  # fmt: skip
    """The block is one load named ``what`` (``"load_checkpoint()"``) of the state ``state()`` gives (the optimizer's
    current ``StateChunks``, which imports this module; a load may lay it out again); ``mark_broken(why)`` where it
    fails after changing the state.
    ``collective``: every rank loads together (no stop part-way on one)."""
    with deferred_sigint() as sigint:
        guard = LoadGuard(sigint, collective)
        first = state()
        first.guard = guard
        try:
            yield guard
        except BaseException as e:
            if guard.torn or getattr(e, "partial_load", False):  # a checkpoint's error knows too (another rank's)
                mark_broken(torn(what, e))
            raise
        finally:
            first.guard = state().guard = NO_GUARD
