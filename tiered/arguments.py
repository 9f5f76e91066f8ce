"""Checks of TieredOptimizer's arguments, made once at its boundary: each error names the value and the fix."""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from io_engine import format_size

__all__ = ["check_hparams", "check_moments_dtype", "param_groups", "prepare_folder"]


def check_moments_dtype(value: torch.dtype | str) -> torch.dtype:
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    dtype = names.get(value.lower()) if isinstance(value, str) else value
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"moments_dtype must be torch.float32 or torch.bfloat16 ('fp32'/'bf16'), got {value!r}")
    return dtype


def check_hparams(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    if isinstance(lr, torch.Tensor):
        raise TypeError("lr must be a float (tensor lr is not supported)")
    if not lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"betas must be two floats in [0, 1), got {betas!r}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")


def param_groups(params: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """Normalise the first argument into param-group dicts and one name per parameter."""
    if isinstance(params, torch.nn.Module):
        named = [(n, p) for n, p in params.named_parameters() if p.requires_grad]  # tied params appear once
        if not named:
            raise ValueError("the model has no parameters that require grad")
        return [{"params": [p for _, p in named]}], [n for n, _ in named]
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or dicts (or an nn.Module), not a single tensor")
    items = list(params)
    if not items:
        raise ValueError("the optimizer got an empty parameter list")
    groups = [dict(g) for g in items] if isinstance(items[0], dict) else [{"params": items}]
    names, seen = [], set()
    for gi, g in enumerate(groups):
        ps = g["params"]
        g["params"] = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        for pi, p in enumerate(g["params"]):
            name = f"group{gi}.param{pi}"
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{name} is a {type(p).__name__}, not a tensor")
            if not p.requires_grad:
                raise ValueError(f"{name} (shape {tuple(p.shape)}) does not require grad: leave it out, "
                                 "or set requires_grad=True")  # fmt: skip
            if id(p) in seen:
                raise ValueError(f"{name} appears twice (shared or tied parameter): pass each tensor once")
            seen.add(id(p))
            names.append(name)
    return groups, names


def prepare_folder(path: str, need: int) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".write-probe")
        with open(probe, "wb") as f:
            f.write(b"ok")
        os.unlink(probe)
    except OSError as e:
        raise type(e)(e.errno, f"nvme_path {path!r} cannot be written ({e.strerror}): choose a writable folder") from e
    free = shutil.disk_usage(path).free
    if free < need:
        raise OSError(
            28,
            f"nvme_path {path!r} has {format_size(free)} free, the optimizer state needs {format_size(need)}: "
            "free space there or choose another disk",
        )
