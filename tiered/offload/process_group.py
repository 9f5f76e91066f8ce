"""The process group ``offload_model`` shards over: the user's where one is initialized, else a one-rank group of
its own (a ``FileStore`` in a private temp folder: no environment variable, no port), which ``close()`` (or the
end of the program; not a forked child's) destroys, removing the folder.

A user who ends that group with torch's own ``destroy_process_group()`` (the usual last line of a script; a sweep
or notebook that offloads several models in one process) leaves its folder behind: the next group made removes
it, so that only the live group's folder is ever on disk."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Any

import torch

__all__ = ["close", "group_for"]

_own_group: dict[str, Any] = {}  # the one-rank process group this module made, and its store's folder


def group_for(device: torch.device) -> tuple[int, bool]:
    """The world size, and whether the group was made here (our own store; the user's environment untouched)."""
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("offload_model needs torch.distributed, which this torch build lacks")
    if dist.is_initialized():
        return dist.get_world_size(), False
    if _own_group.get("pid") == os.getpid():  # ours, destroyed by the user: its folder is ours to remove
        shutil.rmtree(_own_group.pop("folder"), ignore_errors=True)
    folder = tempfile.mkdtemp(prefix="tiered-pg-")
    backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.FileStore(f"{folder}/store", 1), rank=0, world_size=1)
    _own_group.update(folder=folder, pid=os.getpid())
    atexit.register(close)
    return 1, True


def close() -> None:
    """Destroy the one-rank process group ``offload_model`` made (nothing if it made none). Idempotent. In a
    process forked after it was made (its exit runs this too), nothing: the group and its store's folder are the
    parent's, whose next ``new_group`` waited for ever once that folder was gone."""
    import torch.distributed as dist

    folder = _own_group.pop("folder", None)
    if folder is None or _own_group.pop("pid") != os.getpid():
        return
    if dist.is_initialized():
        dist.destroy_process_group()
    shutil.rmtree(folder, ignore_errors=True)
