"""NVMe-tier checkpoints of a TieredOptimizer: crash-safe, checksummed, exact on resume, portable.

Call order::

    opt.save_checkpoint("ckpt/step-1000", extra={"epoch": 3}, scheduler=sched, keep_last=3)
    ...                                                   # in a new process, on the same model:
    opt = TieredOptimizer(model, nvme_path=..., chunk_bytes=..., host_budget=...)   # any of these may differ
    info = opt.load_checkpoint(latest_checkpoint("ckpt"), scheduler=sched)          # info["extra"]["epoch"] == 3

The same as functions: ``save_checkpoint(opt, path, ...)``, ``load_checkpoint(opt, path, ...)`` (which save and
load through ``opt.save_checkpoint`` and ``opt.load_checkpoint``); the way out of tiered and in:
``export_torch_state_dict``, ``export_model_state_dict``, ``import_torch_state_dict``; the CLI's
``inspect_checkpoint`` and ``verify_checkpoint``. The format is described in ``manifest.py``, the commit protocol in
``fsops.py``, the data paths in ``save.py`` and ``load.py``, and what a checkpoint must be to be believed (every name
and number checked, no links followed) in ``validate.py``.

Under FSDP2 the optimizer saves and loads through ``sharded.py`` (collective: one checkpoint per rank and
a checksummed map of the shards, ``shardmap.py``, loadable at any world size); a plain process loads such a
checkpoint as world size 1 (``reshard.py`` gathers every parameter whole), and exports it too.

Modules (imports point down): cli -> sharded (-> rank_errors) -> convert -> save / load -> reshard -> plan,
writer / reader -> shardmap -> fsops -> regular_files -> manifest -> validate -> errors. The package never imports
the optimizer: save and load see it as a ``plan.ChunkedState`` (a narrow protocol), and read ahead through
``tiered.store.scan``; the optimizer calls down into them.
"""

from __future__ import annotations

import os
import warnings

from .cli import inspect_checkpoint, verify_checkpoint
from .convert import export_model_state_dict, export_torch_state_dict, import_torch_state_dict
from .errors import (
    CheckpointCommittedError,
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
from .fsops import is_checkpoint, manifest_created, moved_aside, put_back, stuck_message
from .load import load_checkpoint
from .save import save_checkpoint
from .validate import checkpoint_path

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
    "CheckpointCommittedError",
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
    Where this process cannot write ``root`` (a read-only mount, another user's run) the aside stays where it is,
    still counts, and its own hidden path is what this returns when it is the newest (load_checkpoint reads it
    there, as it does given the checkpoint's own name: ``fsops.readable``); a RuntimeWarning says so.
    """
    root = checkpoint_path(root, "checkpoint root", "ckpt")  # "" refused: it would name the current folder
    best: tuple[float, str, str] | None = None  # (save time, checkpoint name, folder it is in)
    try:
        entries = os.listdir(root)
    except FileNotFoundError:
        return None
    candidates = {entry: entry for entry in entries if not entry.startswith(".")}  # folder -> checkpoint name
    stuck: list[str] = []
    for name in sorted({n for n in map(moved_aside, entries) if n is not None and n not in entries}):
        path = os.path.abspath(os.path.join(root, name))
        aside = put_back(path)
        if aside is not None:  # a folder this process may only read: the checkpoint of its name, read where it is
            candidates[os.path.basename(aside)] = name
            stuck.append(aside)
        elif os.path.lexists(path):  # put back, by this call or by another process meanwhile
            candidates[name] = name
    for entry, name in candidates.items():
        full = os.path.join(root, entry)
        if not is_checkpoint(full):
            continue
        created = manifest_created(full)
        if created is None:
            continue  # a damaged or hostile manifest: not a candidate to resume from
        if best is None or (created, name) > best[:2]:
            best = (created, name, entry)
    if stuck:
        warnings.warn(stuck_message(root, stuck), RuntimeWarning, stacklevel=2)
    return None if best is None else os.path.abspath(os.path.join(root, best[2]))
