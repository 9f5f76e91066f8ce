"""The last blocks' weights of an offloaded model kept on the GPU from forward to backward, as many as fit.

Streamed, every block's weights cross PCIe twice a micro-batch: up for its forward, up again for backward (and
its recompute). Kept (FSDP2's ``reshard_after_forward=False``), a block's weights cross once; ``offload_model``'s
``keep_for_backward=True`` keeps every block's, which needs the GPU to hold the model's bf16 weights beside the
activations. Where it cannot, the last blocks of forward are the first of backward: keeping only those, the
weights of the ones kept stay on the GPU from the end of their forward to their backward a few blocks later,
and the others stream as before. At small micro-batches the link's upward direction bounds forward and backward
(a 4.42B Llama under a 12 GB cap at 2 x 2048 tokens: 17.7 GB of weights up a micro-batch and 8.8 GB of held
sums), so each block kept takes its bytes off every micro-batch's.

``KeptWeights.keep_last(n)`` keeps the last ``n`` blocks (``keep_for_backward=n``). ``"room"`` sizes ``n`` from
the GPU's room once the first backwards (``MEASURED_PASSES``, the kept sums' measurement, kept nothing) have
shown what a pass takes: the GPU limit less that peak and a margin (``auto_budget.backward_room``), whole
blocks from the last; on the CPU stand-in, every block. The kept sums (offload/kept_sums.py) then measure again,
with the weights kept, and take what is left: a GiB of weights kept saves a GiB of the link a micro-batch, a
GiB of sums kept a GiB a step.

Over several ranks every rank must keep the same blocks: a block one rank keeps it does not gather again for
backward, and the rank that does gather it would wait for it. Each rank sizes its count from its own room and
the ranks keep the least of them (an all-reduce over the mesh, once).

Changing the setting between passes is FSDP2's own (``FSDPModule.set_reshard_after_forward``): a backward
reshards every block, so a pass never meets a block in the other state. Bitwise: the bytes are the host's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..auto_budget import backward_room
from .kept_sums import MEASURED_PASSES

__all__ = ["KeptWeights"]


class KeptWeights:
    """Which of an offloaded model's blocks keep their weights from forward to backward: the last ``count``.
    ``units``: the blocks ``fully_shard`` was applied to, in forward order; ``param_dtype``: the dtype FSDP2
    unshards them in (None: their own)."""

    def __init__(self, units: list[nn.Module], device: torch.device, param_dtype: torch.dtype | None = None, *,
                 room: bool = False, on_sized: Callable[[], None] | None = None, mesh: Any = None) -> None:  # fmt: skip
        """``device``: where the blocks run; ``room``: size the count from its room after the first measured
        backwards; ``on_sized``: called once that is done and something is kept (the kept sums measure again);
        ``mesh``: the DeviceMesh the units are sharded over, whose ranks agree on the count (None: one rank)."""
        self.units, self.device, self.mesh = units, device, mesh
        size = param_dtype.itemsize if param_dtype is not None else None
        self.sizes = [sum(p.numel() * (size or p.element_size()) for p in u.parameters()) for u in units]
        self.count = 0
        self._room, self._on_sized, self._passes = room, on_sized, 0

    @property
    def kept_bytes(self) -> int:
        """The bf16 (``param_dtype``) bytes of the blocks kept."""
        return sum(self.sizes[len(self.units) - self.count :])

    def keep_last(self, n: int) -> int:
        """Keep the last ``n`` blocks' weights from forward to backward (all at ``n >= len(units)``), stream the
        others again for backward. Returns the count kept. Call it between passes."""
        n = max(0, min(int(n), len(self.units)))
        first_kept = len(self.units) - n
        for i, unit in enumerate(self.units):
            unit.set_reshard_after_forward(i < first_kept, recurse=False)  # type: ignore[operator]
        self.count = n
        return n

    def fit(self, room: int) -> int:
        """The most blocks, counted from the last, whose weights take at most ``room`` bytes."""
        n, total = 0, 0
        for size in reversed(self.sizes):
            if total + size > room:
                break
            n, total = n + 1, total + size
        return n

    def end_of_backward(self) -> None:
        """A backward ended (the accumulation's callback). With ``room``, the first ``MEASURED_PASSES`` measure
        what a pass takes keeping nothing; then as many blocks as fit are kept, once."""
        if not self._room:
            return
        self._passes += 1
        if self._passes != MEASURED_PASSES:
            return
        if self.keep_last(self.agreed(self.fit(self.room()))) and self._on_sized is not None:
            self._on_sized()

    def room(self) -> int:
        """The bytes of weights this rank's GPU can keep beside what a pass took; on the CPU stand-in, all."""
        if self.device.type != "cuda":
            return 1 << 62
        return backward_room(self.device, torch.cuda.max_memory_allocated(self.device), 0)

    def agreed(self, n: int) -> int:
        """The least ``n`` of the mesh's ranks (each dimension's group in turn): every rank keeps the same blocks."""
        if self.mesh is None or self.mesh.size() == 1:
            return n
        for d in range(self.mesh.ndim):
            group = self.mesh.get_group(d)
            on = self.device if "nccl" in str(dist.get_backend(group)) else torch.device("cpu")
            t = torch.tensor([n], dtype=torch.int64, device=on)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
            n = int(t.item())
        return n
