"""``opt.state``: torch's ``optimizer.state`` over a state that lives in the tiers (``LazyState``).

torch's AdamW keeps each parameter's state as a dict of live tensors, which users and frameworks read, write
in place (``opt.state[p]["exp_avg"].zero_()``: ReLoRA-style restarts, pruning, re-initialised heads) and
assign (``opt.state[p] = {...}``: torch's ``ZeroRedundancyOptimizer.load_state_dict`` loads its partition so).
Here the state is in chunks, so each of those is a read or a load of one parameter:

- ``opt.state[p]`` reads ``p``'s state now, into host tensors (state_dicts.read_param_state): a copy. The dict
  handed out is kept, with its tensors' version counters, at most until the end of the next ``step()``. Before
  that step, and before every ``state_dict()``, checkpoint save, ``opt.state`` read or ``add_param_group``
  (``TieredOptimizer._check_usable`` calls ``flush``), each kept dict is looked at: where a tensor was written in
  place, or an entry replaced or deleted, those entries are loaded for that parameter alone
  (state_dicts.load_param_state), so the write takes effect as on torch's live tensors, bitwise. A ``master``
  written moves its bf16/fp16 parameter to the master's rounding, as on AdamW over fp32 masters (a load's master
  stands behind the weight instead). Where no dict was handed out this costs nothing; otherwise a look at each
  kept dict's few tensors.
- Then a kept dict that nothing else refers to, nor to its tensors (``_held_elsewhere``), is let go: no write can
  come to it any more. So ``opt.state[p]["exp_avg"].zero_()`` is loaded at the next call, and a loop that reads
  every parameter's state (logging moment norms) holds about one copy at a time, not a second state on the disk.
- One still kept is handed out again by the next read of that parameter, as torch's one live dict is (two
  handles on ``exp_avg`` are one tensor: writes through both add up), set to the state now (``_Handed.again``:
  what a fresh read gives, so a master moves with a write to its parameter, 8-bit moments hold their codes').
- A step moves torch's tensors on; the copies handed out before it are then stale. They are let go, and their
  tensors watched weakly: one still held and written to after the step is refused by name at the next call
  (``RuntimeError``), not dropped silently. A dict's entries replaced after the step are not seen.
- ``opt.state[p] = {...}`` is a one-parameter load, checked as ``load_state_dict`` checks an entry; ``del
  opt.state[p]`` (or ``= {}``) leaves ``p`` without state, as torch's, whose next step starts it afresh (zero
  moments, the master from the parameter). Neither can make a broken optimizer whole: that takes a whole state.
- The state laid out again (a parameter thawed or swapped, a group added: param_set.follow) keeps every
  parameter's place, a new group's after the rest, or where the same tensors moved (groups reordered:
  groups.placed) moves the dicts handed out with them (``moved``): the dicts handed out stay watched across it,
  by the one ``LazyState`` the optimizer keeps for good, so a write to one, before or after it, is taken in by
  the new layout for its own parameter, and one after a step is refused, as without it.
- A load (``load_state_dict``, ``load_checkpoint``) forgets the dicts handed out (``forget``): torch's load puts
  new tensors in the state, so writes to the old ones change nothing there either.
- ``get`` and ``pop(p, default)`` give the default for a parameter without state, as on torch's
  ``defaultdict(dict)`` (where they make no entry); ``pop`` reads, then deletes.
- ``opt.state.clear()``, and assigning an empty mapping (``opt.state = defaultdict(dict)``, ``{}``: the
  ``StateAttribute`` the optimizer's ``state`` is), leave every parameter without state, as ``del opt.state[p]``
  leaves one: a load of a whole state (state_dicts.reset_state: one pass over the chunks), so a broken optimizer
  is whole after it, and the dicts handed out before are forgotten, as at any load. Assigning anything else is
  refused by name: the steps would go on with the state in the tiers, whatever the attribute held.
- Iterating yields nothing and ``len`` is 0 (``bool`` says whether any parameter has state): frameworks walk
  ``optimizer.state`` to move every tensor to a device (Lightning does at the start and end of ``fit``), which
  would pull the whole state into memory.

Call order: the optimizer builds one, for all its layouts, kept as its ``_state_view`` (``StateAttribute``);
``flush()`` under its lock before anything reads, saves or steps the state; ``stepped()`` after each step that
ran; ``forget()`` at each load; ``moved(source)`` after a layout that moved tensors.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from .shards import is_sharded
from .state_chunks import StateChunks
from .state_dicts import load_param_state, read_param_state, reset_state

__all__ = ["LazyState", "StateAttribute"]

KEYS = ("step", "exp_avg", "exp_avg_sq", "master")  # what a parameter's state holds: the entries looked at
_GONE = object()  # an entry deleted from a dict handed out


def _counters(t: Any) -> tuple[int, ...]:
    """The version counters that move when ``t`` is written in place: a DTensor's own and its local tensor's
    (written through ``to_local()``)."""
    if not isinstance(t, torch.Tensor):
        return ()
    return (t._version, t._local_tensor._version) if is_sharded(t) else (t._version,)


def _same(a: Any, b: Any) -> bool:
    """Whether ``a`` put in place of ``b`` changes nothing (torch's ZeroRedundancyOptimizer puts each ``step``
    back as ``step.cpu()``, the same tensor on the CPU). DTensors are never compared: that would be a collective."""
    if a is b:
        return True
    tensors = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and not (is_sharded(a) or is_sharded(b))
    return tensors and (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device) and torch.equal(a, b)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (a copy between two sharded alike is the copy of theirs), else ``t``."""
    return t._local_tensor if is_sharded(t) else t


def _refs(obj: object) -> int:
    return sys.getrefcount(obj)


# The references a call _refs(x[k]) or _refs(x.a) itself adds: measured, as CPython versions count the argument
# differently. Callers pass the object as such an expression, never a local name (which would add one).
_holder = [object()]
_CALL = _refs(_holder[0]) - 1
del _holder


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # private: a torch without it keeps dicts to the step


def _uses(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s memory (a DTensor's: its local tensor's): a view, ``detach()``, ``.data``
    or ``to_local()`` kept of it is one more, which its own reference count does not show."""
    return _USE_COUNT(_local(t).untyped_storage()._cdata) if _USE_COUNT is not None else 0


def _base_refs(t: torch.Tensor) -> int:
    """References to the tensor ``t`` is a view of (the copies handed out are views of their files' mappings): one
    kept by the user, which neither ``t``'s count nor its memory's uses show, is one more than at the hand-out."""
    base = _local(t)._base
    return 0 if base is None else _refs(base) - _CALL


def _held_elsewhere(h: _Handed) -> bool:
    """Whether anything but ``h`` may still write to its dict or tensors: the dict or a tensor referred to from
    elsewhere, or its memory shared with a tensor made since (``_uses``); an entry replaced by the user's own
    tensor is taken as held. CPython's reference counts (which torch needs) say this exactly, but they are an
    implementation detail: hence this one place, whose misreading in the other direction keeps a copy too long."""
    if _USE_COUNT is None or _refs(h.out) - _CALL > 1:  # h.out
        return True
    for key in KEYS:
        if not isinstance(h.out.get(key), torch.Tensor):
            continue
        if key not in h.first or h.first[key][0] is not h.out[key] or _uses(h.out[key]) > h.first[key][1]:
            return True
        if _base_refs(h.out[key]) > h.first[key][2]:  # its base kept: a view's writes are the base's
            return True
        held = (h.out.values(), (v for v, _ in h.given.values()), (f[0] for f in h.first.values()))
        ours = sum(v is h.out[key] for values in held for v in values)
        del held
        if _refs(h.out[key]) - _CALL > ours:
            return True
        if is_sharded(h.out[key]) and _refs(h.out[key]._local_tensor) - _CALL > 1:  # the DTensor's
            return True
    return False


def _stepped(state: StateChunks, i: int) -> bool:
    """Whether parameter ``i`` has state (one of a group appended but not yet laid out has none)."""
    return i < len(state.steps) and state.steps[i] > 0


class _Handed:
    """One dict ``opt.state[p]`` handed out: parameter ``index``'s, and per entry the value it held when last
    looked at and that value's version counters then, and the value handed out."""

    __slots__ = ("index", "out", "given", "first")

    def __init__(self, index: int, out: dict[str, Any]):
        self.index, self.out = index, out
        self.given: dict[str, tuple[Any, tuple[int, ...]]] = {}
        self.looked()
        # The tensors handed out, and how many tensors shared each one's memory then (_held_elsewhere).
        self.first = {k: (v, _uses(v), _base_refs(v)) for k, v in out.items()
                      if k in KEYS and isinstance(v, torch.Tensor)}  # fmt: skip

    def looked(self) -> None:
        """What the dict holds now is the state (it was just handed out, or taken in)."""
        self.given = {k: (v, _counters(v)) for k, v in self.out.items() if k in KEYS}

    @torch.no_grad()
    def again(self, now: dict[str, Any]) -> dict[str, Any]:
        """Handed out again, the state as ``now`` (a fresh read) has it: copied into the tensors handed out that are
        still its entries, so every handle on them sees it, as on torch's live tensors (a master moves with a write
        to its parameter, 8-bit moments hold what their codes do); an entry the user put in stays, as loaded. The
        dict holds nothing unloaded here: ``flush`` has just run."""
        for key, value in now.items():
            held, first = self.out.get(key, _GONE), self.first.get(key)
            if held is _GONE:  # deleted (what a load without it made is the state now): the fresh one
                self.out[key] = value
                self.first[key] = (value, _uses(value), _base_refs(value))
            elif first is not None and first[0] is held and _local(held).shape == _local(value).shape:
                _local(held).copy_(_local(value))
        self.looked()
        return self.out

    def changes(self) -> dict[str, Any]:
        """The entries written since: key -> the value now (``_GONE`` where deleted)."""
        out: dict[str, Any] = {}
        for key in KEYS:
            now = self.out.get(key, _GONE)
            if key not in self.given:
                if now is not _GONE:
                    out[key] = now
                continue
            was, counters = self.given[key]
            if now is _GONE or (now is was and _counters(now) != counters) or not _same(now, was):
                out[key] = now
        return out


class LazyState(MutableMapping):
    """``opt.state`` (see the module docstring): ``opt.state[p]`` reads ``p``'s state (``step``, ``exp_avg``,
    ``exp_avg_sq``, and ``master`` for low-precision parameters); ``p in opt.state`` says whether it has any."""

    def __init__(self, usable: Callable[[], AbstractContextManager[StateChunks]], current: Callable[[], StateChunks],
                 loading: Callable[[], AbstractContextManager[StateChunks]],
                 whole: Callable[[str], AbstractContextManager[object]]):  # fmt: skip
        """``usable()``: the optimizer's state, held still and checked usable for a block (a layout changed since
        is followed first, so the state is read under the layout of now); ``loading()``: the same for a load of
        one parameter's state (all or nothing, as a load: whole_load.py); ``whole(what)``: a block that loads a
        whole state, named ``what``, as ``load_state_dict`` (a broken optimizer's too); ``current()``: the state as
        it is, for questions a closed or broken optimizer still answers. Bound methods of the optimizer, held
        weakly: its ``state`` must not keep it alive (it closes when collected). Nothing here belongs to one
        layout."""
        self._usable, self._current = weakref.WeakMethod(usable), weakref.WeakMethod(current)  # type: ignore[arg-type]
        self._loading, self._whole = weakref.WeakMethod(loading), weakref.WeakMethod(whole)  # type: ignore[arg-type]
        self._handed: list[_Handed] = []  # the dicts handed out since the last step
        # Tensors handed out before the last step, held weakly: (index, key, the tensor, its counters then).
        self._stale: list[tuple[int, str, weakref.ref, tuple[int, ...]]] = []
        self._flushing = False  # a flush is loading what it found (and comes back through _check_usable)

    def _state(self) -> StateChunks | None:
        current = self._current()
        return None if current is None else current()

    @staticmethod
    def _index(state: StateChunks, p: object) -> int | None:
        if not isinstance(p, torch.Tensor):
            return None
        params = (q for g in state.param_groups for q in g["params"])  # as the user has them (DTensors under FSDP2)
        return next((i for i, q in enumerate(params) if q is p), None)

    def _call(self, method: weakref.WeakMethod, *args: Any) -> AbstractContextManager[StateChunks]:
        fn = method()
        assert fn is not None  # the optimizer is alive: its state was just read
        return fn(*args)

    # ------------------------------------------------------------------------------- read and write
    def __getitem__(self, p: object) -> dict[str, torch.Tensor]:
        state = self._state()
        i = None if state is None else self._index(state, p)
        if state is None or i is None or not _stepped(state, i) and (state.closed or state.broken is not None):
            return {}  # what a closed or broken optimizer still answers
        with self._call(self._usable) as state:  # writes to dicts handed out before are taken in first (flush)
            # Without state: an empty dict, kept too (filled, as torch's would be, it is that parameter's state).
            # Under FSDP2 the local tensors as DTensors, as in state_dict().
            out = state.shards.to_global({i: read_param_state(state, i)})[i] if state.steps[i] else {}
            # One dict a parameter while it is held, as torch's one live dict: two handles on an entry are one.
            kept = next((h for h in self._handed if h.index == i), None)
            if kept is not None:
                return kept.again(out)
            self._handed.append(_Handed(i, out))
            return out

    def __setitem__(self, p: object, value: Any) -> None:
        """A one-parameter load (the module docstring), as ``load_state_dict`` checks an entry."""
        state = self._state()
        i = None if state is None else self._index(state, p)
        if i is None:
            raise ValueError("opt.state[p] = ...: p is not a parameter of this TieredOptimizer, which keeps state "
                             "for its param_groups' parameters alone")  # fmt: skip
        with self._call(self._loading) as state:
            self._handed = [h for h in self._handed if h.index != i]  # they no longer hold p's state (as torch's)
            load_param_state(state, i, value)

    def __delitem__(self, p: object) -> None:
        if p not in self:
            raise KeyError(p)  # as torch's dict: no state to delete
        self[p] = {}

    def clear(self) -> None:
        """Every parameter without state, as torch's ``opt.state.clear()`` leaves it: each starts afresh at its next
        step (MutableMapping's would clear nothing: the iterator is empty). A load of a whole state: the dicts handed
        out before hold none of it, and their writes, before or after, change nothing (as on torch's, let go)."""
        if self._state() is None:
            return  # the optimizer was collected (and closed): its state is gone already
        with self._call(self._whole, "opt.state.clear()"):
            state = self._state()
            assert state is not None  # the optimizer is alive: it holds the block
            reset_state(state)
            self.forget()  # in the block, as a load's: a Ctrl-C held for it is raised as it ends

    def assign(self, value: object) -> None:
        """``opt.state = value`` (``StateAttribute``): an empty mapping is a reset, as ``clear()``; this very
        object changes nothing (torch.optim.swap_in_optimizer_params_and_state puts back what it read); anything
        else is refused by name, before anything changes."""
        if value is self:
            return
        if isinstance(value, Mapping) and not isinstance(value, LazyState) and len(value) == 0:
            self.clear()
            return
        what = "another TieredOptimizer's state" if isinstance(value, LazyState) else type(value).__name__
        raise TypeError(
            f"opt.state = {what}: a TieredOptimizer's state lives in its tiers (host memory and NVMe), not in the "
            "object assigned, which its steps would not use. Load a state with opt.load_state_dict() (a "
            "state_dict()), one parameter's with opt.state[p] = {...}; start every parameter afresh with "
            "opt.state.clear() or opt.state = defaultdict(dict)"
        )

    # torch's state is a defaultdict(dict): get and pop do not make an entry, so they answer as a dict's for a
    # parameter without state (MutableMapping's would read, finding {}, and pop would then raise).
    def get(self, p: object, default: Any = None) -> Any:
        return self[p] if p in self else default

    _NO_DEFAULT = object()

    def pop(self, p: object, default: Any = _NO_DEFAULT) -> Any:
        if p not in self:
            if default is LazyState._NO_DEFAULT:
                raise KeyError(p)
            return default
        out = self[p]
        del self[p]
        return out

    def __contains__(self, p: object) -> bool:
        state = self._state()
        if state is None:
            return False
        # A tensor laid out is found where its state is, also before the layout followed a reorder (groups.placed);
        # another (swapped in, or in a group appended) where it is now.
        i = next((i for i, q in enumerate(state.shards.params) if q is p), None)
        i = self._index(state, p) if i is None else i
        return i is not None and _stepped(state, i)

    # --------------------------------------------------------------------- the dicts handed out
    def flush(self) -> None:
        """Load what was written to the dicts handed out since the last step, and refuse a write to a tensor
        handed out before it; then let go of the dicts nothing else refers to. The optimizer calls it under its
        lock, its state usable."""
        if self._flushing or not (self._handed or self._stale):
            return
        self._check_stale()
        # Keyed by the dict, not its index: the load below follows a reorder first (moved), which moves the index.
        changes = [(h, c) for h in self._handed if (c := h.changes())]
        if changes:
            self._load(changes)
        self._handed = [h for h in self._handed if _held_elsewhere(h)]

    def _load(self, changes: list[tuple[_Handed, dict[str, Any]]]) -> None:
        done: set[int] = set()
        trying = None
        self._flushing = True
        try:
            with self._call(self._loading) as state:
                # Each parameter's place now, read once the layout has followed param_groups (a reorder: moved).
                by_index: dict[int, dict[str, Any]] = {}
                for h, entries in changes:
                    by_index.setdefault(h.index, {}).update(entries)
                for i, entries in by_index.items():
                    trying = i
                    entry: dict[str, Any] = read_param_state(state, i)  # the state now, other dicts' writes in
                    for key, value in entries.items():
                        if value is _GONE:
                            entry.pop(key, None)
                        else:
                            entry[key] = value
                    # A master written moves its weight, as on AdamW over fp32 masters (not a load's "weight wins").
                    load_param_state(state, i, entry, entries.get("master", _GONE) is not _GONE)
                    done.add(i)
        finally:
            self._flushing = False
            # A write that could not be loaded is dropped with its error; those not reached are tried again.
            failed = None if trying in done else trying
            self._handed = [h for h in self._handed if h.index != failed]
            for h in self._handed:
                if h.index in done:
                    h.looked()

    def stepped(self) -> None:
        """A step ran: the copies handed out are stale now. Let them go; watch their tensors weakly."""
        for h in self._handed:
            for key, value in h.out.items():
                if key in KEYS and isinstance(value, torch.Tensor):
                    self._stale.append((h.index, key, weakref.ref(value), _counters(value)))
        self._handed = []

    def forget(self) -> None:
        """A load replaced the state: what was handed out before holds none of it."""
        self._handed, self._stale = [], []

    def moved(self, source: list[int]) -> None:
        """The state was laid out again with its tensors in other places, parameter ``source[j]`` now at ``j``
        (groups.placed): what was handed out stays its parameter's, as torch's dicts are keyed by the tensor."""
        at = {i: j for j, i in enumerate(source)}
        for h in self._handed:
            h.index = at[h.index]
        self._stale = [(at[i], key, ref, counters) for i, key, ref, counters in self._stale]

    def _check_stale(self) -> None:
        alive = []
        for i, key, ref, counters in self._stale:
            t = ref()
            if t is None:
                continue
            if _counters(t) != counters:
                self._stale = [s for s in self._stale if s[2] is not ref]  # said once
                state = self._state()
                name = state.param_names[i] if state is not None else f"parameter {i}"
                raise RuntimeError(
                    f"{key} of {name!r}, read from opt.state[p] before the last step(), was written to after it: "
                    "TieredOptimizer's opt.state[p] is a copy of the state, whose writes are taken in until the next "
                    "step() ends (torch's AdamW hands out the live tensors, which its steps update). The write was "
                    "not applied: read opt.state[p] again after step() and write to that, or assign "
                    "opt.state[p] = {...} (or use load_state_dict())"
                )
            alive.append((i, key, ref, counters))
        self._stale = alive

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


class StateAttribute:
    """``TieredOptimizer.state``: its ``LazyState``, which it keeps as ``_state_view`` for good (every layout's).
    ``opt.state = value`` is ``LazyState.assign`` (torch's AdamW users reset its state so; accelerate's
    ``AcceleratedOptimizer`` passes the assignment through), not a new attribute that the steps, state dicts and
    checkpoints would not read. torch's ``Optimizer.__init__`` assigns ``defaultdict(dict)`` before there is a
    ``LazyState``: that one is let be."""

    def __get__(self, opt: object, owner: type | None = None) -> Any:
        if opt is None:
            return self
        try:
            return opt.__dict__["_state_view"]
        except KeyError:  # inside torch's Optimizer.__init__: no state yet
            raise AttributeError("state") from None

    def __set__(self, opt: object, value: object) -> None:
        view = opt.__dict__.get("_state_view")
        if view is not None:
            view.assign(value)
