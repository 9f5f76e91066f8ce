"""Checks of TieredOptimizer's arguments, made once at its boundary: each error names the value and the fix."""

from __future__ import annotations

import errno
import functools
import math
import os
import shutil
import sys
from collections.abc import Callable
from typing import Any

import psutil
import torch

from io_engine import format_size

__all__ = ["check_hparams", "check_group", "check_ordered", "check_flags", "check_moments_dtype", "check_param",
           "check_unchanged", "check_nvme_path", "folder_path", "param_groups", "group_names", "check_free_space",
           "plain_name", "plain_names", "module_names", "adamw_only_defaults", "settle_groups",
           "record_fused"]  # fmt: skip

# torch.optim.AdamW's flags that change nothing here: the update is always torch's fused kernel, run eagerly.
NO_OP_FLAGS = ("foreach", "fused", "capturable")


def record_fused(group: dict[str, Any]) -> None:
    """A group's ``fused`` left None is recorded True, the kernel the update runs: torch.optim.AdamW takes the flags
    of the groups it loads, so with None a state dict resumed by AdamW(fused=True) ran its for-loop kernel from then
    on, no longer the run continued. Beside foreach=True (set since, or loaded) None, as torch, which refuses
    fused=True with it and otherwise runs fused where both are set; False as given."""
    if group.get("foreach"):
        if group.get("fused"):
            group["fused"] = None
    elif group.get("fused") is None:
        group["fused"] = True


@functools.cache
def adamw_only_defaults() -> dict[str, Any]:
    """Defaults torch.optim.AdamW puts in every param group that its constructor takes no argument for: on torch
    >= 2.6, ``decoupled_weight_decay=True``. TieredOptimizer's groups carry them too: torch.distributed.checkpoint
    needs every key of the loading optimizer's state dict in the checkpoint, so without them a checkpoint saved
    with TieredOptimizer would not load into AdamW."""
    adamw = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults  # a CPU tensor: CUDA untouched
    return {k: adamw[k] for k in ("decoupled_weight_decay",) if k in adamw}


MOMENTS_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                  "int8": torch.int8}  # fmt: skip


def check_moments_dtype(value: torch.dtype | str) -> torch.dtype:
    """torch.float32 (exact), torch.bfloat16 or torch.int8 (8-bit blockwise moments), or one of their names."""
    dtype = MOMENTS_DTYPES.get(value.lower()) if isinstance(value, str) else value
    if not isinstance(dtype, torch.dtype) or dtype not in MOMENTS_DTYPES.values():
        raise ValueError(f"moments_dtype must be torch.float32 (exact AdamW), torch.bfloat16 or 'int8' (8-bit "
                         f"blockwise moments; also torch.int8), or 'fp32'/'bf16', got {value!r}")  # fmt: skip
    return dtype


def check_hparams(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    if isinstance(lr, torch.Tensor):
        # torch's recipe for compiled steps with a scheduler, which then fill_()s it. Each step reads its value
        # (adamw_kernel.py): a CPU lr is what torch's fused AdamW reads as a number too, so the update is the same
        # bit for bit; a CUDA one would cost a device sync per chunk.
        if lr.numel() != 1:
            raise ValueError(f"a tensor lr must have one element, as torch.optim.AdamW requires, got shape "
                             f"{tuple(lr.shape)}")  # fmt: skip
        if lr.device.type != "cpu":
            raise ValueError(f"a tensor lr must be on the CPU, got one on {lr.device}: TieredOptimizer's update reads "
                             "it as a number each step; pass lr.cpu()")  # fmt: skip
        lr = lr.item()
    # Finite too: an infinite lr, eps or weight decay makes every weight NaN after one step.
    if not 0.0 <= lr < math.inf:
        raise ValueError(f"lr must be a finite number >= 0, got {lr}")
    # One tensor or numpy array of two is a pair too, as torch's AdamW takes it (the group keeps it as given).
    pair = betas.tolist() if getattr(betas, "ndim", None) == 1 else betas
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(0.0 <= b < 1.0 for b in pair)):
        raise ValueError(f"betas must be two floats in [0, 1), got {betas!r}")
    if not 0.0 <= eps < math.inf:
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    if not 0.0 <= weight_decay < math.inf:
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay}")


def check_group(group: dict[str, Any], where: str, *, given: bool = False) -> None:
    """A param group's hyperparameters and AdamW flags (after torch filled in the defaults). ``given``: the flags as
    the user gave them (the constructor's, its groups', an added group's), where fused=True beside foreach=True is
    refused by name, as torch.optim.AdamW's constructor refuses it: ``record_fused`` made the fused=True asked for
    None in silence. One set in a group since, or loaded, is not: torch's AdamW takes those (None is recorded)."""
    check_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])
    check_flags(group, where)
    if given and group.get("fused") and group.get("foreach"):
        raise RuntimeError(f"{where}: fused=True and foreach=True cannot both be set (torch.optim.AdamW refuses "
                           "them together); pass one of them: TieredOptimizer runs torch's fused kernel either "
                           "way")  # fmt: skip


def settle_groups(groups: list[dict[str, Any]]) -> None:
    """The constructor's param groups (torch's defaults filled in): each checked, its ``fused`` recorded."""
    for gi, g in enumerate(groups):
        check_group(g, f"param group {gi}", given=True)
        record_fused(g)


def check_flags(group: dict[str, Any], where: str) -> None:
    """A param group's AdamW flags: those TieredOptimizer does not run are refused by name. torch reads them from
    the groups at every step, so ``step()`` checks them too (a flag set since would otherwise be ignored), and the
    hyperparameters as the update reads them, with no range checked, as torch's does (optim/step.py: check_groups)."""
    if group.get("amsgrad", False):
        raise ValueError(f"{where}: amsgrad=True is not supported by TieredOptimizer (it would need a fourth state "
                         "row); use amsgrad=False, or torch.optim.AdamW")  # fmt: skip
    if group.get("differentiable", False):
        raise ValueError(f"{where}: differentiable=True is not supported by TieredOptimizer: its update runs "
                         "outside autograd, on state that lives on disk")  # fmt: skip
    for flag in ("maximize", "decoupled_weight_decay"):
        if not isinstance(group.get(flag, False), bool):
            raise TypeError(f"{where}: {flag} must be True or False, got {group[flag]!r}")
    # False is torch.optim.Adam's L2 weight decay (a group or state dict of Adam's): with no weight decay, the same
    # update; with one, another than the decoupled AdamW TieredOptimizer runs.
    if group.get("decoupled_weight_decay") is False and group["weight_decay"] != 0:
        raise ValueError(f"{where}: decoupled_weight_decay=False (torch.optim.Adam's L2 weight decay, weight_decay="
                         f"{group['weight_decay']}) is not supported: TieredOptimizer is AdamW, whose weight decay is "
                         "decoupled; leave it True (AdamW's), or use torch.optim.Adam")  # fmt: skip
    for flag in NO_OP_FLAGS:
        if group.get(flag) not in (None, True, False):
            raise TypeError(f"{where}: {flag} must be None, True or False, got {group[flag]!r}")


def check_param(name: str, p: torch.Tensor) -> None:
    """What the chunked state needs of a parameter when the optimizer is built."""
    if p.is_meta:  # torch.optim.AdamW makes its state at the first step; here the masters are written at build
        raise ValueError(f"parameter {name!r} is on the meta device (no data): TieredOptimizer writes its master "
                         "weights when it is built; materialize the model first (model.to_empty(device=...) and "
                         "load or initialize its weights), then build the optimizer")  # fmt: skip
    if p.is_complex():  # torch's AdamW steps them as their real views; the chunked state has no complex rows
        raise TypeError(f"parameter {name!r} is {p.dtype}: TieredOptimizer does not support complex parameters; keep "
                        "the parameter real (nn.Parameter(torch.view_as_real(z)), and torch.view_as_complex of it in "
                        "forward), or give it to a torch.optim.AdamW of its own")  # fmt: skip
    if not p.is_floating_point():
        raise TypeError(f"parameter {name!r} has dtype {p.dtype}; TieredOptimizer needs floating-point parameters")
    if p.dtype == torch.float64:
        raise TypeError(f"parameter {name!r} is float64: TieredOptimizer keeps fp32 state and would narrow it; "
                        "train it in float32 (or bf16/fp16), or use torch.optim.AdamW for float64")  # fmt: skip
    if p.is_sparse or p.layout != torch.strided:
        raise TypeError(f"parameter {name!r} has layout {p.layout}; TieredOptimizer needs dense parameters")
    if not p.is_contiguous():  # the state is laid out flat, in the row-major order of a contiguous parameter
        last = {4: torch.channels_last, 5: torch.channels_last_3d}.get(p.dim())
        if last is not None and p.is_contiguous(memory_format=last):
            how, fix = " (channels_last)", "make the model contiguous (model.to(memory_format=torch.contiguous_format))"
        else:  # a transposed or sliced weight: Module.to(memory_format=...) converts only 4-D and 5-D tensors
            how, fix = "", "make it contiguous (p.data = p.data.contiguous())"
        raise ValueError(f"parameter {name!r} is not contiguous{how}: TieredOptimizer does not support parameters in "
                         f"another memory layout; {fix} before building the optimizer")  # fmt: skip


def check_unchanged(names: list[str], params: list[torch.Tensor], layout: list[tuple[Any, Any, Any]]) -> None:
    """Before a step changes anything: every parameter as the state was laid out for (``layout``: shape,
    dtype, device each), contiguous, and with a dense gradient of its shape if any."""
    for name, p, (shape, dtype, device) in zip(names, params, layout):
        if p.shape != shape or p.dtype != dtype or p.device != device or not p.is_contiguous():
            now = f"shape {tuple(p.shape)}, {p.dtype}, on {p.device}" + ("" if p.is_contiguous() else ", strided")
            raise ValueError(f"parameter {name!r} changed after the optimizer was built (now {now}; built for "
                             f"shape {tuple(shape)}, {dtype}, contiguous, on {device}): TieredOptimizer lays its "
                             "state out once; restore the parameter or build a new optimizer")  # fmt: skip
        g = p.grad
        if g is not None and (g.is_sparse or g.layout != torch.strided):
            raise TypeError(f"parameter {name!r} has a sparse gradient: TieredOptimizer, like torch.optim.AdamW, "
                            "does not support sparse gradients (use torch.optim.SparseAdam for it)")  # fmt: skip
        if g is not None and g.shape != p.shape:
            raise ValueError(f"parameter {name!r} has a gradient of shape {tuple(g.shape)}, not {tuple(p.shape)}")


def check_nvme_path(path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"nvme_path must be a folder path (str or os.PathLike), got {type(path).__name__} {path!r}; "
                        "TieredOptimizer's second argument is nvme_path: pass lr=... by keyword")  # fmt: skip
    return folder_path(path, "nvme_path", "/mnt/nvme")


def folder_path(path: Any, name: str, example: str) -> str:
    """``path``, a folder's (a str or os.PathLike), made absolute; ``name`` and ``example`` word the errors. An empty
    one is refused (ValueError): ``""`` is what an unset variable gives, and os.path.abspath takes it for the current
    folder, which a checkpoint's save would replace and a store would fill. The one check of every folder a user
    names: the NVMe tier's root (the optimizer, TieredStore, TieredCache) and a checkpoint's (checkpoint_path)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a folder path (str or os.PathLike), got {type(path).__name__}")
    text = os.fspath(path)
    if not text:
        raise ValueError(f"{name} is empty: pass a folder, e.g. {example} (an empty path names the current folder)")
    return os.path.abspath(text)


def plain_name(name: str) -> str:
    """``name`` without its ``_orig_mod`` components: as the model names the parameter uncompiled, where those
    come from ``torch.compile`` (``plain_names`` says when they may be taken for that)."""
    return ".".join(c for c in name.split(".") if c != "_orig_mod") if "_orig_mod" in name else name


def plain_names(names: list[str], taken: Any = ()) -> list[str]:
    """The names as the model names its parameters uncompiled: ``torch.compile(module)`` wraps the module in an
    ``OptimizedModule`` that holds it as ``_orig_mod``, so its names (and those of a model holding a compiled
    block) gain ``_orig_mod.`` components. Names key the state in checkpoints, which must move between compiled
    and uncompiled runs; torch.optim.AdamW's state dicts, keyed by index, never see the difference. A model may
    also hold a submodule of its own under that attribute, beside parameters named as that submodule's: where
    stripping would give two parameters (or one of ``taken``) one name, the names stay as given. Applied to its
    own result it changes nothing, so a checkpoint's names read back (manifest.py, shardmap.py) as saved."""
    if not any("_orig_mod" in n for n in names):
        return list(names)
    stripped = [plain_name(n) for n in names]
    unique = len(set(stripped)) == len(stripped) and not set(stripped) & set(taken)
    return stripped if unique else list(names)


def module_names(module: torch.nn.Module, *, every: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The module's parameters that require grad (``every``: all of them, as ``model.parameters()`` gives them),
    named as its uncompiled model names them: without the ``_orig_mod`` components of the compiled wrappers in it
    (not of a submodule a model keeps under that name), then ``plain_names``."""
    # Only once torch._dynamo is imported can a module be compiled, so it is not imported here (it is slow).
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = eval_frame.OptimizedModule if eval_frame is not None else ()
    named = [(n, p) for n, p in module.named_parameters() if every or p.requires_grad]  # tied params appear once
    out = []
    for name, _ in named:
        *path, leaf = name.split(".")
        kept, at = [], module
        for c in path:
            if not (c == "_orig_mod" and isinstance(at, wrapper)):
                kept.append(c)
            at = at.get_submodule(c)
        out.append(".".join([*kept, leaf]))
    return list(zip(plain_names(out), (p for _, p in named)))


def check_ordered(params: Any, where: str) -> None:
    """Refuse a set of parameters in a param group, as torch.optim refuses one (also in ``add_param_group``, which
    is torch's here): its order changes between runs, and state is kept by position (``group{g}.param{i}`` names,
    torch's state dict indices), so a resumed run would give it to other parameters. A set as the whole ``params``
    argument is taken, as torch takes it (a drop-in refuses no more than AdamW does)."""
    if isinstance(params, set):
        raise TypeError(f"{where}: optimizer parameters need to be organized in ordered collections, but the "
                        "ordering of tensors in sets will change between runs. Please use a list instead (resumed "
                        "state would go to other parameters)")  # fmt: skip


def param_groups(params: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """Normalise the first argument into param-group dicts and one name per parameter. From a module, the
    parameters that require grad; from a list, every tensor, frozen ones too, as torch.optim.AdamW takes them
    (they keep no state until they take gradients: shards.py). Named parameters (``model.named_parameters()``,
    or groups of (name, tensor) pairs, as torch >= 2.6 takes them) give their names, kept in each group's
    ``param_names`` as torch keeps them; otherwise ``group{g}.param{i}``. A compiled module's names are its
    uncompiled model's (``module_names``, ``plain_names``)."""
    if isinstance(params, torch.nn.Module):
        named = module_names(params)
        if not named:
            raise ValueError("the model has no parameters that require grad")
        return [{"params": [p for _, p in named]}], [n for n, _ in named]
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or dicts (or an nn.Module), not a single tensor")
    items = list(params)
    if not items:
        raise ValueError("the optimizer got an empty parameter list")
    groups = [dict(g) for g in items] if isinstance(items[0], dict) else [{"params": items}]
    names: list[str] = []
    seen: set[int] = set()
    for gi, g in enumerate(groups):
        ps = g["params"]
        check_ordered(ps, f"param group {gi}")
        g["params"] = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        these = group_names(g, gi, names, strip=False)  # stripped below, over all the groups' names at once
        for name, p in zip(these, g["params"]):
            if id(p) in seen:
                raise ValueError(f"{name} appears twice (shared or tied parameter): pass each tensor once")
            seen.add(id(p))
        names.extend(these)
    if len({"param_names" in g for g in groups}) > 1:
        raise ValueError("some param groups have named parameters and others not: name all of them (as "
                         "model.named_parameters() gives them) or none, as torch.optim requires")  # fmt: skip
    return groups, plain_names(names)


def group_names(group: dict[str, Any], gi: int, taken: list[str], strip: bool = True) -> list[str]:
    """The names of group ``gi``'s parameters; (name, tensor) pairs in ``group["params"]`` are split into the
    tensors and ``group["param_names"]`` (torch's keys, kept as given). Each name must be new (``taken``): it
    keys the state in checkpoints, as the uncompiled model names the parameter (``plain_names``, unless not
    ``strip``)."""
    ps = group["params"]
    if any(isinstance(p, tuple) for p in ps):
        if not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in ps):
            bad = next(p for p in ps if not (isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)))
            raise TypeError(f"param group {gi} mixes (name, tensor) pairs with a {type(bad).__name__}: give every "
                            "parameter as a (name, tensor) pair, as named_parameters() does, or none")  # fmt: skip
        group["param_names"], group["params"] = [n for n, _ in ps], [p for _, p in ps]
    given = group.get("param_names")
    if given is None:
        names = [f"group{gi}.param{pi}" for pi in range(len(ps))]
    elif isinstance(given, (list, tuple)) and len(given) == len(ps) and all(isinstance(n, str) for n in given):
        names = plain_names(list(given), taken) if strip else list(given)
    else:
        raise ValueError(f"param group {gi}'s param_names must be one str a parameter ({len(ps)}), got {given!r:.80}")
    seen = set(taken)  # a set: a model of tens of thousands of tensors (MoE experts) is checked in linear time
    for name, p in zip(names, group["params"]):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{name} is a {type(p).__name__}, not a tensor")
        if name in seen:
            raise ValueError(f"two parameters are named {name!r}: names key the state (checkpoints), so each must "
                             "be unique; name them by their module path, as model.named_parameters() does")  # fmt: skip
        seen.add(name)
    return names


def check_free_space(path: str, need: int, what: str, fitting_budget: Callable[[int], int] | None = None) -> None:
    """Refuse up front when the disk at ``path`` cannot hold ``need`` bytes (the state that lives on NVMe).
    ``fitting_budget(free)``: the host_budget that would leave no more than ``free`` on disk, which the error
    then names, with what this machine's RAM allows (config.py refuses over 90 % of it)."""
    free = shutil.disk_usage(path).free
    if free >= need:
        return
    fix = "raise host_budget (state kept in host memory needs no disk)"
    if fitting_budget is not None:
        budget, ram = fitting_budget(free), psutil.virtual_memory().total
        if budget <= 0.9 * ram:
            fix = f"raise host_budget to {format_size(budget)} or more (state kept in host memory needs no disk)"
        else:
            fix = (
                f"use a disk with {format_size(need - free)} more free (this machine's RAM allows a host_budget of "
                f"at most {format_size(int(0.9 * ram))}, short of the {format_size(budget)} that would fit)"
            )
    raise OSError(
        errno.ENOSPC,
        f"nvme_path {path!r} has {format_size(free)} free, {what} needs {format_size(need)} on disk: free space there, "
        f"choose another disk, or {fix}",
    )
