"""Lightning checkpoints within the host budget: ``TieredCheckpointIO``, a ``CheckpointIO`` plugin.

Lightning's default ``TorchCheckpointIO`` saves atomically by serializing the whole checkpoint into an
in-memory buffer and writing that (so a save costs the state's size in RAM, although TieredOptimizer's
``state_dict()`` tensors are files), and loads it with a plain ``torch.load`` (the state's size again). This
plugin keeps the atomic save but streams it: ``torch.save`` into a temporary file beside the target, fsync,
rename. A save killed before its rename leaves that file; the next save removes it, as a tiered checkpoint's
next save removes a killed one's temporary folder (``tiered.checkpoint.fsops.sweep``: savers on this host whose
lock, held beside the temporary name for the save's life, is free). It loads with ``torch.load(mmap=True)``, so
the checkpoint's tensors are pages of its file until ``load_state_dict`` has streamed them into the tiers::

    from tiered.integrations.lightning import TieredCheckpointIO

    trainer = pl.Trainer(plugins=[TieredCheckpointIO()], ...)   # also Fabric(plugins=[...])
    trainer.fit(module, ckpt_path="last")

Paths that fsspec maps to another filesystem (``s3://``, ...) go to ``TorchCheckpointIO`` unchanged. Not
under ``AsyncCheckpointIO``: it clones every tensor of the checkpoint into RAM before saving in a thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import zipfile
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem  # type: ignore[import-untyped]
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem

from ..checkpoint.fsops import sweep
from ..checkpoint.hidden import HIDDEN_EXTRA, NAME_MAX, ended, hidden_name

__all__ = ["TieredCheckpointIO"]


def _local(path: Any) -> str | None:
    """``path`` as a local file name, or None where fsspec resolves it to another filesystem."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    name = os.fspath(path)
    if not isinstance(name, str) or not isinstance(get_filesystem(name), LocalFileSystem):
        return None
    return name.removeprefix("file://")


class TieredCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves stream to disk and whose local loads map the file."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        local = _local(path)
        if local is None or storage_options is not None:  # the parent raises on storage_options, by name
            return super().save_checkpoint(checkpoint, path, storage_options)
        folder = os.path.dirname(os.path.abspath(local))
        os.makedirs(folder, exist_ok=True)
        sweep(folder)  # the temporary files of savers killed on this host (preemption, the OOM killer)
        # Hidden and not *.ckpt, so that ModelCheckpoint never takes a torn one for a checkpoint; locked while this
        # save lasts (.NAME.tmp-HOST-PID-RAND.lock), so that a later save tells a dead saver's from a live one's.
        named = os.path.abspath(local)
        if len(os.fsencode(os.path.basename(local))) > NAME_MAX - HIDDEN_EXTRA:
            # A name that fits where the temp name's and its lock file's additions do not (~200-255 bytes, which
            # torch.save takes): a digest of it stands for it. sweep never reads the name part of a temp name.
            named = os.path.join(folder, hashlib.sha256(os.fsencode(os.path.basename(local))).hexdigest()[:16])
        tmp = hidden_name(named, "tmp")
        # O_EXCL: never through a planted link; 0o666 less the umask, as the file Lightning would have made.
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except BaseException:
            ended(tmp)  # never made
            raise
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, local)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        finally:
            ended(tmp)  # a file the unlink left: this process's next save sweeps it
        with contextlib.suppress(OSError):  # the rename itself survives a crash once the folder is synced
            dfd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def load_checkpoint(self, path: Any, map_location: Any = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:  # fmt: skip
        local = _local(path)
        # mmap needs torch's zip format (every torch.save since 1.6); an older file loads as Lightning loads it.
        if local is None or not os.path.isfile(local) or not zipfile.is_zipfile(local):
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        return torch.load(local, map_location=map_location, weights_only=weights_only, mmap=True)
