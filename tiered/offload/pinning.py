"""An offloaded model's weights in page-locked host memory of exactly their size.

FSDP2's CPU offload (``CPUOffloadPolicy(pin_memory=True)``) pins each sharded parameter with
``tensor.pin_memory()``, through torch's pinned-memory allocator, which rounds every block up to a power of
two. A 10B Llama's MLP weights are 86 MiB each and take 128 MiB: 6 GiB of RAM for nothing, on a host where
every GiB not pinned for the weights holds optimizer state that then stays off the disk.

So ``offload_model`` shards with ``pin_memory=False`` (FSDP2 keeps exact, pageable copies) and ``rehome``
moves each block's sharded parameters into one ``io_engine.PinnedSlab`` (page-locked once, the pages it holds),
each parameter its own storage over its own pages, then tells FSDP2 they are pinned (``FSDPParam.pin_memory``),
so that its copies to the GPU and its gradients' copies to the host stay asynchronous, as with its own pinning.
FSDP2 keeps a pinned local tensor where it is (``reset_sharded_param`` copies only an unpinned one), so the
weights stay in the slab through ``load_state_dict`` (which copies into the local tensor). ``param.data = t``
replaces only the DTensor's wrapper, never the local tensor: offload/data_writes.py copies ``t`` into the slab.

Without CUDA nothing is page-locked: the slab is pageable, and the same moves run (the CPU stand-in tests
them). The slabs live as long as the model (``model.tiered_slabs``, the weights' and the gradients').

The gradients FSDP2 copies to the host go through torch's pinned allocator too, rounded alike. ``grad_homes``
gives each parameter that trains a home of its gradient's exact size in a slab of the block's;
offload.accumulation.HostAccumulation keeps the gradients there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from io_engine import PAGE, PinnedSlab, round_up

__all__ = ["rehome", "grad_homes", "fsdp_params"]


def fsdp_params(module: nn.Module) -> list[Any]:
    """The FSDPParams ``fully_shard(module)`` manages: its own parameters, not a nested unit's."""
    state = module._get_fsdp_state()  # type: ignore[operator]  # FSDPModule's
    group = state._fsdp_param_group
    return list(group.fsdp_params) if group is not None else []


def _slab_like(tensors: list[torch.Tensor], *, pin: bool) -> tuple[PinnedSlab, list[torch.Tensor]]:
    """One slab (page-locked where ``pin``) with a tensor of each one's dtype and shape in it, each on its own
    pages (so each has a storage of its own)."""
    sizes = [round_up(t.numel() * t.element_size(), PAGE) for t in tensors]
    slab = PinnedSlab(sum(sizes), pin=pin)
    out, offset = [], 0
    for t, size in zip(tensors, sizes):
        out.append(slab.carve(offset, t.numel() * t.element_size()).view(t.dtype).view(t.shape))
        offset += size
    return slab, out


def rehome(module: nn.Module, *, pin: bool) -> PinnedSlab | None:
    """Move the sharded parameters ``fully_shard`` made for ``module`` into one slab (page-locked where ``pin``)
    and mark them pinned for FSDP2. Returns the slab (None: the unit manages no parameter)."""
    params = [fp for fp in fsdp_params(module) if fp._sharded_param_data.numel()]
    if not params:
        return None
    # Each 1-D padded shard (at world size 1, the whole parameter).
    slab, homes = _slab_like([fp._sharded_param_data for fp in params], pin=pin)
    with torch.no_grad():
        for fp, new in zip(params, homes):
            new.copy_(fp._sharded_param_data)
            dim = fp.fsdp_placement.dim
            length = fp.sharded_param._local_tensor.size(dim)
            # What FSDP2's reset_sharded_param does for a new local tensor: the padded data, and the parameter's
            # local tensor a narrow of it.
            fp._sharded_param_data = new
            fp.sharded_param._local_tensor = new.view(fp.padded_sharded_param_size).narrow(dim, 0, length)
            if pin:
                fp.pin_memory = True  # asynchronous copies both ways, as under FSDP2's own pinning
    return slab


def grad_homes(module: nn.Module, *, pin: bool) -> tuple[PinnedSlab | None, dict[int, torch.Tensor]]:
    """A slab for the gradients of the parameters ``fully_shard`` made for ``module`` that train, and in it, by
    ``id(param)``, a tensor of each one's local shape and dtype (what FSDP2's gradients on the host have)."""
    params = [fp.sharded_param for fp in fsdp_params(module) if fp.sharded_param.requires_grad]
    params = [p for p in params if p._local_tensor.numel()]
    if not params:
        return None, {}
    slab, homes = _slab_like([p._local_tensor for p in params], pin=pin)
    return slab, {id(p): home for p, home in zip(params, homes)}
