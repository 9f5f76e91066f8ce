"""An offloaded model under torch's conversions (``model.to(...)``, ``.half()``, ``.cuda()``: ``nn.Module._apply``),
and the slabs its weights and gradients live in (offload/pinning.py), kept current through them.

A device move (HF Trainer, accelerate's ``prepare`` and Lightning each move the model to the GPU they train on)
leaves the parameters where FSDP2's CPU offload keeps them, in host memory: moving them would put the whole model
on the GPU, the thing offloading is there to avoid (and FSDP2 then refuses to run). Buffers do move, as FSDP2
itself moves them to the compute device. A dtype in the same call (``.to("cuda", torch.bfloat16)``) still casts
the parameters, on the host, as it casts the buffers: the model ends in the dtype asked for, as without offload.

A cast (``.to(torch.bfloat16)``, ``.half()``; Lightning's ``precision="bf16-true"`` casts the model in its setup)
makes FSDP2 give each parameter a new local tensor (``FSDPModule._apply``, ``reset_sharded_param``), outside the
unit's slab, and on CUDA pin each one through torch's pinned allocator, which rounds it up to a power of two; the
old slabs, weights and gradient homes, stayed held for the model's life, unused. So each unit's ``_apply`` runs
with FSDP2's pinning off, and a unit whose weights left its slab has them laid out again as ``offload_model`` laid
them out: a fresh slab of their size, fresh gradient homes (``Slabs.lay_out``); the old slabs are closed.

That is a cast before the first forward. FSDP2 fixes each unit's dtypes at its lazy init (the first forward:
``FSDPParam.init_dtype_attrs``, the all-gather outputs and unsharded parameters made once and reused): after it a
cast ran the next forward in the old dtype or failed on mixed dtypes, and backward failed on the gradients' dtype
(plain ``fully_shard`` alike). Making all of that over (FSDP2's private state, the kept weights' budget in the
old dtype's size) is not something FSDP2 offers, so such a cast is refused, before anything changes.

``model.share_memory()`` (``share_memory_`` on each tensor) is refused too: torch's ``_share_fd_cpu_`` on a weight
carved from a slab (its storage a view of the slab's mapping) killed the process with SIGSEGV.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from io_engine import PinnedSlab

from ..auto_budget import note_offloaded
from ..optim.shards import is_sharded, sharded_like
from .data_writes import DataWrites
from .pinning import fsdp_params, grad_homes, rehome

__all__ = ["Slabs", "keep_on_host"]

_HOST = torch.device("cpu")


class Slabs:
    """Each unit's slab of weights and slab of gradient homes (``model.tiered_slabs``, in the units' order), and
    the homes by ``id(param)``, the dict ``HostAccumulation`` reads (updated in place)."""

    def __init__(self, model: nn.Module, *, pin: bool) -> None:
        self.pin = pin
        self.homes: dict[int, torch.Tensor] = {}
        self._units: dict[int, tuple[PinnedSlab | None, PinnedSlab | None, list[int]]] = {}
        self._model = weakref.ref(model)  # the wrapped _apply holds this: no cycle through the model

    def lay_out(self, unit: nn.Module) -> None:
        """Move the weights ``fully_shard`` made for ``unit`` into a fresh slab of their size and give those that
        train fresh gradient homes; the unit's slabs before (if any) are closed, a gradient it held moved home."""
        old = self._units.get(id(unit))
        weights = rehome(unit, pin=self.pin)
        grads, homes = grad_homes(unit, pin=self.pin)
        self._units[id(unit)] = (weights, grads, list(homes))  # the same place in the order
        model = self._model()
        if old is not None:
            for key in old[2]:
                self.homes.pop(key, None)
            _move_home(unit, homes)
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # no copy still reads the old pages as they are unregistered
            for slab in old[:2]:
                if slab is not None:
                    slab.close()
            if model is not None:  # what the auto budgets count as the offloaded weights
                note_offloaded(model, sum(p.numel() * p.element_size() for p in model.parameters()))
        self.homes.update(homes)
        if model is not None:
            model.tiered_slabs = [s for w, g, _ in self._units.values() for s in (w, g) if s is not None]  # type: ignore[assignment]

    def in_place(self, unit: nn.Module) -> bool:
        """Whether each of ``unit``'s sharded weights still lies in its slab."""
        slab = self._units.get(id(unit), (None,))[0]
        data = [fp._sharded_param_data for fp in fsdp_params(unit) if fp._sharded_param_data.numel()]
        return all(slab is not None and slab.holds(t) for t in data)


def _move_home(unit: nn.Module, homes: dict[int, torch.Tensor]) -> None:
    """A gradient the parameter held at the conversion (set by hand: one from a backward came after a forward,
    and a cast after it is refused) into its new home, where the next backward sums into it."""
    with torch.no_grad():
        for fp in fsdp_params(unit):
            p, home = fp.sharded_param, homes.get(id(fp.sharded_param))
            g = p.grad
            if home is None or g is None:
                continue
            shard = g.to_local() if is_sharded(g) else g
            if shard.shape == home.shape and shard.dtype == home.dtype:
                home.copy_(shard)
                p.grad = sharded_like(home, g) if is_sharded(g) else home


def keep_on_host(units: list[nn.Module], slabs: Slabs, writes: DataWrites) -> None:
    """Wrap each unit's ``_apply`` (the model's, and a block's converted alone): a device move leaves the
    parameters on the host, casting them to the dtype asked for there, and a conversion that gives them new
    tensors lays the unit out again in fresh slabs. ``writes``: a ``p.data = t`` before it is taken first (and
    so converted, as without offload), the wrappers the conversion makes taken as made."""
    for unit in units:
        _wrap(unit, slabs, writes)


def _wrap(unit: nn.Module, slabs: Slabs, writes: DataWrites) -> None:
    original = unit._apply

    def _apply(fn: Any, recurse: bool = True) -> nn.Module:
        probe = fn(torch.empty(0))  # where (and as what) the conversion puts a tensor: no memory is moved
        on_host = not isinstance(probe, torch.Tensor) or probe.device == _HOST
        if on_host and isinstance(probe, torch.Tensor) and probe.is_shared():  # CUDA tensors all say shared
            raise TypeError(_SHARED.format(name=type(unit).__name__))
        cast = _dtype_part(fn, unit) if isinstance(probe, torch.Tensor) else None
        if cast is not None:
            _refuse_after_first_forward(unit, fn)
        if on_host:
            return _laid_out(unit, slabs, writes, lambda: original(fn, recurse))
        if cast is not None:  # recursing: each block below lays itself out
            _laid_out(unit, slabs, writes, lambda: original(cast, recurse))
        for module in unit.modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = fn(buf)
        return unit

    unit._apply = _apply  # type: ignore[method-assign]


_SHARED = (
    "{name}.share_memory() (or share_memory_ through _apply) on a model offload_model offloaded: its weights are "
    "carved from offload_model's slabs (host memory mapped for this process, page-locked on CUDA), which torch "
    "cannot move into shared memory (it crashes the process). Nothing was changed. Share a model without "
    "offload, or call offload_model in each process."
)
_LATE_CAST = (
    "{name}: a dtype cast ({old} -> {new}) of a model offload_model offloaded, after its first forward. FSDP2 "
    "fixes each unit's dtypes at its first forward (its gathered weights, unsharded parameters, gradient dtype) "
    "and keeps them: the next forward would run in {old} or fail on mixed dtypes (plain fully_shard does the "
    "same). Nothing was changed: the model is still {old}. Cast before the first forward, e.g. before the "
    "framework's fit/train (Lightning's precision='bf16-true' casts in its setup, in time), or before "
    "offload_model. HF Trainer's bf16_full_eval/fp16_full_eval cast at an evaluate() after train(): leave them "
    "off for an offloaded model (evaluate in the dtype it trained in)."
)


def _refuse_after_first_forward(unit: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """A cast once FSDP2 has lazily initialised ``unit`` or a unit in it (at the first forward, its own or the
    root's: ``FSDPState._is_root`` set): refused before anything changes, the model usable in its dtype."""
    units = [m for m in unit.modules() if hasattr(m, "_get_fsdp_state")]
    if all(m._get_fsdp_state()._is_root is None for m in units):  # type: ignore[operator]
        return
    old = next(p.dtype for p in unit.parameters() if fn(torch.empty(0, dtype=p.dtype)).dtype != p.dtype)
    new = fn(torch.empty(0, dtype=old)).dtype
    raise TypeError(_LATE_CAST.format(name=type(unit).__name__, old=old, new=new))


def _dtype_part(fn: Callable[[torch.Tensor], torch.Tensor], unit: nn.Module) -> Callable[[Any], Any] | None:
    """The conversion's cast alone, to run on the host (None: it changes no parameter's dtype). Each parameter
    dtype is probed on an empty tensor, as ``.to(device, dtype)`` casts floating tensors only."""
    targets = {dt: fn(torch.empty(0, dtype=dt)).dtype for dt in {p.dtype for p in unit.parameters()}}
    if all(dt == target for dt, target in targets.items()):
        return None
    return lambda t: t.to(targets[t.dtype]) if isinstance(t, torch.Tensor) and t.dtype in targets else t


def _laid_out(unit: nn.Module, slabs: Slabs, writes: DataWrites, run: Callable[[], Any]) -> Any:
    """``run()`` (the unit's conversion) with FSDP2's pinning of new tensors off, then the unit laid out again in
    fresh slabs where its weights left theirs (pinned there, a slab a unit, where they were). A ``p.data = t``
    before it is taken first; the wrappers after it (torch swaps new ones in) are taken as made."""
    within = writes.units(unit)
    writes.take(within)
    params = fsdp_params(unit)
    pinned = [fp.pin_memory for fp in params]
    for fp in params:
        fp.pin_memory = False  # reset_sharded_param would pin each new tensor through torch's rounding allocator
    try:
        out = run()
    finally:
        for fp, was in zip(params, pinned):
            fp.pin_memory = was
    if not slabs.in_place(unit):
        slabs.lay_out(unit)
    writes.record(within)
    return out
