"""The bytes the optimizer moves between host memory and a GPU (the link: PCIe), counted by direction.

An offloaded model's forward and backward report their own traffic (``tiered_prefetch`` and
``tiered_accumulation``); the optimizer's step moves more: state records up and down (``update_on="device"``),
gradients up for the clip's norm and the update, new weights down into host parameters, or, updating on the host,
gradients down and weights up. With both, a run can set a whole step against the least time its bytes take on
the link (the PCIe floor), beside the compute and the disk.

Each copy site counts its copy (``LinkBytes.add``); a copy within one device counts nothing, so a model on the
CPU moves no bytes over the link. The count is the destination's bytes: torch casts a copy that changes dtype
on the host before it goes up and, queued, on the GPU before it comes down, so the destination's dtype is what
crosses.
"""

from __future__ import annotations

import torch

__all__ = ["LinkBytes"]


class LinkBytes:
    """Running totals of the bytes copied up (host to GPU) and down (GPU to host), since construction."""

    def __init__(self) -> None:
        self.up = 0
        self.down = 0

    def add(self, src: torch.Tensor, dst: torch.Tensor, nbytes: int | None = None) -> None:
        """Count a copy of ``src`` into ``dst`` (``nbytes``, default ``dst.nbytes``: a multi-tensor copy between
        the same two devices passes its first pair and the sum): up from host memory to a GPU, down the other
        way, nothing within one device."""
        into, out = dst.device.type, src.device.type
        if into == out:
            return
        n = dst.nbytes if nbytes is None else nbytes
        if out == "cpu":
            self.up += n
        elif into == "cpu":
            self.down += n

    def totals(self) -> tuple[int, int]:
        """(up, down) so far."""
        return self.up, self.down
