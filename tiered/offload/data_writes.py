"""``param.data = tensor`` on an offloaded model's parameters: taken into the host shard, or refused by name.

FSDP2's parameter is a DTensor: a wrapper (a tensor with no storage of its own: ``data_ptr()`` is 0) around its
local tensor, the shard in host memory (in its slab: offload/pinning.py) that FSDP2 copies up for each forward and
the optimizer updates. ``p.data = t`` is torch's ``set_data``: it gives the wrapper ``t``'s storage, shape and dtype
and leaves the local tensor as it was, so training went on with the old weights, silently (plain ``fully_shard``
alike), where the model without offload keeps the write (README, "What users rely on"). torch has no hook on the
assignment, so each wrapper is looked at before its values are next read: before each forward of the model (a
pre-hook ahead of FSDP2's), before the step of any optimizer over its parameters (offload/__init__.py's step
pre-hook), before a ``state_dict`` or ``load_state_dict`` of the model or of a module in it, before a conversion
(``model.to``), and as the call of a TieredOptimizer over its parameters begins (its saves and loads:
offload/__init__.py's ``take_writes``).
A wrapper whose storage is no longer the one it was made with (a pointer compared, a parameter a look) was
assigned to:

- A plain tensor of the parameter's shape and dtype, at world size 1 (where the local tensor is the whole
  parameter): its values are copied into the local tensor, where it lies (the weights stay in their page-locked
  slab), and an unsharded copy FSDP2 may still hold of the unit is dropped, so the next forward and the step see
  exactly them: bitwise the run without offload given the same write. The tensor is copied, not adopted (without
  offload the parameter would be that tensor): later writes into it do not reach the parameter. A tensor that
  shares the local tensor (``model.state_dict()`` not cloned, ``p.to_local()``) reads the values taken, where without
  offload it keeps the old tensor's (docs/offload.md, "Writes into the weights").
- A wrapper the parameter had before (``backup = p.data`` shares it, and the local tensor): the values that
  wrapper stood for are copied back, as the model without offload gets its old tensor back. Each wrapper a tensor
  of the user's still holds stands for the parameter's values as they were while it was the parameter's: for the
  current values until a take overwrites them, then for a copy of them made at that take. However swaps chain (two
  in a row, the swap back of the first not yet taken; two shadows, then the swap back), each ``p.data = backup``
  finds its values. Copies are kept while such a tensor lives and until the next step of an optimizer over the
  model's parameters (``forget_before``: the step updates the current values, not the copies); a wrapper standing
  for the current values follows them across steps, as ``backup`` follows the parameter's tensor without offload.
- Anything else cannot be taken: a DTensor (``p.detach().clone()`` of an offloaded parameter is one), of which
  ``set_data`` keeps the wrapper's shape but not the values; another shape or dtype (FSDP2's shard and the
  optimizer's layout are fixed); a parameter sharded over several ranks (the tensor is the whole parameter, the
  local tensor a shard). It is refused with a ``RuntimeError`` naming the parameter and the way round, an
  in-place write (``p.to_local().copy_(t)``, ``p.copy_(d)``).

Either way the wrapper is then made as it was (no storage of its own, the parameter's shape and dtype), so a model
refused stays usable, the refused parameter with its values from before the assignment. Until the assignment is
taken the parameter still reads its old values, and an in-place op on it changes those, which the assigned tensor
then replaces (docs/offload.md, "Writes into the weights").
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .pinning import fsdp_params

__all__ = ["DataWrites"]


class DataWrites:
    """The storage each offloaded parameter's wrapper was made with, and ``take`` (``model.tiered_data_writes``)."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)  # the model's hooks hold this: no cycle through the model
        # id(FSDPParam) -> (id of its parameter, the storage of that parameter's wrapper). Not a weak reference to
        # the parameter: torch's swap_tensors (a cast) refuses a tensor that has one.
        self._made: dict[int, tuple[int, Any]] = {}
        # id(FSDPParam) -> {address of a wrapper's storage the parameter had, which a tensor of the user's still
        # holds (``backup = p.data``: a DTensor on the parameter's own local tensor): (that storage, the local values
        # it stands for, None where those are the local tensor's now)}: ``p.data = backup`` is a restore of them.
        self._aliases: dict[int, dict[int, tuple[Any, torch.Tensor | None]]] = {}
        self._units: list[weakref.ref[nn.Module]] = []  # the model's units, as record() last found them
        self.record()

    def units(self, under: nn.Module | None = None) -> list[nn.Module]:
        """The FSDP units in ``under`` (default: the whole model), itself included."""
        from torch.distributed.fsdp import FSDPModule

        top = under if under is not None else self._model()
        return [] if top is None else [m for m in top.modules() if isinstance(m, FSDPModule)]

    def _all_units(self) -> list[nn.Module]:
        """The model's units, as the last whole ``record()`` found them: not the walk over every module of the
        model at each forward (taken by weak reference: the model holds this)."""
        return [u for u in (ref() for ref in self._units) if u is not None]

    def record(self, units: Iterable[nn.Module] | None = None) -> None:
        """Take each parameter's wrapper as it is now as made (after ``fully_shard``, after a conversion)."""
        if units is None:
            units = self.units()
            self._units = [weakref.ref(u) for u in units]
        for unit in units:
            for fp in fsdp_params(unit):
                self._note(fp)
                self._aliases.pop(id(fp), None)  # a conversion: values of another dtype, another wrapper

    def holds(self, ids: set[int]) -> bool:
        """Whether one of the model's parameters has its id in ``ids`` (an optimizer's: the models it steps or
        saves), by the units recorded (no walk over the model's modules)."""
        return any(id(fp.sharded_param) in ids for unit in self._all_units() for fp in fsdp_params(unit))

    def forget_before(self) -> None:
        """Drop the values copied for a ``p.data = backup`` (a step: the weights are the step's from then on); a
        wrapper standing for the current values goes on standing for them, the step's."""
        for aliases in self._aliases.values():
            for key, (storage, values) in list(aliases.items()):
                if values is not None or not _held(storage):
                    del aliases[key]

    def _note(self, fp: Any) -> None:
        p = fp.sharded_param
        self._made[id(fp)] = (id(p), p.untyped_storage())  # held: its address is never another storage's

    def take(self, units: Iterable[nn.Module] | None = None) -> None:
        """Copy each plain tensor assigned through ``.data`` since the last look into its parameter's local
        tensor, and refuse any other assignment by name (``RuntimeError``, after every wrapper looked at is made
        as it was)."""
        refused: list[tuple[Any, str, bool]] = []
        for unit in self._all_units() if units is None else units:
            wrote = False
            for fp in fsdp_params(unit):
                p = fp.sharded_param
                made = self._made.get(id(fp))
                if made is None or made[0] != id(p):  # a parameter FSDP2 made anew (load_state_dict(assign=True))
                    self._note(fp)
                    self._aliases.pop(id(fp), None)  # the old parameter's wrappers: not this one's values
                    continue
                if p.untyped_storage()._cdata == made[1]._cdata:  # untouched: the common case, a pointer compared
                    continue
                aliases = self._aliases.setdefault(id(fp), {})
                now = p.untyped_storage()._cdata
                if now in aliases:  # p.data = backup
                    storage, values = aliases[now]
                    self._keep(fp, made[1], aliases, overwritten=values is not None)
                    if values is not None:  # else the values it stands for are the local tensor's already
                        with torch.no_grad():
                            p._local_tensor.copy_(values)
                        wrote = True
                    aliases[now] = (storage, None)
                elif (why := _why_not(p)) is None:
                    src = torch.empty(0, dtype=p.dtype, device=p.device).set_(
                        p.untyped_storage(), p.storage_offset(), p.size(), p.stride()
                    )  # the tensor assigned, as the wrapper now holds it
                    local = p._local_tensor
                    if src.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
                        src = src.clone()  # a view of the shard itself: copied out first
                    self._keep(fp, made[1], aliases, overwritten=True)
                    with torch.no_grad():
                        local.copy_(src)
                    wrote = True
                else:
                    refused.append((fp, why, p.device_mesh.size() > 1))
                    self._keep(fp, made[1], aliases, overwritten=False)
                self._restore(fp)
                for key, (storage, _) in list(aliases.items()):
                    if not _held(storage):  # no tensor of the user's holds that wrapper any more
                        del aliases[key]
            if wrote:
                unit.reshard()  # type: ignore[operator]  # an unsharded copy of the old weights, if any, dropped
        if refused:
            raise RuntimeError(self._refusal(refused))

    def _keep(self, fp: Any, made: Any, aliases: dict[int, tuple[Any, torch.Tensor | None]], overwritten: bool) -> None:
        """Before the local tensor is overwritten (or, ``overwritten`` False, only the wrapper made anew): each
        wrapper standing for its values as they are now that a tensor of the user's holds (the wrapper as last made,
        and those restored) stands from then on for a copy of them (for them, as now, where not overwritten)."""
        values = None
        current = [made] + [storage for storage, kept in aliases.values() if kept is None]
        for storage in current:
            if storage._cdata != fp.sharded_param.untyped_storage()._cdata and _held(storage):
                if overwritten and values is None:
                    values = fp.sharded_param._local_tensor.clone()  # one copy for every such wrapper
                aliases[storage._cdata] = (storage, values if overwritten else None)

    def _restore(self, fp: Any) -> None:
        """The wrapper as FSDP2 made it: no storage of its own, the parameter's shape, strides and dtype."""
        from torch.distributed.tensor import DTensor

        p = fp.sharded_param
        with torch.inference_mode(False):  # under an evaluation's inference_mode: not marked an inference tensor
            p.data = DTensor(p._local_tensor, p._spec, requires_grad=False)  # type: ignore[call-arg]
        self._note(fp)

    def _refusal(self, refused: list[tuple[Any, str, bool]]) -> str:
        model = self._model()
        names = {id(m): n for n, m in model.named_modules()} if model is not None else {}

        def name(fp: Any) -> str:
            prefix = names.get(id(fp._module_info.module), "")
            return f"{prefix}.{fp._module_info.param_name}" if prefix else fp._module_info.param_name

        fp, why, ranks = refused[0]
        more = [name(other) for other, _, _ in refused[1:]]
        also = f" The same for {more[:8]}." if more else ""
        return _REFUSED.format(name=name(fp), why=why, way=_OVER_RANKS if ranks else _ONE_RANK) + also


def _held(storage: Any) -> bool:
    """Whether a tensor holds ``storage`` (the Python object this module keeps of it, however often it is referred
    to, is one use of it)."""
    return torch._C._storage_Use_Count(storage._cdata) > 1


def _why_not(p: Any) -> str | None:
    """Why the tensor a parameter's wrapper now holds cannot be taken into its local tensor (None: it can)."""
    shape, dtype, ranks = tuple(p._spec.shape), p._local_tensor.dtype, p.device_mesh.size()
    if p.data_ptr() == 0 and p.numel():
        return ("with no values of its own (a DTensor, as p.detach().clone() of an offloaded parameter is: torch's "
                "set_data keeps its wrapper's shape, not its values)")  # fmt: skip
    if tuple(p.shape) != shape:
        return f"of shape {list(p.shape)}, the parameter's being {list(shape)}"
    if p.dtype != dtype:
        return (f"of dtype {p.dtype}, the parameter's being {dtype} (cast the tensor first, or the model before its "
                "first forward)")  # fmt: skip
    if ranks > 1:
        return f"while the parameter is sharded over {ranks} ranks (each holds a shard, not the whole tensor)"
    return None


_REFUSED = (
    "tiered: the offloaded model's parameter {name!r} was assigned through .data a tensor {why}: that cannot be "
    "taken into the parameter, whose values are its local tensor in host memory (FSDP2's DTensor: .data = replaces "
    "only its wrapper), so nothing of it was taken and the parameter keeps its values from before the assignment. "
    "Write them in place instead: {way} (docs/offload.md, 'Writes into the weights')."
)
_ONE_RANK = ("with torch.no_grad(): p.to_local().copy_(t) (at world size 1 the local tensor is the whole parameter), "
             "or p.copy_(d) for a DTensor d made from the parameter")  # fmt: skip
_OVER_RANKS = ("with torch.no_grad(): p.copy_(distribute_tensor(t, p.device_mesh, p.placements)) on every rank "
               "(torch.distributed.tensor), or p.copy_(d) for a DTensor d made from the parameter")  # fmt: skip
