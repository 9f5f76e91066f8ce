"""An offloaded model's next block of weights copied to the GPU while the block before it computes.

At world size 1 FSDP2 does not all-gather: ``FSDPParamGroup.wait_for_unshard`` copies each sharded parameter
from host memory to the GPU (``all_gather_inputs``: ``.to(device, non_blocking=True)``) and then into the
unsharded parameter, both on the compute stream, when the block's forward (or backward) is about to run.
Its prefetching (implicit, or ``set_modules_to_forward_prefetch``) lives in the all-gather path that world
size 1 skips. So every block's weights cross PCIe in line with the kernels: on the GPU machine the 4.42B Llama's
8.8 GB a micro-batch took 160 ms of each micro-batch's 0.91 s, with the compute stream doing nothing else
(bench/RESULTS.md, eighteenth session: the profiled step's copies by stream).

``WeightPrefetch`` wraps each unit's ``wait_for_unshard``. When a unit unshards it issues, on a stream of its
own, the copy of the unit that followed it the last time (learned per training state: forward, or backward's
unshard; never across a change of state or a forward's start), into GPU memory of its own. When that unit
unshards next, FSDP2 reads the copy instead of host memory (``_sharded_param_data`` pointed at it, its
``offload_to_cpu`` off, for that call only): the compute stream waits for the copy's event and makes the
same device-to-device copy into the unsharded parameter as before. The bytes are those of host memory, so
the run is bitwise the same.

A unit whose weights are still on the GPU when backward meets it (the root, whose weights FSDP2 keeps from
forward, and the blocks ``keep_for_backward`` keeps) has nothing to unshard: the order goes on through it all the
same, so the first unit backward does unshard finds its copy made ahead.

A copy is used only by the very next unshard, and only by the unit it was made for; anything else drops it.
Every forward's start and every optimizer step drops it too (a hook), so a copy never outlives a change of
the weights: the optimizer's, a ``load_state_dict`` between passes, or a user's write. A unit whose
parameters carry FSDP2 extensions (``fsdp_pre_all_gather``) is left to FSDP2.

``stats()``: copies used (``hits``), unshards without one (``misses``), copies dropped, bytes copied ahead
(``bytes``), bytes FSDP2 copied up in line (``bytes_inline``: the misses'), and copies not made for want of GPU
memory (``no_room``: that unit is then copied in line, as FSDP2 does). ``bytes`` and ``bytes_inline`` together
are the weights' traffic up the link.
On the CPU stand-in the same bookkeeping runs with the copy made in line (no stream), so tests see it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..store.owner import OwnedLock

__all__ = ["WeightPrefetch"]

_live: weakref.WeakSet[WeightPrefetch] = weakref.WeakSet()
_step_hook: list[Any] = []  # the optimizer step pre-hook that drops every live prefetcher's copy, once a process


def _drop_all(*_: Any) -> None:
    for prefetch in list(_live):
        if prefetch.here:  # in a forked child, the parent's are not this step's (their lock may be held for ever)
            prefetch.drop()


@dataclass
class _Staged:
    """One unit's weights copied ahead: the group they belong to, a device tensor per parameter, and the event
    after which they have landed (None on the CPU)."""

    group: Any
    tensors: list[torch.Tensor]
    event: Any


def _state_name(group: Any) -> str | None:
    """FSDP2's training state of ``group`` by name (its enum is private)."""
    return getattr(group._training_state, "name", None)


def _unsharded(group: Any) -> bool:
    """Whether ``group``'s weights are on the GPU now (unsharded)."""
    return bool(getattr(group, "is_unsharded", False))


class WeightPrefetch:
    """Copies each FSDP2 unit's weights to ``device`` while the unit before it computes (world size 1).
    ``units``: the modules ``fully_shard`` was applied to; ``root``: the model (a forward's start)."""

    def __init__(self, root: nn.Module, units: list[nn.Module], device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._follows: dict[tuple[Any, int], Any] = {}  # (state, id(group)) -> the group that unsharded next
        self._last: tuple[Any, Any] | None = None  # (state, group) of the last unshard this pass
        self._staged: _Staged | None = None
        self._lock = OwnedLock("offloaded model")  # in a forked child it raises: a parent's thread may have held it
        self._counts = {"hits": 0, "misses": 0, "dropped": 0, "bytes": 0, "bytes_inline": 0, "no_room": 0}
        for unit in units:
            group = unit._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
            if group is None or any(hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather")
                                    for fp in group.fsdp_params):  # fmt: skip
                continue
            group.wait_for_unshard = self._wrap(group, group.wait_for_unshard)
        # Ahead of FSDP2's own pre-forward hook (prepend): a forward starts with nothing staged.
        root.register_forward_pre_hook(lambda *_: self.drop(), prepend=True)
        if not _step_hook:
            _step_hook.append(register_optimizer_step_pre_hook(_drop_all))
        _live.add(self)

    @property
    def here(self) -> bool:
        """This process made it (not a forked child)."""
        return self._lock.here

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def drop(self) -> None:
        """Forget the copy made ahead and the last unshard (the next one starts a new pass)."""
        with self._lock:
            if self._staged is not None:
                self._counts["dropped"] += 1
            self._staged, self._last = None, None

    def _wrap(self, group: Any, original: Any) -> Any:
        def wait_for_unshard() -> None:
            if group._all_gather_result is None:  # nothing unsharded (FSDP2 returns at once)
                original()
                if _state_name(group) == "PRE_BACKWARD" and _unsharded(group):
                    self._passed(group)  # its weights kept from forward: the order goes on through it
                return
            self._unshard(group, original)

        return wait_for_unshard

    def _passed(self, group: Any) -> None:
        """A unit met in backward with its weights still on the GPU (kept from forward: the root, whose weights
        FSDP2 keeps, or ``keep_for_backward``'s blocks): the order is learned through it as through an unshard,
        and the unit after it copied ahead. Without this, backward's first unit to unshard found no copy and FSDP2
        copied it up in line."""
        state = group._training_state
        with self._lock:
            self._note(state, group)
        self._stage_after(state, group)

    def _note(self, state: Any, group: Any) -> None:
        """``group`` comes next in ``state``'s order: learn that it follows the last one (under the lock)."""
        last, self._last = self._last, (state, group)
        if last is not None and last[0] == state:
            self._follows[(state, id(last[1]))] = group

    def _stage_after(self, state: Any, group: Any) -> None:
        """Copy ahead the unit that followed ``group`` the last time, unless its weights are on the GPU now."""
        following = self._follows.get((state, id(group)))
        if following is not None and following is not group and not _unsharded(following):
            self._stage(following)

    def _unshard(self, group: Any, original: Any) -> None:
        state = group._training_state
        with self._lock:
            staged, self._staged = self._staged, None
            self._note(state, group)
            if staged is not None and staged.group is not group:
                self._counts["dropped"] += 1
                staged = None
            self._counts["hits" if staged is not None else "misses"] += 1
            if staged is None:  # FSDP2 copies the unit's host weights up itself
                self._counts["bytes_inline"] += sum(fp._sharded_param_data.nbytes for fp in group.fsdp_params
                                                    if getattr(fp, "offload_to_cpu", False))  # fmt: skip
        if staged is None:
            original()
        else:
            self._unshard_from(group, staged, original)
        self._stage_after(state, group)

    def _unshard_from(self, group: Any, staged: _Staged, original: Any) -> None:
        """FSDP2's own unshard, reading each parameter from ``staged`` instead of host memory."""
        if staged.event is not None:
            current = torch.cuda.current_stream(self._device)
            current.wait_event(staged.event)
            for t in staged.tensors:
                t.record_stream(current)  # read there: not reused before that stream is past it
        saved = [(fp._sharded_param_data, fp.offload_to_cpu) for fp in group.fsdp_params]
        try:
            for fp, t in zip(group.fsdp_params, staged.tensors):
                fp._sharded_param_data, fp.offload_to_cpu = t, False
            original()
        finally:
            for fp, (data, offload) in zip(group.fsdp_params, saved):
                fp._sharded_param_data, fp.offload_to_cpu = data, offload

    def _stage(self, group: Any) -> None:
        """Copy ``group``'s sharded weights to the device on the prefetch stream (in place of any copy made
        ahead and not yet used, which is dropped)."""
        sources = [fp._sharded_param_data for fp in group.fsdp_params]
        try:
            if self._stream is None:
                tensors, event = [s.to(self._device, copy=True) for s in sources], None
            else:
                with torch.cuda.stream(self._stream):
                    tensors = [s.to(self._device, non_blocking=True) for s in sources]
                    event = self._stream.record_event()
        except torch.OutOfMemoryError:  # no room for one block more: that unit is copied in line, as without this
            with self._lock:
                self._counts["no_room"] += 1
            return
        with self._lock:
            if self._staged is not None:
                self._counts["dropped"] += 1
            self._staged = _Staged(group, tensors, event)
            self._counts["bytes"] += sum(t.nbytes for t in tensors)
