"""The additions of an offloaded model's gradient accumulation that run on the GPU, in FSDP2's all-reduce hook
(offload/accumulation.py says when): each parameter's view of a block's flat reduced gradients (``flat_views``),
the held gradients added into them from their copies kept on the GPU or copied up (``take_kept``,
``add_on_device``), and the reduced gradients kept from reuse until their copy down has read them
(``keep_until_copied``)."""

from __future__ import annotations

import torch
from torch import nn

from ..optim import resident_grads
from .pinning import fsdp_params

__all__ = ["add_on_device", "flat_views", "keep_until_copied", "local_shard", "take_kept"]


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself (a DTensor's local shard, the same storage): what an in-place add must write."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def keep_until_copied(reduce_output: torch.Tensor) -> None:
    """Keep FSDP2's reduced gradients of a block from reuse until the hook's stream has copied them down.

    With an all-reduce hook FSDP2 copies them down on the stream the hook runs on, not on the reduce-scatter
    stream their memory came from, and drops them without waiting for that copy: the next block's reduce-scatter
    could reuse the memory while the copy (behind the hook's additions) still reads it, and the host would get
    another block's gradients (bench/RESULTS.md, twentieth session: 3 two-step runs in 5 differed from the run on
    the GPU). Recorded on the hook's stream, the memory waits for what is queued there when FSDP2 lets go."""
    if reduce_output.is_cuda:
        reduce_output.record_stream(torch.cuda.current_stream(reduce_output.device))


def take_kept(held: list[tuple[nn.Parameter, torch.Tensor | None]],
               reduce_output: torch.Tensor) -> dict[int, torch.Tensor]:  # fmt: skip
    """By ``id(param)``, the copies of ``held`` gradients a backward kept on ``reduce_output``'s device
    (resident_grads), for those whose host tensor is unchanged since: bitwise what a copy up would bring. Each is
    taken off resident_grads, used or not, so a block holds one generation of kept sums at a time."""
    kept = {}
    for p, g in held:
        copy = resident_grads.take(local_shard(g)) if g is not None else None
        if copy is not None and copy.device == reduce_output.device:
            if copy.is_cuda:  # read on this stream, then let go: its memory waits for the addition
                copy.record_stream(torch.cuda.current_stream(copy.device))
            kept[id(p)] = copy
    return kept


def add_on_device(views: dict[int, torch.Tensor], reduce_output: torch.Tensor,
                   held: list[tuple[nn.Parameter, torch.Tensor | None]],
                   kept: dict[int, torch.Tensor] | None = None) -> bool:  # fmt: skip
    """Add the ``held`` gradients into ``reduce_output`` (FSDP2's reduced gradients of a block, flat, before its
    copies down; in the hook, on FSDP2's reduce stream), each parameter's into its view (``flat_views``): from
    its copy in ``kept`` (by ``id(param)``, on the device already), or copied up. Returns whether it did: all or
    none of them (none where one does not match its view, or where the GPU has no room for their copies)."""
    kept = kept or {}
    pairs = []
    for p, g in held:
        if g is None:
            continue
        view, old = views.get(id(p)), kept.get(id(p), local_shard(g))
        if view is None or view.shape != old.shape or old.dtype != reduce_output.dtype:
            return False
        pairs.append((view, old))
    with torch.no_grad():
        # All copies up before any addition: where the GPU has no room for them (out of memory beside backward)
        # nothing has been added, and the worker sums the block as it would without this. The copy up reads the
        # pinned home before the worker writes it: the worker waits for FSDP2's copy down, which this stream runs
        # after the additions.
        try:
            # A kept copy is on the device already: ``to`` returns it as it is.
            ups = [old.to(reduce_output.device, non_blocking=True) for _, old in pairs]
        except torch.OutOfMemoryError:
            return False
        for (view, _), up in zip(pairs, ups):
            view.add_(up)  # new + held: IEEE addition is commutative, so the bits of FSDP2's held + new
    return True


def flat_views(module: nn.Module, reduce_output: torch.Tensor) -> dict[int, torch.Tensor] | None:
    """Each parameter's gradient in ``reduce_output`` by ``id``, as FSDP2's foreach_reduce views them out after
    the hook; None where that layout does not hold: a parameter without a gradient this micro-batch (FSDP2
    reduced fewer), or a reduce dtype FSDP2 casts, or divides in (neither bf16 nor fp32), after the hook."""
    if reduce_output.dtype not in (torch.bfloat16, torch.float32):
        return None
    views, offset = {}, 0
    try:
        for fp in fsdp_params(module):
            if fp.sharded_param.dtype != reduce_output.dtype:
                return None
            numel = fp.padded_sharded_param_size.numel()
            if offset + numel > reduce_output.numel():
                return None
            views[id(fp.sharded_param)] = torch.as_strided(
                reduce_output, fp.sharded_size, fp.contiguous_sharded_stride, offset
            )
            offset += numel
    except AttributeError:  # another torch's FSDPParam: the worker sums, as before
        return None
    return views if offset == reduce_output.numel() else None
