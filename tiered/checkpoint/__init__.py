"""NVMe-tier checkpoints of a TieredOptimizer: crash-safe, checksummed, exact on resume, portable.

Call order::

    opt.save_checkpoint("ckpt/step-1000", extra={"epoch": 3}, scheduler=sched, keep_last=3)
    ...                                                   # in a new process, on the same model:
    opt = TieredOptimizer(model, nvme_path=..., chunk_bytes=..., host_budget=...)   # any of these may differ
    info = opt.load_checkpoint(latest_checkpoint("ckpt"), scheduler=sched)          # info["extra"]["epoch"] == 3

The same as functions: ``save_checkpoint(opt, path, ...)``, ``load_checkpoint(opt, path, ...)``; the way
out of tiered and in: ``export_torch_state_dict``, ``export_model_state_dict``, ``import_torch_state_dict``;
the CLI's ``inspect_checkpoint`` and ``verify_checkpoint``. The format is described in ``manifest.py``,
the commit protocol in ``fsops.py``, the data paths in ``save.py`` and ``load.py``, and what a checkpoint
must be to be believed (every name and number checked, no links followed) in ``validate.py``.

Under FSDP2 the optimizer saves and loads through ``sharded.py`` (collective: one checkpoint per rank and
a checksummed map of the shards, ``shardmap.py``, loadable at any world size); a plain process loads such a
checkpoint as world size 1 (``reshard.py`` gathers every parameter whole), and exports it too.

Modules (imports point down): cli -> sharded (-> rank_errors) -> convert -> save / load -> reshard -> plan,
writer / reader -> shardmap -> fsops -> manifest -> validate -> errors. The package never imports the optimizer:
save and load see it as a ``plan.ChunkedState`` (a narrow protocol), and read ahead through ``tiered.store.scan``;
the optimizer calls down into them.
"""

from __future__ import annotations

import os

from .cli import inspect_checkpoint, verify_checkpoint
from .convert import export_model_state_dict, export_torch_state_dict, import_torch_state_dict
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointNotSharedError,
    CheckpointPathError,
    InsufficientMemoryError,
    InsufficientSpaceError,
)
from .fsops import is_checkpoint, manifest_created, moved_aside, recover_and_say
from .load import load_checkpoint
from .save import save_checkpoint

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "inspect_checkpoint",
    "verify_checkpoint",
    "export_torch_state_dict",
    "export_model_state_dict",
    "import_torch_state_dict",
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointNotSharedError",
    "CheckpointPathError",
    "InsufficientMemoryError",
    "InsufficientSpaceError",
]


def latest_checkpoint(root: str | os.PathLike[str]) -> str | None:
    """The newest complete checkpoint folder directly inside ``root`` (by save time), or None.

    Folders without a manifest (a save that never finished) and hidden temp folders are skipped, so this
    is the one to resume from after a crash. A checkpoint that an overwrite killed between its two renames left
    aside (filesystems without an atomic exchange: NFS, Lustre, FUSE) is put back under its name first, as
    ``load_checkpoint`` puts it back (a RuntimeWarning says so), and counts; a save still in progress is left alone.
    """
    root = os.fspath(root)
    best: tuple[float, str] | None = None
    try:
        entries = os.listdir(root)
    except FileNotFoundError:
        return None
    for name in sorted({n for n in map(moved_aside, entries) if n is not None and n not in entries}):
        path = os.path.abspath(os.path.join(root, name))
        recover_and_say(path)
        if os.path.lexists(path):  # put back, by this call or by another process meanwhile
            entries.append(name)
    for entry in entries:
        full = os.path.join(root, entry)
        if entry.startswith(".") or not is_checkpoint(full):
            continue
        created = manifest_created(full)
        if created is None:
            continue  # a damaged or hostile manifest: not a candidate to resume from
        if best is None or (created, entry) > best:
            best = (created, entry)
    return None if best is None else os.path.abspath(os.path.join(root, best[1]))
