"""What the framework integrations share: finding the user's optimizer inside a framework's wrapper, and
making ``torch.load`` map a TieredOptimizer's file instead of copying it into RAM."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Iterator
from typing import Any

import torch

from ..optimizer import TieredOptimizer

__all__ = ["is_tiered", "mmap_loads"]


def is_tiered(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a TieredOptimizer, or wraps one (accelerate's ``AcceleratedOptimizer`` keeps
    it in ``.optimizer``, Lightning's ``LightningOptimizer`` in ``._optimizer``)."""
    for _ in range(4):  # wrappers nest at most a few deep; a cycle of attributes must not loop
        if isinstance(optimizer, TieredOptimizer):
            return True
        optimizer = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if optimizer is None:
            return False
    return False


@contextlib.contextmanager
def mmap_loads(names: Collection[str]) -> Iterator[None]:
    """Inside it, a ``torch.load`` of a file path whose base name is in ``names`` (the files a framework saved
    TieredOptimizers' state dicts to) maps its file unless it says ``mmap=``, and loads onto the CPU where it
    names a ``map_location``. Other loads are left as they are; no names, nothing changes.

    Mapped: the tensors of the loaded dict are then pages of the checkpoint file, read as ``load_state_dict``
    streams them into the tiers chunk by chunk, and dropped with the dict. ``TieredOptimizer.load_state_dict``
    copies out of the dict and keeps nothing of it. Not for other optimizers' files: torch's keep the loaded
    tensors as their state, which would keep the whole file mapped, its disk space held after the checkpoint
    is deleted, for the rest of the run (and update its private pages, which turn into RAM anyway).

    Onto the CPU: a multi-GPU resume asks for this rank's GPU (the HF Trainer's ``args.device`` when its world
    size is above 1, accelerate's ``"on_device"``), and ``torch.load`` would put the whole state there before
    ``load_state_dict`` takes it back to the host and disk tiers: out of GPU memory for a state larger than the
    GPU, which is what the tiers are for. The state dict's tensors are CPU tensors anyway. A load that names
    none (the HF Trainer's FSDP full-state load, through accelerate) keeps the placement it was saved with.

    Only a path is mapped: torch.distributed.checkpoint's reader (a sharded FSDP resume through the Trainer or
    accelerate) loads from in-memory streams, which torch refuses to map, so torch's process-wide default
    (``torch.utils.serialization.config.load.mmap``) would fail every such resume. ``torch.load`` is wrapped for
    the block instead, and given back as it ends."""
    if not names:
        yield
        return
    original = torch.load

    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(f, (str, os.PathLike)) and os.path.basename(os.fspath(f)) in names:
            kwargs.setdefault("mmap", True)
            if args and args[0] is not None:  # map_location, given by position
                args = ("cpu", *args[1:])
            elif kwargs.get("map_location") is not None:
                kwargs["map_location"] = "cpu"
        return original(f, *args, **kwargs)

    torch.load = load  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.load = original  # type: ignore[assignment]
