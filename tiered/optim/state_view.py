"""``opt.state``: torch's ``optimizer.state`` over a state that lives in the tiers (``LazyState``).

torch's AdamW keeps each parameter's state as a dict of live tensors, which users and frameworks read, write
in place (``opt.state[p]["exp_avg"].zero_()``: ReLoRA-style restarts, pruning, re-initialised heads) and
assign (``opt.state[p] = {...}``: torch's ``ZeroRedundancyOptimizer.load_state_dict`` loads its partition so).
Here the state is in chunks, so each of those is a read or a load of one parameter:

- ``opt.state[p]`` reads ``p``'s state now, into host tensors (state_dicts.read_param_state): a copy, so a
  write into it changes nothing.
- ``opt.state[p] = {...}`` is a one-parameter load, checked as ``load_state_dict`` checks an entry; ``del
  opt.state[p]`` (or ``= {}``) leaves ``p`` without state, as torch's, whose next step starts it afresh (zero
  moments, the master from the parameter). Neither can make a broken optimizer whole: that takes a whole state.
- Iterating yields nothing and ``len`` is 0 (``bool`` says whether any parameter has state): frameworks walk
  ``optimizer.state`` to move every tensor to a device (Lightning does at the start and end of ``fit``), which
  would pull the whole state into memory.

Call order: the optimizer builds one per layout.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from .state_chunks import StateChunks
from .state_dicts import load_param_state, read_param_state

__all__ = ["LazyState"]


class LazyState(MutableMapping):
    """``opt.state`` (see the module docstring): ``opt.state[p]`` reads ``p``'s state (``step``, ``exp_avg``,
    ``exp_avg_sq``, and ``master`` for low-precision parameters); ``p in opt.state`` says whether it has any."""

    def __init__(self, usable: Callable[[], AbstractContextManager[StateChunks]], current: Callable[[], StateChunks],
                 loading: Callable[[], AbstractContextManager[StateChunks]],
                 to_global: Any = lambda state: state):  # fmt: skip
        """``usable()``: the optimizer's state, held still and checked usable for a block (a layout changed since
        is followed first, so the state is read under the layout of now); ``loading()``: the same for a load of
        one parameter's state (all or nothing, as a load: whole_load.py); ``current()``: the state as it is, for
        questions a closed or broken optimizer still answers. Bound methods of the optimizer, held weakly: its
        ``state`` must not keep it alive (it closes when collected)."""
        self._usable, self._current = weakref.WeakMethod(usable), weakref.WeakMethod(current)  # type: ignore[arg-type]
        self._loading = weakref.WeakMethod(loading)  # type: ignore[arg-type]
        self._to_global = to_global  # under FSDP2: the local tensors as DTensors, as in state_dict()

    def _state(self) -> StateChunks | None:
        current = self._current()
        return None if current is None else current()

    @staticmethod
    def _index(state: StateChunks, p: object) -> int | None:
        if not isinstance(p, torch.Tensor):
            return None
        params = (q for g in state.param_groups for q in g["params"])  # as the user has them (DTensors under FSDP2)
        return next((i for i, q in enumerate(params) if q is p), None)

    def _call(self, method: weakref.WeakMethod) -> AbstractContextManager[StateChunks]:
        fn = method()
        assert fn is not None  # the optimizer is alive: its state was just read
        return fn()

    # ------------------------------------------------------------------------------- read and write
    def __getitem__(self, p: object) -> dict[str, torch.Tensor]:
        state = self._state()
        i = None if state is None else self._index(state, p)
        if state is None or i is None or state.steps[i] == 0:
            return {}
        with self._call(self._usable) as state:
            return self._to_global({i: read_param_state(state, i)})[i]

    def __setitem__(self, p: object, value: Any) -> None:
        """A one-parameter load (the module docstring), as ``load_state_dict`` checks an entry."""
        state = self._state()
        i = None if state is None else self._index(state, p)
        if i is None:
            raise ValueError("opt.state[p] = ...: p is not a parameter of this TieredOptimizer, which keeps state "
                             "for its param_groups' parameters alone")  # fmt: skip
        with self._call(self._loading) as state:
            load_param_state(state, i, value)

    def __delitem__(self, p: object) -> None:
        if p not in self:
            raise KeyError(p)  # as torch's dict: no state to delete
        self[p] = {}

    def __contains__(self, p: object) -> bool:
        state = self._state()
        i = None if state is None else self._index(state, p)
        return state is not None and i is not None and state.steps[i] > 0

    # ------------------------------------------------------------------------- the rest of a dict
    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __bool__(self) -> bool:
        # Whether any parameter has taken a step, as for torch's dict: torch.distributed.checkpoint tests it
        # and, finding no state, runs a zero-gradient step to make some, which would decay trained moments.
        state = self._state()
        return state is not None and any(state.steps)

    def __repr__(self) -> str:
        return "<TieredOptimizer state: read one parameter's with opt.state[p]>"
