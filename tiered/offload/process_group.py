"""The process group ``offload_model`` shards over: the user's where one is initialized, else a one-rank group of
its own (a ``FileStore`` in a private temp folder: no environment variable, no port), which ``close()`` (or the
end of the program; not a forked child's) destroys, removing the folder.

A user who ends that group with torch's own ``destroy_process_group()`` (the usual last line of a script; a sweep
or notebook that offloads several models in one process) leaves its folder behind: the next group made removes
it, so that only the live group's folder is ever on disk.

A process forked from one where the group was made never frees its copy of it (``_keep_in_child``): freeing a gloo
group joins its worker threads and destroys the condition variables they wait on, and those threads do not exist
in the child (a fork copies only the calling thread), so the child's exit waited for ever in
``pthread_cond_destroy`` or died of SIGSEGV in ``pthread_join``. Freeing its store would also count the child as a
finished worker of the parent's ``FileStore`` and delete its file. Whether the group was freed at the child's exit
was down to chance: after a model's first forward, autograd's C++ graph and hooks hold the FSDP state that holds
the group, a cycle the interpreter's teardown never frees; before it, its last holders were plain Python objects
(torch's group registry, the device mesh in DTensor's sharding cache), freed as the modules are cleared."""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import sys
import tempfile
import weakref
from typing import Any

import torch

__all__ = ["close", "group_for"]

_own_group: dict[str, Any] = {}  # the one-rank process group this module made: its store's folder, and the pid
# Every group this module made, and its store, also those since destroyed (by close() or the user) that a model
# still holds: weakly, so that one nothing holds is freed as usual (``_keep_in_child``).
_made: list[weakref.ref[Any]] = []


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
    store = dist.FileStore(f"{folder}/store", 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    _own_group.update(folder=folder, pid=os.getpid())
    _made[:] = [ref for ref in _made if ref() is not None] + [weakref.ref(dist.group.WORLD), weakref.ref(store)]
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


def _keep_in_child() -> None:
    """In a child of ``os.fork()``: give each group this module made that is still alive, and its store, one
    reference that nothing owns, so that the child's exit never frees them (module docstring); with one alive, so
    also every group torch knows of (groups made over it, beside it), and theirs. The process's end returns their
    memory; the parent's threads, files and groups are its own."""
    kept = [obj for obj in (ref() for ref in _made) if obj is not None]
    if not kept:  # none made, or all freed: the groups there are the user's
        return
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    for group, backend_and_store in list(getattr(getattr(c10d, "_world", None), "pg_map", {}).items()):
        kept += [group, *backend_and_store]
    for obj in kept:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_keep_in_child)
