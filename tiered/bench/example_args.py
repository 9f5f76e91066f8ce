"""The checks examples/*.py (and bench/ds_big.py, through big_model.py's flags) make before anything is built.

A bad flag is answered with one line naming it and argparse's exit status 2. Otherwise torch or transformers
would print a traceback, or the script would find the problem only after it had built a model or ended a run
(a path it cannot write). The argparse types (``device``, ``output_file``) raise ``ArgumentTypeError``. The
checks that look at several flags return the problem, or None, for the script's ``p.error``.
``exit_on_sigterm`` makes a SIGTERM end a run as Ctrl-C does, through the ``with`` blocks that remove its files.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from io_engine import format_size

from ..checkpoint.manifest import ELEMENT_BYTES, ROW_FILES
from ..config import TierConfig
from .arg_types import size

__all__ = [
    "check_model_args",
    "device",
    "exit_on_sigterm",
    "folder_problem",
    "keep_arg",
    "llama_shape_problem",
    "optimizer_problem",
    "output_file",
    "save_problem",
    "save_room_problem",
    "size_or_auto",
]

CHECKPOINT_BYTES = ELEMENT_BYTES * len(ROW_FILES)  # a checkpoint's rows a parameter: fp32 masters, m and v


def device(text: str) -> torch.device:
    """``--device``: cpu, cuda or cuda:N. For a typo, torch's own error is a traceback. Other device types
    (mps, meta) are not ones the examples run on."""
    try:
        d = torch.device(text)
    except RuntimeError:
        d = None
    if d is None or d.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return d


def size_or_auto(text: str) -> str | int:
    """A budget flag (``--gpu-budget``): ``auto``, or a size such as 40GiB, in bytes."""
    return text if text == "auto" else size(text)


def keep_arg(value: str) -> str | int:
    """examples/big_model.py's --keep-for-backward: auto, on, off, room, or a number of blocks."""
    if value in ("auto", "on", "off", "room"):
        return value
    if value.isdigit():
        return int(value)
    raise argparse.ArgumentTypeError(f"auto, on, off, room or a number of blocks, got {value!r}")


def output_file(text: str) -> str:
    """A file a run writes at its end (``--json``, ``--trace``). Its folder must exist and be writable, so that
    a bad path is refused now, not after the run, when the figures would be lost."""
    path = Path(text).expanduser().absolute()
    try:
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a folder; name a file in it")
        if not path.parent.is_dir():
            raise argparse.ArgumentTypeError(f"the folder {path.parent} does not exist: make it first")
    except OSError as e:  # a folder on the way that this user may not enter
        raise argparse.ArgumentTypeError(str(e)) from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"the folder {path.parent} is not writable")
    return user_path(text)


def user_path(text: str) -> str:
    """A path flag as the run uses it: ``~`` expanded, as the checks read it (``--save=~/ckpt`` is not expanded
    by the shell, and a literal ``~`` folder in the working directory is not what the user named)."""
    return os.path.expanduser(text)


def _existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists: what a ``mkdir -p`` of it would start from."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def folder_problem(flag: str, path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be a folder this process makes (with its parents) and writes into, or None."""
    return _unwritable(flag, path, Path(path).expanduser().absolute())


def _unwritable(flag: str, path: str | os.PathLike[str], folder: Path) -> str | None:
    try:
        base = _existing(folder)
        is_dir = base.is_dir()
    except OSError as e:  # a folder on the way that this user may not enter
        return f"{flag} {path}: {e}"
    if not is_dir:
        return f"{flag} {path}: {base} is a file, not a folder"
    if not os.access(base, os.W_OK | os.X_OK):
        return f"{flag} {path}: {base} is not writable"
    return None


def save_problem(save: str, nvme_path: str) -> str | None:
    """Why a checkpoint cannot be saved to the folder ``save`` at the end of a run whose optimizer works under
    ``nvme_path``, or None. A save replaces only a checkpoint (or an empty folder), and writes beside it before a
    rename, so its parent must be writable. The optimizer's folder (or one that will hold it) is no place for it:
    by the end of the run it holds the state."""
    full, state = Path(save).expanduser().resolve(), Path(nvme_path).expanduser().resolve()
    if full == state or full in state.parents:
        return f"--save {save} would hold the optimizer's state folder (--nvme-path {nvme_path}): choose another path"
    try:
        empty = full.is_dir() and not any(full.iterdir())
        taken = full.exists() and not (full / "manifest.json").is_file() and not empty
    except OSError as e:
        return f"--save {save}: {e}"
    if taken:
        return (f"--save {save} exists and is not a tiered checkpoint (no manifest.json); a save replaces only a "
                "checkpoint: choose another path")  # fmt: skip
    return _unwritable("--save", save, full.parent)


def save_room_problem(save: str, params: int) -> str | None:
    """Why the disk of ``save`` cannot hold a checkpoint of ``params`` parameters, or None. This counts the
    rows alone (12 bytes a parameter), less than the save needs, so it refuses only what cannot fit."""
    need, free = CHECKPOINT_BYTES * params, shutil.disk_usage(_existing(Path(save).expanduser().absolute())).free
    if free < need:
        return (f"--save {save}: the checkpoint needs more than {format_size(need)} (12 bytes a parameter), and "
                f"{format_size(free)} is free there: free some, or save to another disk")  # fmt: skip
    return None


def llama_shape_problem(hidden: int, heads: int, kv_heads: int | None) -> str | None:
    """Why LlamaForCausalLM cannot take these widths, or None (``kv_heads`` None: as many as ``heads``).
    transformers refuses them only when it builds the model. It refuses key-value heads that do not divide
    the heads only at the first forward, after the optimizer is built."""
    if hidden % heads:
        return f"--hidden {hidden} is not divisible by --heads {heads}"
    if hidden // heads % 2:
        return f"--hidden / --heads is a head's width, {hidden // heads} here; rotary embeddings need it even"
    if kv_heads is not None and (kv_heads < 1 or heads % kv_heads):
        return f"--kv-heads {kv_heads} must be >= 1 and divide --heads {heads} (grouped-query attention)"
    return None


def optimizer_problem(**knobs: Any) -> str | None:
    """What ``TieredOptimizer`` would refuse in its keyword-only ``knobs`` (``TierConfig``'s checks: a chunk_bytes
    under a page, a host budget over 90 % of RAM, a max_grad_norm of 0 or less), or None: a script asks before it
    builds a model, which the optimizer is built after."""
    try:
        TierConfig(**knobs)
    except (ValueError, TypeError) as e:
        return str(e)
    return None


def check_model_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """examples/big_model.py's model and training flags (bench/ds_big.py shares them)."""
    for name in ("steps", "batch", "seq", "accumulate", "hidden", "layers", "heads", "inter", "vocab"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    problem = llama_shape_problem(args.hidden, args.heads, args.kv_heads)
    if problem:
        p.error(problem)


def exit_on_sigterm(script: str) -> None:
    """From now on, SIGTERM (from timeout or a job scheduler) raises SystemExit(143) in the main thread. The run
    then ends through its ``with`` blocks, which remove its state or page files, as after Ctrl-C. Python's default
    would end the process at once and leave them. An optimizer step holds the signal until it has ended
    (tiered/interrupts.py)."""

    def stop(signum: int, frame: FrameType | None) -> None:
        print(f"{script}: terminated by SIGTERM; removing its files", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
