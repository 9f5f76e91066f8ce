"""Parameters and gradients off the GPU: FSDP2's CPU offload carries them, ``TieredOptimizer`` keeps the state.

``offload_model(model)`` is applied before ``TieredOptimizer(model, ...)``, as ``fully_shard`` is. It shards
each repeated block (HF ``_no_split_modules``, or ``blocks=``) and then the root with
``fully_shard(..., offload_policy=CPUOffloadPolicy())``: the weights live in host memory (page-locked in slabs
of their exact size, offload/pinning.py), FSDP2
copies one block's weights to the GPU ahead of its forward and again for backward's recompute (at world size 1
the next block's while the one before it computes: offload/prefetch.py), and each
block's gradients go to the host as backward makes them; across micro-batches they are summed on a worker
thread, not on backward's (offload/accumulation.py). The optimizer then sees CPU shards with CPU
gradients and updates them on the host, its state in its DDR/NVMe tiers.

Without a process group it makes a one-rank one (offload/process_group.py), which ``close()`` (or the end of
the program; not a forked child's) destroys; under an initialized one of any size it shards over that world (or
the ``mesh`` given). At world size 1 FSDP2 copies the
gradients without reducing them, so the weights after N steps are bitwise those of plain FSDP2 on the same blocks,
and of the run without FSDP2 where no tensor that needs a gradient feeds more than one block (decoder-only models:
tests/unit/offload/test_offload_params.py). Where one does (encoder-decoder models: the encoder's output feeds
every decoder block), FSDP2's hooks on each block's inputs sum its gradient in another order: to rounding
(tests/unit/offload/test_offload_models.py; docs/offload.md, "Exactness").

Inside HF ``Trainer``, accelerate and Lightning (tests/acceptance/test_offload_frameworks.py): the model's
``.to(device)`` leaves the parameters on the host (each framework moves the model to its GPU; a dtype cast lays them out
again there: offload/conversions.py), and at world size 1 its
``state_dict()`` (a submodule's too) holds plain tensors and ``load_state_dict`` takes them: the frameworks'
checkpoints are those of a model without offload. ``plain_tensors`` does it for an optimizer's (Lightning needs it;
offload/state_dicts.py).

``needs_offload(model, gpu_budget)`` says whether a model needs it: its weights and gradients against the
GPU budget (what ``enabled="auto"`` decides on).
"""

from __future__ import annotations

import logging
import numbers
import os
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from io_engine import format_size, parse_size

from ..auto_budget import note_offloaded, resolve_gpu_budget
from ..shares import GPU_SHARE, KEEP_SHARE
from .accumulation import HostAccumulation
from .blocks import find_blocks
from .conversions import Slabs, keep_on_host
from .data_writes import DataWrites
from .inference import unshard_outside_inference_mode
from .kept_weights import KeptWeights
from .one_forward import one_forward_at_a_time
from .prefetch import WeightPrefetch
from .process_group import close, group_for
from .root_calls import refuse_root_calls_outside
from .state_dicts import holders, plain_state_dicts, plain_tensors

__all__ = [
    "GPU_SHARE",
    "KEEP_SHARE",
    "OffloadInfo",
    "offload_model",
    "close",
    "needs_offload",
    "keeps_for_backward",
    "find_blocks",
    "plain_tensors",
    "reshard",
]

_log = logging.getLogger("tiered")
_offloaded: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # every offloaded model alive
_step_hook: list[Any] = []  # the optimizer step pre-hook that serves them
_replaced: dict[int, weakref.ref[torch.Tensor]] = {}  # parameters fully_shard replaced, by id, while alive


@dataclass(frozen=True)
class OffloadInfo:
    """What ``offload_model`` did: set on the model as ``model.tiered_offload``."""

    offloaded: bool
    blocks: int
    block_class: str
    device: str
    world_size: int
    made_process_group: bool
    param_bytes: int
    reason: str
    kept_for_backward: bool = False


def _param_bytes(model: nn.Module, param_dtype: torch.dtype | None = None) -> int:
    """The model's weights in bytes, in ``param_dtype`` where given, else in their own dtypes."""
    size = param_dtype.itemsize if param_dtype is not None else None
    return sum(p.numel() * (size or p.element_size()) for p in model.parameters())


# GPU_SHARE: the share of the GPU budget a model's weights and gradients may take and stay there. On a 24 GB
# cap it keeps a 3.4B bf16 Llama (13.7 GB) on the GPU, which trained there, and offloads a 4.4B one (17.7 GB),
# which ran out of memory there.


def needs_offload(model: nn.Module, gpu_budget: int, *, param_dtype: torch.dtype | None = None) -> bool:
    """Whether the model's weights and gradients (in ``param_dtype``, else their own dtype) take more than
    ``GPU_SHARE`` of ``gpu_budget`` bytes: then training cannot keep them on the GPU."""
    return 2 * _param_bytes(model, param_dtype) > GPU_SHARE * gpu_budget


def keeps_for_backward(model: nn.Module, gpu_budget: int, *, param_dtype: torch.dtype | None = None) -> bool:
    """Whether an offloaded model's weights (in ``param_dtype``, else their own dtype) take at most
    ``KEEP_SHARE`` of ``gpu_budget`` bytes: what ``keep_for_backward="auto"`` decides on."""
    return 0 < gpu_budget and _param_bytes(model, param_dtype) <= KEEP_SHARE * gpu_budget


def reshard(model: nn.Module) -> None:
    """Drop every unsharded copy of ``model``'s weights that a forward left on its device, so that its parameters
    are the host shards again: what the optimizer updates, ``state_dict`` reads and ``load_state_dict`` writes.

    A backward reshards what its forward gathered; a forward without one leaves the root unit (embeddings, final
    norm, head: FSDP2 keeps the root's weights from forward to backward) and, with ``keep_for_backward``, the
    blocks kept. The parameters the model then shows are those copies, not the shards: a step would update
    the shards and the next forward would run on the stale copies; an optimizer built then would hold the
    copies. So the model reshards itself after any forward run without grad (an evaluation, ``generate``),
    before any optimizer's step (a forward with grad whose loss was never used), and before a ``state_dict``
    or ``load_state_dict`` of it or of a module inside it (what that reads or writes)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _reshard_offloaded(optimizer: Any, *_: Any) -> None:
    """Before any optimizer's step: refuse one over parameters ``offload_model`` replaced, end a backward that
    raised part-way in each offloaded model the optimizer steps (its gradients not yet reduced summed in, as plain
    ``.grad`` holds them: offload/failed_pass.py), ``reshard`` each offloaded model alive (a no-op where
    backward did), take the ``.data`` writes of each the optimizer steps, and refuse a step over an offloaded
    parameter with a gradient hook, which never ran."""
    params = _params_of(optimizer)
    stepped = _models_holding(params)
    if _replaced:
        for p in params:
            ref = _replaced.get(id(p))
            if ref is not None and ref() is p:
                raise RuntimeError(f"{type(optimizer).__name__} was built over a model's parameters before "
                                   "offload_model(model) replaced them (FSDP2 makes new ones): it would train "
                                   "nothing, as no gradient reaches the old ones. Build the optimizer after "
                                   "offload_model")  # fmt: skip
    for model in list(_offloaded):
        summing = cast(HostAccumulation, model.tiered_accumulation)
        summing.keep_failed_pass(params)  # a parent's model this steps, in a forked child: refused by name
        if summing.here:  # the others in a forked child are the parent's: not this step's to touch
            reshard(model)
        if summing.here and model in stepped:  # another model's swap (backup = p.data) may span this step
            writes = cast(DataWrites, model.tiered_data_writes)
            writes.take()  # a `p.data = t` since: the step updates t
            writes.forget_before()  # a `p.data = backup` after the step is no restore of values from before it
    hooked = [p for p in params if getattr(p, "_backward_hooks", None)]  # a dict per hooked tensor: cheap to look
    if hooked:
        ids = {id(p) for p in hooked}
        names = [n for model in list(_offloaded) for n, p in model.named_parameters() if id(p) in ids]
        if names:
            raise RuntimeError(f"tiered: the offloaded model's parameters {names[:8]} carry gradient hooks "
                               f"(Tensor.register_hook), which never ran: {_HOOKS_NEVER_RUN}, so this step would "
                               "apply gradients those hooks never saw. Remove them (handle.remove()) and use "
                               f"{_HOOKS_INSTEAD}")  # fmt: skip


_HOOKS_NEVER_RUN = ("FSDP2 runs forward and backward on unsharded copies of the weights, never on the parameters "
                    "the model shows")  # fmt: skip
_HOOKS_INSTEAD = ("p.register_post_accumulate_grad_hook(fn) on the offloaded model's parameters (it runs once p.grad "
                  "holds the gradient, and may change it in place: p.grad.clamp_(...)) or a module's "
                  "register_full_backward_hook (docs/offload.md)")  # fmt: skip


def take_writes(optimizer: Any) -> None:
    """Take a ``p.data = t`` since the last look into each offloaded model alive here holding the optimizer's
    parameters (``DataWrites.take``; another model's assignment is that model's to take or refuse): what a
    TieredOptimizer runs before it saves, exports or loads the weights, so its ``save_checkpoint`` and
    ``state_dict`` hold ``t`` and its loads overwrite ``t`` (not ``t`` copied over them at the next forward), as
    without offload. A forked child's other models are the parent's, not this call's to touch."""
    for model in _models_holding(_params_of(optimizer)) if _offloaded else ():
        if cast(HostAccumulation, model.tiered_accumulation).here:
            cast(DataWrites, model.tiered_data_writes).take()


def _params_of(optimizer: Any) -> list[Any]:
    return [p for group in getattr(optimizer, "param_groups", ()) for p in group["params"]]


def _models_holding(params: Iterable[Any]) -> list[nn.Module]:
    """The offloaded models alive here holding one of ``params`` (an optimizer's): those it steps and saves."""
    ids = {id(p) for p in params}
    return [m for m in list(_offloaded) if cast(DataWrites, m.tiered_data_writes).holds(ids)]


def _note_replaced(before: Sequence[weakref.ref[nn.Parameter]], model: nn.Module) -> None:
    """Remember the parameters ``fully_shard`` replaced that are still alive (held by the caller: an optimizer
    built before ``offload_model``), for ``_reshard_offloaded``'s check."""
    now = {id(p) for p in model.parameters()}
    for ref in before:
        p = ref()
        if p is not None and id(p) not in now:
            _replaced[id(p)] = weakref.ref(p, _forget_replaced(id(p)))


def _forget_replaced(key: int) -> Callable[[Any], None]:
    def forget(_: Any) -> None:  # the parameter died: its id may name another tensor next
        _replaced.pop(key, None)

    return forget


def _reshard_when_read(model: nn.Module) -> None:
    """``reshard`` after a forward run without grad, and before a ``state_dict`` or ``load_state_dict`` of the
    model or of any module in it reads or writes a parameter (its unit, from ``_holders``; registered first, so
    that the other hooks see the shards). In a forked child both refuse: the weights are the parent's host memory
    (slabs, shared with the child: io_engine/slab.py), which a load writes, and a read too where a ``.data``
    assignment of the parent's is copied in first (``writes.take``). A state dict the parent took may be saved
    by a child."""
    made_in = os.getpid()

    def after_forward(module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():  # no_grad and inference_mode: no backward will reshard
            reshard(module)

    model.register_forward_hook(after_forward)
    writes = cast(DataWrites, model.tiered_data_writes)  # a `p.data = t` before: what is read, what a load overwrites

    def read(unit: nn.Module) -> None:
        if os.getpid() != made_in:
            raise RuntimeError(f"this offloaded model was made in process {made_in}, before a fork: its weights are "
                               "that process's host memory, shared with this child, which a load here (or a read, "
                               "copying in a .data assignment of the parent's) would write, so its state dict is "
                               "neither read nor loaded here. Take the state dict in the parent (a forked child may "
                               "save that one), or offload the model in the child")  # fmt: skip
        unit.reshard()  # type: ignore[operator]
        writes.take([unit])

    for module, unit in holders(model).items():
        module.register_state_dict_pre_hook(lambda *_, unit=unit: read(unit))
        module.register_load_state_dict_pre_hook(lambda *_, unit=unit: read(unit))
    if not _step_hook:  # global, once a process; a loop over the models alive
        _step_hook.append(register_optimizer_step_pre_hook(_reshard_offloaded))
    _offloaded.add(model)


def offload_model(
    model: nn.Module,
    *,
    blocks: Iterable[nn.Module] | Iterable[str] | str | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    mesh: Any = None,
    pin_memory: bool | None = None,
    enabled: bool | str = True,
    gpu_budget: int | str = "auto",
    keep_for_backward: bool | str | int = "auto",
) -> nn.Module:
    """Keep ``model``'s parameters and gradients in host memory, streamed to ``device`` one block at a time.

    ``device``: where forward and backward run (default CUDA where there is one, else the CPU, where this
    is a stand-in that runs the same code). ``param_dtype``/``reduce_dtype``: FSDP2's
    ``MixedPrecisionPolicy`` (default: compute in the parameters' dtype; a bf16 model keeps bf16 weights
    and gradients on the host, 4 bytes a parameter, and the optimizer its fp32 masters). ``pin_memory``:
    page-locked host copies (default: on for CUDA). ``enabled="auto"`` offloads only when the weights and
    gradients take more than ``GPU_SHARE`` of ``gpu_budget`` (``"auto"``: the GPU's memory under the
    process's cap, tiered.auto_budget.gpu_limit); the model is returned as it was otherwise. The decision
    is logged once, and kept as ``model.tiered_offload``. ``keep_for_backward``: the weights a micro-batch's
    forward copied to the GPU stay there until its backward (and backward's recompute) is done, so each crosses
    PCIe once a micro-batch, not twice; they cost their bytes on the GPU at the end of forward (FSDP2's
    ``reshard_after_forward=False``). ``"auto"`` (default) keeps them where they take at most ``KEEP_SHARE`` of
    the GPU budget when this runs (never on the CPU stand-in): on a 24 GB cap the 4.42B Llama trained at 1.27x the
    tokens/s of its weights streamed again for backward (bench/RESULTS.md, fourteenth session). A number ``n``
    keeps the last ``n`` blocks' (the first of backward) and streams the others again; ``"room"`` keeps as many
    of the last blocks as the GPU has room for, measured on the first backwards (offload/kept_weights.py;
    ``model.tiered_kept_weights.count`` says how many). After backward the parameters are the host shards again,
    with their gradients (what ``clip_grad_norm_(model.parameters())`` reads): the result is bitwise the same.
    Returns ``model``, its parameters now DTensors (as after ``fully_shard``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"offload_model takes an nn.Module, got {type(model).__name__}")
    if not (isinstance(enabled, bool) or enabled == "auto"):
        raise ValueError(f"enabled must be True, False or 'auto', got {enabled!r}")
    if isinstance(keep_for_backward, numbers.Integral) and not isinstance(keep_for_backward, bool):
        keep_for_backward = int(keep_for_backward)  # numpy's integers too
    count = type(keep_for_backward) is int and keep_for_backward >= 0
    if not (isinstance(keep_for_backward, bool) or count or keep_for_backward in ("auto", "room")):
        raise ValueError(f"keep_for_backward must be True, False, 'auto', 'room' or a number of blocks >= 0, "
                         f"got {keep_for_backward!r}")  # fmt: skip
    for name, dt in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
            raise TypeError(f"{name} must be a floating torch.dtype or None, got {dt!r}")
    if isinstance(device, numbers.Integral) and not isinstance(device, bool):
        device = torch.device("cuda", int(device))  # an index, as torch takes it: a CUDA device's
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {str(dev)!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available: pass device='cpu' (or leave it out)")
    if pin_memory and not torch.cuda.is_available():
        raise ValueError("pin_memory=True needs CUDA (page-locked memory is CUDA's): leave it out here")
    if getattr(getattr(model, "tiered_offload", None), "offloaded", False):  # one that declined did nothing
        raise ValueError("offload_model was already applied to this model: apply it once")
    if mesh is not None and not (callable(getattr(mesh, "size", None)) and hasattr(mesh, "ndim")):
        raise TypeError(f"mesh must be a torch DeviceMesh (init_device_mesh) or None, got {type(mesh).__name__}")
    if gpu_budget != "auto":
        parse_size(gpu_budget, name="gpu_budget")  # checked even where nothing reads it
    nbytes = _param_bytes(model)
    budget = resolve_gpu_budget(gpu_budget, dev) if "auto" in (enabled, keep_for_backward) else 0
    if enabled == "auto" and dev.type != "cuda":  # nothing to keep them off: not a budget of 0 B they fit
        enabled = False
        why = "no CUDA device found" if not torch.cuda.is_available() else f"device={str(dev)!r} is not a GPU"
    elif enabled == "auto":
        enabled = needs_offload(model, budget, param_dtype=param_dtype)
        why = (f"weights and gradients {format_size(2 * nbytes)} {'exceed' if enabled else 'fit'} "
               f"{GPU_SHARE:.0%} of the GPU budget {format_size(budget)}")  # fmt: skip
    else:
        why = "asked for"
    if not enabled:
        info = OffloadInfo(False, 0, "", str(dev), 1, False, nbytes, why)
        _log.info("tiered: parameters stay on the GPU (%s)", why)
        model.tiered_offload = info  # type: ignore[assignment]
        return model
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    where = {p.device.type for p in model.parameters()}
    if "meta" in where:
        raise ValueError("the model has parameters on the meta device: materialize it on the CPU first "
                         "(model.to_empty(device='cpu') and its init), then offload_model(model)")  # fmt: skip
    scalars = [name for name, p in model.named_parameters() if p.dim() == 0]
    if scalars:  # FSDP2 refused one only at the root unit, with the blocks sharded and the process group made
        raise ValueError(f"the model's parameters {scalars} are 0-dim (as CLIP's logit_scale, BLIP's temp, ALIGN's "
                         "temperature), which FSDP2 cannot shard: this model cannot be offloaded; train it without "
                         "offload_model (nothing of it was changed)")  # fmt: skip
    hooked = [name for name, p in model.named_parameters() if getattr(p, "_backward_hooks", None)]
    if hooked:  # fully_shard replaces each parameter: its hooks would be dropped, silently
        raise ValueError(f"the model's parameters {hooked[:8]} carry gradient hooks (Tensor.register_hook), which "
                         f"would never run once offloaded: {_HOOKS_NEVER_RUN}. Remove them (handle.remove()) and, "
                         f"after offload_model, use {_HOOKS_INSTEAD}; nothing of the model was changed")  # fmt: skip
    if where - {"cpu"}:  # FSDP2's CPU offload takes the parameters from host memory
        model.to("cpu")
    units = find_blocks(model, blocks)
    block_class = type(units[0]).__name__  # before fully_shard renames the class (FSDP<name>)
    world, made = group_for(dev)
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(dev.type, (world,))
    pin = dev.type == "cuda" if pin_memory is None else bool(pin_memory)
    keep = keep_for_backward if keep_for_backward != "auto" else (
        dev.type == "cuda" and keeps_for_backward(model, budget, param_dtype=param_dtype)
    )  # fmt: skip
    some = keep == "room" or count  # the last blocks only (KeptWeights), set once the units are sharded
    # FSDP2 makes exact pageable copies; rehome pins them in slabs of their size (offload/pinning.py: torch's
    # pinned allocator would round each up to a power of two), a unit at a time as it is sharded.
    kw: dict[str, Any] = {"mesh": mesh, "offload_policy": CPUOffloadPolicy(pin_memory=False)}
    if keep is True:  # otherwise FSDP2's default: each block resharded after forward, the root kept
        kw["reshard_after_forward"] = False
    if param_dtype is not None or reduce_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    slabs = Slabs(model, pin=pin)  # model.tiered_slabs
    # Weak references only: fully_shard moves each unit's parameters to the GPU in place (tensor.data) before it
    # shards them, so a list of them would hold every unit's full weights in HBM until the loop ends (the 13.01B
    # ran out of a 16 GB GPU here). Those a user still holds stay alive for _note_replaced's check.
    before = [weakref.ref(p) for p in model.parameters()]
    for unit in [*units, model]:
        fully_shard(unit, **kw)
        slabs.lay_out(unit)
    _note_replaced(before, model)
    del before
    writes = DataWrites(model)  # `p.data = t` taken into the shards (offload/data_writes.py)
    model.tiered_data_writes = writes  # type: ignore[assignment]
    # Ahead of FSDP2's pre-forward (prepend), behind the hooks registered below that put a failed pass behind.
    model.register_forward_pre_hook(lambda *_: writes.take(), prepend=True)
    in_units = {id(p) for unit in units for p in unit.parameters()}
    root = [p for p in model.parameters() if id(p) not in in_units]
    summing = HostAccumulation(model, [*((u, list(u.parameters())) for u in units), (model, root)], slabs.homes)
    model.tiered_accumulation = summing  # type: ignore[assignment]
    weights = None
    if some:
        weights = KeptWeights(units, dev, param_dtype, room=keep == "room", on_sized=summing.kept.remeasure,
                              mesh=mesh)  # fmt: skip
        weights.keep_last(0 if keep == "room" else int(keep))
        summing.backward_end_hooks.append(weights.end_of_backward)
    model.tiered_kept_weights = weights  # type: ignore[assignment]
    weakref.finalize(model, summing.stop)
    _reshard_when_read(model)
    if mesh.size() == 1:
        plain_state_dicts(model)
        # FSDP2 copies a unit's weights up in line with the kernels at world size 1: copy the next one ahead.
        model.tiered_prefetch = WeightPrefetch(model, [*units, model], dev)  # type: ignore[assignment]
    unshard_outside_inference_mode([*units, model])  # after the prefetch's wrap: an evaluation before training
    refuse_root_calls_outside(model, units)
    keep_on_host([*units, model], slabs, writes)  # .to(device) leaves the weights on the host; a cast lays them out
    one_forward_at_a_time(model)  # last: its refusal is then the first pre-hook, before any FSDP2 state moves
    note_offloaded(model, nbytes)
    every = keep is True or (count and weights is not None and weights.count == len(units))  # n >= the blocks
    info = OffloadInfo(True, len(units), block_class, str(dev), world, made, nbytes, why, every)
    if keep is True:
        kept_note = ", each kept there from forward to backward"
    elif keep == "room":
        kept_note = ", the last kept there from forward to backward as its room allows (sized after two backwards)"
    else:
        n = weights.count if weights is not None else 0
        kept_note = f", the last {n} kept there from forward to backward" if n else ""
    _log.warning(
        "tiered: parameters (%s) and gradients off the GPU (%s): %d %s blocks streamed to %s one at a time by "
        "FSDP2's CPU offload%s%s, world size %d%s",
        format_size(nbytes), why, len(units), info.block_class, dev.type, " (pinned)" if pin else "", kept_note, world,
        ", in a one-rank process group made for it (tiered.offload.close() ends it)" if made else "",
    )  # fmt: skip
    model.tiered_offload = info  # type: ignore[assignment]
    return model
