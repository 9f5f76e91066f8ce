"""The tensors the optimizer's state is laid out on: the parameters, or under FSDP2 their local shards.

After ``fully_shard(model)`` every parameter is a ``DTensor`` whose rank-local piece is a plain tensor (a shard
of dim 0; possibly zero-length on a rank when a dimension does not divide). Each rank tiers and updates only
its own shards, so everything below the optimizer works on plain local tensors: DTensor dispatch inside the
update would cost ~10x, and the chunk, record and transfer code needs none of it. What does need the ranks
together is one number, the global gradient norm for ``max_grad_norm``, taken as torch's ``clip_grad_norm_`` takes
it over DTensors, bitwise: each rank's norm of each local gradient, one all-reduce of their squares (a vector, on
the gradients' device), then the norm of the parameters' norms (``sharded_total_norm``). Where the parameters are
split over more than one mesh dimension, or over different ones (tensor parallel on a (dp, tp) mesh: FSDP2's dp
and ColwiseParallel's or RowwiseParallel's tp, a Replicate bias beside them), torch joins the ranks' norms one
mesh dimension at a time, converting the replicated ones first; there the norm is torch's own
``get_total_norm`` over the DTensor gradients (``NormPlan``).

A parameter that does not require grad when the optimizer is built (a frozen base weight under peft) is
accepted, as torch.optim.AdamW accepts it, and keeps no state: its local tensor is an empty placeholder of its
dtype and device, which no chunk holds. ``thawed()`` names those that have since begun to take gradients; the
optimizer then lays its state out again (``Shards(params)`` anew, on the tensors as they are now).

Call order: ``shards = Shards(params)``; ``shards.locals`` is the optimizer's flat tensor list (the same list
object for the Shards' lifetime; ``extend`` for an added param group); per step ``with shards.grads(): ...``,
inside which ``local.grad`` is the local piece of the parameter's gradient; ``shards.clip_grad_norm_(indices,
max)``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple, TypeGuard, cast

import torch

from ..auto_budget import grad_room
from . import resident_grads
from .link import LinkBytes

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Placement, Shard

__all__ = ["NormPlan", "Shards", "is_sharded", "norm_plan", "release_resident", "sharded_like", "sharded_total_norm",
           "total_norm_on"]  # fmt: skip


def is_sharded(p: torch.Tensor) -> TypeGuard[DTensor]:
    # torch.distributed.tensor takes about a second to import, so it is not imported here: a DTensor exists only
    # once that module is (and never in a torch built without distributed), so until then nothing is sharded.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(p, module.DTensor)


def sharded_like(local: torch.Tensor, p: DTensor) -> DTensor:
    """``local`` (shaped like ``p``'s local shard) as a DTensor sharded like ``p``, left on its own device.
    ``DTensor.from_local`` would move it to the mesh's device type: under FSDP2's CPU offload the mesh is a
    GPU's and the shards stay in host memory, so wrapping a state dict that way would copy the whole
    optimizer state onto the GPU it was kept off (FSDP2 builds its offloaded parameters this way too)."""
    from torch.distributed.tensor import DTensor

    if local.device.type == p.device_mesh.device_type:
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())  # fmt: skip
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(p.device_mesh, p.placements, tensor_meta=TensorMeta(p.shape, p.stride(), local.dtype))
    return DTensor(local, spec, requires_grad=False)  # type: ignore[call-arg]


def _frozen(p: torch.Tensor) -> bool:
    """What torch.optim.AdamW would never step: no gradient, and none to come."""
    return not p.requires_grad and p.grad is None


def _local(p: torch.Tensor, frozen: bool) -> torch.Tensor:
    """The tensor whose values the optimizer reads and writes: ``p`` itself, or its rank-local shard (an alias
    of the DTensor's storage: writes either way are seen by the other, but each moves its own version counter
    alone, ``Shards.version``); for a frozen parameter, an empty tensor of its dtype on its (local) device, so
    that it takes no state."""
    if frozen:
        return torch.empty(0, dtype=p.dtype, device=p.device)
    if not is_sharded(p):
        return p
    with torch.no_grad():
        return p.to_local()


class Shards:
    def __init__(self, params: list[torch.Tensor], keep: frozenset[int] = frozenset()):
        """``keep``: indices laid out even if frozen now (they have state, which a frozen parameter keeps)."""
        self.params: list[torch.Tensor] = []  # as the user passed them (DTensors under FSDP2)
        self.locals: list[torch.Tensor] = []
        self.frozen: list[bool] = []  # did not require grad when laid out: no state, an empty local tensor
        self._norm: NormPlan | None = None  # how the clip joins the ranks' norms; None: not distributed
        self.last_norm: torch.Tensor | None = None  # the global gradient norm the last clip measured
        self.deferred_scale: torch.Tensor | None = None  # the coefficient a deferred clip left to the update
        self.device_grads: dict[int, torch.Tensor] = {}  # a deferred clip's gradient copies left on the GPU
        self.kept_bytes = 0  # their bytes, the last clip's
        self.found_bytes = 0  # of those, copies backward had left on the GPU (resident_grads), not sent up again
        self.link = LinkBytes()  # the clip's copies up (optim/link.py)
        self.extend(params, keep)

    @property
    def distributed(self) -> bool:
        return self._norm is not None

    @property
    def mesh(self) -> DeviceMesh | None:
        """The device mesh of the first parameter, under FSDP2 (or tensor parallel): the ranks that hold the
        other pieces of the parameters, which must build the same optimizer (optim/rank_agreement.py)."""
        return cast("DTensor", self.params[0]).device_mesh if self.distributed and self.params else None

    def extend(self, params: list[torch.Tensor], keep: frozenset[int] = frozenset()) -> None:
        sharded = [p for p in params if is_sharded(p)]
        if params and (0 < len(sharded) < len(params) or self.params and bool(sharded) != self.distributed):
            raise ValueError("some parameters are DTensors (FSDP2) and others are not: build TieredOptimizer after "
                             "fully_shard has wrapped the whole model (fully_shard(model) last)")  # fmt: skip
        if sharded:
            self._norm = norm_plan([*cast("list[DTensor]", self.params), *sharded])  # the whole, as the clip takes it
        frozen = [_frozen(p) and len(self.params) + i not in keep for i, p in enumerate(params)]
        self.params.extend(params)
        self.locals.extend(_local(p, f) for p, f in zip(params, frozen))
        self.frozen.extend(frozen)

    @property
    def compute_device(self) -> torch.device | None:
        """The GPU that forward and backward run on when the shards are kept in host memory by FSDP2's CPU
        offload (DTensors over a CUDA mesh whose local tensors are on the CPU), else None: the update can then
        run on that GPU (update_on="device"), the record and gradients going up, the new weights down."""
        for p, local in zip(self.params, self.locals):
            if is_sharded(p) and local.device.type == "cpu" and p.device_mesh.device_type == "cuda":
                return torch.device("cuda", torch.cuda.current_device())
        return None

    def laid_out_shape(self, i: int) -> torch.Size:
        """The shape tensor ``i``'s state has once laid out: its local tensor's, a frozen one's too (not its
        placeholder's)."""
        return _local(self.params[i], False).shape if self.frozen[i] else self.locals[i].shape

    def version(self, i: int) -> tuple[int, int]:
        """Tensor ``i``'s version counters, the parameter's and its local tensor's: a write to it either way moves
        the pair. An in-place op on a DTensor (``load_state_dict``'s copy, ``p.mul_`` under no_grad) runs on its
        local tensor below autograd, where no counter moves, so it moves the DTensor's alone; a write through
        ``to_local()`` (and the optimizer's own, into ``locals``) moves the local tensor's alone."""
        return self.params[i]._version, self.locals[i]._version

    def thawed(self) -> list[int]:
        """The frozen parameters that now require grad or hold a gradient: their state must be laid out."""
        return [i for i, (p, f) in enumerate(zip(self.params, self.frozen)) if f and not _frozen(p)]

    def grouped(self, param_groups: list[dict[str, Any]]) -> list[list[torch.Tensor]]:
        """The local tensors of each param group, in order."""
        out, start = [], 0
        for g in param_groups:
            out.append(self.locals[start : start + len(g["params"])])
            start += len(g["params"])
        return out

    def layout(self, names: list[str]) -> list[tuple[str, tuple[int, ...], int, int]]:
        """Per parameter: its name, global shape, and the first row and row count of this rank's shard (what a
        sharded checkpoint records). FSDP2 shards dimension 0; other placements are refused by name."""
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        out = []
        for name, p, loc, frozen in zip(names, self.params, self.locals, self.frozen):
            if frozen:  # no state: an empty parameter to the checkpoint, on every rank
                out.append((name, tuple(loc.shape), 0, 0))
                continue
            p = cast("DTensor", p)  # distributed: every parameter is one
            if p.dim() == 0 or [type(pl) for pl in p.placements] != [Shard] or cast("Shard", p.placements[0]).dim != 0:
                raise ValueError(f"parameter {name!r} is not sharded along dimension 0 over one mesh dimension "
                                 f"({p.placements}): NVMe-tier checkpoints need FSDP2's Shard(0)")  # fmt: skip
            _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            out.append((name, tuple(p.shape), int(offset[0]) if loc.shape[0] else 0, int(loc.shape[0])))
        return out

    def truncate(self, n: int) -> None:
        """Forget every tensor from index ``n`` on (an added param group that failed its checks)."""
        del self.params[n:], self.locals[n:], self.frozen[n:]
        self._norm = norm_plan(cast("list[DTensor]", self.params)) if self.params and self.distributed else None

    @contextmanager
    def grads(self) -> Iterator[None]:
        """Bind each local shard's ``.grad`` to the local piece of its parameter's gradient, for one step;
        unbound afterwards, so no gradient memory outlives the user's ``zero_grad``."""
        if not self.distributed:
            yield
            return
        for p, loc, frozen in zip(self.params, self.locals, self.frozen):
            loc.grad = None if p.grad is None or frozen else cast("DTensor", p.grad).to_local()
        try:
            yield
        finally:
            for loc in self.locals:
                loc.grad = None

    def bind_grads(self, indices: list[int]) -> None:
        """Bind the local shards ``indices``' ``.grad`` now (the update under backward reads them before
        ``step()``'s ``grads()`` binds them all); unbound with the rest at that step's end."""
        if self.distributed:
            for i in indices:
                p = self.params[i]
                self.locals[i].grad = None if p.grad is None or self.frozen[i] else cast("DTensor", p.grad).to_local()

    def to_global(self, state: dict[int, dict[str, torch.Tensor]]) -> dict[int, dict[str, torch.Tensor]]:
        """A state dict's per-parameter tensors (shaped like the local shards) as DTensors shaped like their
        parameters, sharded the same way, as torch's AdamW keeps them under FSDP2: what
        torch.distributed.checkpoint saves and reshards. Scalars (``step``) stay plain."""
        if not self.distributed:
            return state
        out = {}
        for i, d in state.items():
            p = cast("DTensor", self.params[i])  # distributed: every parameter is one
            out[i] = {k: v if v.dim() == 0 else sharded_like(v, p) for k, v in d.items()}
        return out

    def to_local(self, sd: Any) -> Any:
        """A state dict with every DTensor replaced by its local shard (what ``load_state_dict`` checks).

        An optimizer over plain parameters takes a one-rank state as well: an offloaded model's (offload_model
        at world size 1, whose shard is the whole parameter) resumed without offload, where ``enabled="auto"``
        finds a GPU that holds the model, or the user turns it off. A state sharded over several ranks is
        refused there by name: its pieces are on the other ranks."""
        if not isinstance(sd, dict) or not isinstance(sd.get("state"), dict):
            return sd
        if not self.distributed:
            for v in sd["state"].values():
                for n, t in v.items() if isinstance(v, dict) else ():
                    if is_sharded(t) and t.device_mesh.size() > 1:
                        raise ValueError(f"optimizer state {n!r} is sharded over {t.device_mesh.size()} ranks "
                                         "(FSDP2), but this optimizer's parameters are not sharded: load it under "
                                         "the same sharding, or save and load an NVMe-tier checkpoint "
                                         "(save_checkpoint / load_checkpoint), which reshards")  # fmt: skip
        state = {k: {n: t.to_local() if is_sharded(t) else t for n, t in v.items()} if isinstance(v, dict) else v
                 for k, v in sd["state"].items()}  # fmt: skip
        return {**sd, "state": state}

    def clip_grad_norm_(self, indices: list[int], max_norm: float, answer: bool = True,
                        defer: bool = False) -> bool | None:  # fmt: skip
        """``torch.nn.utils.clip_grad_norm_`` over the gradients of ``indices``, the norm taken over every rank;
        returns whether it scaled them. Where torch would multiply by exactly 1 it leaves them alone (the same
        bits, and their version counters unchanged: optim/under_backward/overlap.py keeps what it started on them).

        ``answer=False``: nobody needs to know, so the host does not wait for the GPU to find out (``bool`` of
        a device tensor waits for backward's last kernel, and the step's launches would then start on an idle
        GPU): every gradient is multiplied by the clamped coefficient, 1 where torch would not scale (the same
        bits; only the version counters move), and None is returned.

        ``defer=True`` (one rank's gradients; the optimizer asks it for an offloaded model's): the gradients are
        left as they are and ``deferred_scale`` holds the coefficient torch would multiply them by (None where
        it would not), for the update to apply as it reads them (transfer.py: the same multiply, so the same
        bits). Where the parameters are streamed to a GPU (``compute_device``) the norm is taken there, each
        gradient copied up once (``total_norm_on``): the norm the same run without offload takes, where the
        host's would differ in rounding. The host then neither reads the gradients for the norm nor writes
        them to scale them: for a 4.4B model, 8.8 GB read and 17.7 GB read and written by the CPU a step.
        As many of those copies as the GPU has room for (``auto_budget.grad_room``) stay there, in
        ``device_grads`` (by index, for this step): the update reads them there rather than copying them up again.
        A gradient whose copy backward left on the GPU (``resident_grads``: the last micro-batch's sum, where that
        is switched on) is read there and kept, not copied up at all.

        Every rank must call it (the all-reduce), with the same parameters holding gradients (as FSDP2 gives them),
        a rank with no local gradient elements included."""
        self.deferred_scale = None
        self.device_grads, self.kept_bytes, self.found_bytes = {}, 0, 0
        # Over groups of one rank (FSDP2 at world size 1, as tiered.offload_model makes it) the norm is torch's
        # own, so that offloading parameters leaves the clipped run bitwise the run without it.
        plan = self._norm
        single = plan is None or plan.size == 1
        # Empty gradients stay, as in torch's: its vector of norms has one slot a gradient, a zero-size parameter's
        # 0 included, and the norm of that vector rounds otherwise with a term fewer; under FSDP2 each rank's
        # vector likewise has one slot a parameter, an empty local shard's too.
        indices = [i for i in indices if self.locals[i].grad is not None]
        params = [self.locals[i] for i in indices]
        grads = [cast(torch.Tensor, p.grad) for p in params]  # each has one: filtered just above
        if not grads:  # as torch's, which takes no norm (and no collective) of no gradients
            return False if answer else None
        defer = defer and single
        if single:
            device = self.compute_device if defer else None
            if device is None:
                norm = torch.nn.utils.get_total_norm(grads)
            else:
                kept: dict[int, torch.Tensor] = {}
                found: set[int] = set()
                norm = total_norm_on(grads, device, grad_room(device), kept, found, self.link)
                self.device_grads = {indices[k]: t for k, t in kept.items()}
                self.kept_bytes = sum(t.numel() * t.element_size() for t in kept.values())
                self.found_bytes = sum(kept[k].numel() * kept[k].element_size() for k in found)
        else:
            norm = cast(NormPlan, plan).total_norm(grads, [self.params[i] for i in indices])
        self.last_norm = norm
        if not answer:  # a NaN norm leaves them alone, as the answered path does (torch would multiply by NaN)
            norm = torch.where(norm.isnan(), torch.zeros_like(norm), norm)  # 0: a coefficient of 1
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # as torch's clip_grad_norm_
        if answer and not bool(coef < 1):
            return False
        if defer:
            self.deferred_scale = coef  # what clip_grads_with_norm_ would multiply by, computed as it does
        else:  # the local shards, as torch's multiplies a DTensor gradient's
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return True if answer else None


def release_resident(shards: Shards) -> None:
    """Forget the sums backward left on the GPU beside ``shards``' gradients (``resident_grads``) that the clip
    did not take, so that their memory is back for the update."""
    resident_grads.release([g for p in shards.locals if (g := p.grad) is not None])


def sharded_total_norm(grads: list[torch.Tensor], groups: list[ProcessGroup]) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm`` of the DTensor gradients whose local shards are ``grads`` (every rank's,
    one a parameter in the same order; empty ones too), as torch computes it, bitwise, in one all-reduce: each
    parameter's local norm (``_foreach_norm`` by device and dtype group, in torch's group order, stacked: the
    stack promotes a bf16 group's to fp32), and those of every rank joined as DTensor's norm reduction joins them
    (squares summed over ``groups``, then the square root), then the norm of that vector."""
    import torch.distributed as dist
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

    norms: list[torch.Tensor] = []
    grouped = _group_tensors_by_device_and_dtype([cast("list[torch.Tensor | None]", grads)])
    for (device, _), ([found], _) in grouped.items():
        tensors = cast("list[torch.Tensor]", found)  # none is None
        if _has_foreach_support(tensors, device):
            norms.extend(torch._foreach_norm(tensors, 2.0))
        else:
            norms.extend(torch.linalg.vector_norm(g, 2.0) for g in tensors)
    squares = torch.stack([n.to(grads[0].device) for n in norms]) ** 2
    for pg in groups:
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=pg)
    return torch.linalg.vector_norm(squares**0.5, 2.0)


def total_norm_on(tensors: list[torch.Tensor], device: torch.device, keep_bytes: int = 0,
                  kept: dict[int, torch.Tensor] | None = None,
                  found: set[int] | None = None, link: LinkBytes | None = None) -> torch.Tensor:  # fmt: skip
    """``torch.nn.utils.get_total_norm(tensors)`` as torch computes it with the tensors on ``device``, copying one
    tensor there at a time (the whole would not fit: an offloaded model's gradients). Bitwise the same: torch
    groups the tensors by dtype (the order its own grouping gives is used here), takes each group's norms with
    ``_foreach_norm`` (whose result for a tensor does not depend on the others in its list: its chunks' partial
    sums are reduced per tensor, other tensors' slots only adding zeros), then the norm of the stacked norms.
    ``kept``: filled with the copies on ``device`` (by index into ``tensors``), as many as ``keep_bytes`` holds,
    for the update to read instead of copying them up again. ``found``: where given, a tensor with a copy on the
    GPU already (``resident_grads.take``) is read there and kept (its index added to ``found``), not copied.
    ``link``: counts the copies up."""
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

    stand_ins = [torch.empty(0, dtype=t.dtype, device=device) for t in tensors]  # for the group order only
    grouped = _group_tensors_by_device_and_dtype([stand_ins], with_indices=True)  # type: ignore[list-item]
    norms: list[torch.Tensor] = []
    for _, (_, order) in grouped.items():
        for i in order:
            resident = resident_grads.take(tensors[i]) if found is not None else None
            if found is not None and resident is not None and resident.device == device:
                up = resident
                found.add(i)
                if kept is not None:
                    kept[i] = up  # its memory is taken already: keep_bytes is for copies still to be made
            else:
                up = tensors[i].to(device, non_blocking=True)
                if link is not None:
                    link.add(tensors[i], up)
                size = up.numel() * up.element_size()
                if kept is not None and size <= keep_bytes and up is not tensors[i]:  # a copy, never the gradient
                    kept[i], keep_bytes = up, keep_bytes - size
            if _has_foreach_support([up], device):
                norms.extend(torch._foreach_norm([up], 2.0))
            else:
                norms.append(torch.linalg.vector_norm(up, 2.0))
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


class NormPlan(NamedTuple):
    """How the clip's global norm joins the ranks' norms of their local gradients."""

    groups: tuple[ProcessGroup, ...]  # one all-reduce of the squares over these (one mesh dimension), or none
    dtensor: bool  # through torch's DTensor norm instead: the parameters are split over several mesh dimensions
    size: int  # the ranks the norm is taken over: 1, and it is the local norm (as without a process group)
    refused: str | None = None  # why no global norm can be taken (the clip raises it; training without is fine)

    def total_norm(self, grads: list[torch.Tensor], params: list[torch.Tensor]) -> torch.Tensor:
        """The norm of the DTensor gradients of ``params``, whose local pieces are ``grads``, on every rank."""
        if self.refused is not None:
            raise ValueError(self.refused)
        if self.dtensor:  # torch's own, reduced to every rank as its clip_grads_with_norm_ reduces it
            dgrads = [cast(torch.Tensor, p.grad) for p in params]  # each has one: the clip takes those only
            return cast("DTensor", torch.nn.utils.get_total_norm(dgrads)).full_tensor()
        return sharded_total_norm(grads, list(self.groups))


def norm_plan(params: list[DTensor]) -> NormPlan:
    """The ``NormPlan`` of parameters all DTensors. Where every parameter is split over one mesh dimension, the
    same for all, and replicated over the others (FSDP2; HSDP), the squares of the local norms are all-reduced over
    that dimension's group, which is what DTensor's norm reduction does there, bitwise (``sharded_total_norm``).
    Otherwise (tensor parallel: ColwiseParallel's weights split over dp and tp, RowwiseParallel's bias over dp
    alone) torch reduces one mesh dimension at a time (the square root between) after turning the replicated norms
    into partial ones (divided by the square root of the group's size), and its order and conversions are its own:
    the norm is taken by torch itself then. That needs one mesh, as torch's ``clip_grad_norm_`` needs."""
    sets = {tuple(d for d, pl in enumerate(p.placements) if _splits(pl)) for p in params}
    if len(sets) == 1 and len(dims := next(iter(sets))) <= 1:
        found = {tuple(p.device_mesh.get_group(d) for d in dims) for p in params}
        if len(found) == 1 and all(_splits(pl) or pl.is_replicate() for p in params for pl in p.placements):
            groups = next(iter(found))
            return NormPlan(groups, False, groups[0].size() if groups else 1)
    meshes = list({id(p.device_mesh): p.device_mesh for p in params}.values())
    if any(m != meshes[0] for m in meshes):
        return NormPlan((), True, max(m.size() for m in meshes), "the parameters are DTensors on different "
                        f"device meshes ({', '.join(str(m) for m in meshes)}): max_grad_norm takes the global "
                        "gradient norm over one, as torch.nn.utils.clip_grad_norm_ does; put every parameter on "
                        "the same mesh (parallelize_module and fully_shard over parts of one DeviceMesh)")  # fmt: skip
    return NormPlan((), True, meshes[0].size())


def _splits(pl: Placement) -> bool:
    """Whether a placement splits the tensor over its mesh dimension: ``Shard`` and FSDP2's ``_StridedShard`` over
    dp beside a tensor-parallel ``Shard`` (not a subclass of ``Shard``, nor ``is_shard()``, in torch 2.13). A
    ``Replicate`` or ``Partial`` one holds the whole tensor (or a summand of it) on each rank."""
    from torch.distributed.tensor import Shard

    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # a torch without it: only Shard splits
        return isinstance(pl, Shard)
    return isinstance(pl, (Shard, _StridedShard))
