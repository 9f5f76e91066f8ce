"""Lightning checkpoints within the host budget: ``TieredCheckpointIO``, a ``CheckpointIO`` plugin.

Lightning's default ``TorchCheckpointIO`` saves atomically by serializing the whole checkpoint into an
in-memory buffer and writing that (so a save costs the state's size in RAM, although TieredOptimizer's
``state_dict()`` tensors are files), and loads it with a plain ``torch.load`` (the state's size again). This
plugin keeps the atomic save but streams it: ``torch.save`` into a temporary file beside the target, fsync,
rename. A save killed before its rename leaves that file; the next save removes it, as a tiered checkpoint's
next save removes a killed one's temporary folder (``tiered.checkpoint.fsops.sweep``: savers on this host whose
lock, held beside the temporary name for the save's life, is free). It loads with ``torch.load(mmap=True)``, so
the TieredOptimizers' states are pages of the file until ``load_state_dict`` has streamed them into the tiers,
and so are the model's weights until ``load_state_dict`` has copied them into the parameters::

    from tiered.integrations.lightning import TieredCheckpointIO

    trainer = pl.Trainer(plugins=[TieredCheckpointIO()], ...)   # also Fabric(plugins=[...])
    trainer.fit(module, ckpt_path="last")

Everything else the checkpoint holds is copied into RAM as it loads, as Lightning's own load reads it: torch's
optimizers keep the loaded tensors as their state, and callbacks theirs (``EarlyStopping``'s best score), and
one mapped tensor kept keeps the whole file mapped, its disk space held for the rest of the run once
``ModelCheckpoint`` replaces or deletes it. Which optimizer states a TieredOptimizer made is known only as the
checkpoint is saved (Lightning loads it before ``configure_optimizers`` builds the optimizers, and the states
look alike: torch's layout), so the save lists them under the key ``"tiered_optimizer_states"``, which the load takes
out again; a checkpoint saved otherwise (Lightning's own ``TorchCheckpointIO``, an earlier ``TieredCheckpointIO``,
Fabric's ``save``, whose loads without this plugin would hand the key back among the user's own) does not say, and
loads every optimizer state mapped, as a TieredOptimizer's. A listed state resumed by a torch optimizer (a run
switched from TieredOptimizer to ``torch.optim.AdamW``) stays mapped too, for the same reason: resume that
hand-over with ``TorchCheckpointIO``.

A path names the file Lightning's own would (fsspec's ``url_to_fs``: ``~`` expanded, ``file:`` and ``local:``
URLs taken). Paths that fsspec maps to another filesystem (``s3://``, ...) go to ``TorchCheckpointIO``
unchanged. Not under ``AsyncCheckpointIO``: it clones every tensor of the checkpoint into RAM before saving in
a thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import zipfile
from collections.abc import Iterator
from typing import Any

import torch
from fsspec.core import url_to_fs  # type: ignore[import-untyped]
from fsspec.implementations.local import LocalFileSystem  # type: ignore[import-untyped]
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from ..checkpoint.fsops import sweep
from ..checkpoint.hidden import HIDDEN_EXTRA, NAME_MAX, ended, hidden_name
from ..optim.state_dicts import exported
from ..store.workdir import EXPORT_PREFIX

__all__ = ["TieredCheckpointIO"]

# The key a save lists the TieredOptimizers' states under, each by its keys from the top ([["optimizer_states", 0]]).
MARK = "tiered_optimizer_states"


def _local(path: Any) -> str | None:
    """``path`` as the local file that Lightning's own ``TorchCheckpointIO`` reads and writes, or None where fsspec
    resolves it to another filesystem. Both go through fsspec's ``url_to_fs``, which expands ``~``, takes
    ``file:``, ``file://``, ``local:`` and ``local://`` URLs, and makes a relative name absolute."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    name = os.fspath(path)
    if not isinstance(name, str):
        return None
    fs, local = url_to_fs(name)
    return local if isinstance(fs, LocalFileSystem) else None


def _optimizer_state(obj: Any) -> bool:
    """Whether ``obj`` is shaped as an optimizer's ``state_dict()``."""
    return isinstance(obj, dict) and isinstance(obj.get("state"), dict) and isinstance(obj.get("param_groups"), list)


def _module_state(obj: Any) -> bool:
    """Whether ``obj`` is a module's ``state_dict()``: an OrderedDict with its ``_metadata``, which a save keeps."""
    return isinstance(obj, dict) and hasattr(obj, "_metadata")


def _made_by_tiered(state_dict: dict) -> bool:
    """Whether an optimizer's state dict is a TieredOptimizer's: its tensors are files it maps in its folder
    (optim/state_dicts.py: spans of its mappings; a resharded load's, torch.from_file's), where a torch
    optimizer's are in RAM."""
    for entry in state_dict["state"].values():
        for value in entry.values() if isinstance(entry, dict) else ():
            if type(value) is not torch.Tensor or value.device.type != "cpu":
                continue
            name = value.untyped_storage().filename
            if name is not None and os.path.basename(name).startswith(EXPORT_PREFIX) or exported(value):
                return True
    return False


def _at(obj: Any, path: list) -> Any:
    for key in path:
        try:
            obj = obj[key]
        except (KeyError, IndexError, TypeError):
            return None
    return obj


def _optimizer_states(obj: Any, path: tuple = ()) -> Iterator[tuple[tuple, dict]]:
    """Each optimizer's state dict in a checkpoint, with its keys from the top (modules' state dicts not entered)."""
    if _optimizer_state(obj):
        yield path, obj
    elif isinstance(obj, dict) and not _module_state(obj):
        for key, value in obj.items():
            yield from _optimizer_states(value, (*path, key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _optimizer_states(value, (*path, i))


def _in_ram(obj: Any, mapped: set[int], done: dict[int, Any]) -> Any:
    """``obj`` with every CPU tensor outside the containers ``mapped`` (by id) copied into RAM, in place where
    the container allows; a tensor or container met twice stays one object."""
    if id(obj) in mapped:
        return obj
    if id(obj) in done:
        return done[id(obj)]
    if isinstance(obj, torch.Tensor):
        done[id(obj)] = obj.clone() if obj.device.type == "cpu" else obj
    elif isinstance(obj, dict):
        done[id(obj)] = obj
        for key, value in obj.items():
            obj[key] = _in_ram(value, mapped, done)
    elif isinstance(obj, list):
        done[id(obj)] = obj
        obj[:] = [_in_ram(value, mapped, done) for value in obj]
    elif isinstance(obj, tuple):
        items = [_in_ram(value, mapped, done) for value in obj]
        done[id(obj)] = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)  # a namedtuple, or not
    else:
        done[id(obj)] = obj
    return done[id(obj)]


def _listed(checkpoint: Any) -> Any:
    """``checkpoint`` with the keys of the TieredOptimizers' states in it under ``MARK`` (a copy: the caller's
    dict stays as it is). Only in a Trainer's checkpoint (its ``"optimizer_states"``): Fabric hands the keys of
    a loaded dict it does not know back to its caller, who would meet ``MARK`` among their own where a load
    without this plugin reads the file; a module's or an optimizer's state dict saved alone could refuse a key it
    does not know. Those load mapped, as unlisted checkpoints do."""
    if type(checkpoint) is not dict or "optimizer_states" not in checkpoint:
        return checkpoint
    tiered = [list(path) for path, state in _optimizer_states(checkpoint)
              if _made_by_tiered(state) and all(isinstance(key, (str, int)) for key in path)]  # fmt: skip
    return {**checkpoint, MARK: tiered}


def _release(checkpoint: Any) -> Any:
    """A checkpoint loaded mapped, with all but what its consumers copy out of in RAM: the TieredOptimizers'
    states (TieredOptimizer.load_state_dict keeps nothing of the dict) and the modules' weights at the top
    (Lightning's ``"state_dict"``, Fabric's modules: ``load_state_dict`` copies them into the parameters)."""
    if not isinstance(checkpoint, dict) or _module_state(checkpoint):
        return checkpoint
    listed = checkpoint.pop(MARK, None)
    if isinstance(listed, list):
        tiered = [_at(checkpoint, path) for path in listed if isinstance(path, list)]
    else:  # saved otherwise: which were a TieredOptimizer's is not known, so each may be (the state off RAM)
        tiered = [state for _, state in _optimizer_states(checkpoint)]
    mapped = {id(state) for state in tiered if _optimizer_state(state)}
    mapped |= {id(value) for value in checkpoint.values() if _module_state(value)}
    return _in_ram(checkpoint, mapped, {})


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
                torch.save(_listed(checkpoint), f)
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
        return _release(torch.load(local, map_location=map_location, weights_only=weights_only, mmap=True))
