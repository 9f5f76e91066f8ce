"""Leaving tiered, or coming to it, mid-run: checkpoints to and from torch.optim.AdamW state dicts.

    sd = export_torch_state_dict(path)            # {"state", "param_groups"} as torch.optim.AdamW makes
    torch.optim.AdamW(model.parameters()).load_state_dict(sd)
    model.load_state_dict(export_model_state_dict(path, model_or_named_params=model), strict=False)   # the weights

    import_torch_state_dict(adamw.state_dict(), model, path)   # a checkpoint; then opt.load_checkpoint(path)

Both materialize the state in host memory (a torch state dict is in memory by nature): they are for
models that fit, as the way in or out. Parameter i of the torch dict is the i-th parameter the torch
optimizer was given, across its groups in order (torch's own numbering); its name comes from the group's
``param_names`` (torch >= 2.6 keeps them when the optimizer is built from ``named_parameters()``), else
from ``model_or_named_params`` in that order.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from io_engine import IOConfig

from .errors import CheckpointCorruptError, CheckpointMismatchError, InsufficientMemoryError
from .manifest import ELEMENT_BYTES, Manifest, ParamEntry, dtype_name, json_view
from .naming import export_names, named_params, state_dict_names
from .plan import holds_no_state
from .reader import CheckpointReader
from .reshard import Parts
from .save import manifest_estimate, objects_blob, saved_groups, versions
from .shardmap import Shard, row_numel
from .validate import Invalid, check_group, checkpoint_path
from .writer import CheckpointWriter

SEGMENT_ELEMENTS = 16 << 20  # an imported parameter is split into CRC segments of at most 64 MiB


def export_torch_state_dict(
    path: str | os.PathLike[str], *, param_names: bool = True, weights_only: bool = True, io: IOConfig | None = None
) -> dict[str, Any]:
    """The checkpoint's optimizer state as ``torch.optim.AdamW.state_dict()`` lays it out, every byte checked.

    The checkpoint is checked as ``load_checkpoint`` checks it (its param groups included) before any tensor
    is allocated, and tensors are sized from the manifest only once the files' sizes agree with it.
    Hyperparameters of torch's AdamW that the checkpoint lacks (``amsgrad``, ``foreach``, ...) get its
    defaults. ``param_names`` adds each group's names (torch >= 2.6 format; older torch ignores the key).
    A parameter kept in lower precision also gets ``"master"`` (its fp32 master weights), as
    ``TieredOptimizer.state_dict()`` does.
    """
    with _open(path) as parts:  # once: a save committed meanwhile cannot mix two checkpoints' rows and groups
        reader, params = whole_params(parts)
        objs = reader.objects(weights_only=weights_only)
        rows = read_whole(parts, params, rows=(0, 1, 2), io=io)
    defaults = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults
    state: dict[int, dict[str, torch.Tensor]] = {}
    groups = []
    index = 0
    for gi, saved in enumerate(objs["param_groups"]):
        group = {**defaults, **{k: v for k, v in saved.items() if k not in ("params", "param_names")}}
        members = [i for i, p in enumerate(params) if p.group == gi]
        group["params"] = list(range(index, index + len(members)))
        if param_names:
            group["param_names"] = [params[i].name for i in members]
        for j, i in enumerate(members):
            p = params[i]
            if p.step == 0:
                continue  # torch keeps no state for a parameter that was never stepped
            s = {
                "step": torch.tensor(float(p.step), dtype=torch.float32),
                "exp_avg": rows[1][i],
                "exp_avg_sq": rows[2][i],
            }
            if p.dtype != "float32":
                s["master"] = rows[0][i]
            state[index + j] = s
        index += len(members)
        groups.append(group)
    return {"state": state, "param_groups": groups}


def export_model_state_dict(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    io: IOConfig | None = None,
    model_or_named_params: Any = None,
) -> dict[str, torch.Tensor]:
    """The trained parameters by name, from the fp32 master weights cast to each parameter's saved dtype
    (or ``dtype``, a floating torch dtype). Load with ``model.load_state_dict(sd, strict=False)``: buffers are not
    in a checkpoint, nor are parameters frozen at the save (it holds no weights for them: the model keeps its own).

    An optimizer built from a parameter list (``TieredOptimizer(model.parameters())``) names them by position,
    ``group{g}.param{i}``, which no model has: ``model_or_named_params`` (the ``nn.Module``, whose parameters, all
    or those that require grad, are taken in ``named_parameters()`` order, or the ``(name, parameter)`` pairs the
    optimizer was given, in its order) names them as the model does, checked against the checkpoint's count and
    shapes. Without it such names are kept, with a warning: ``load_state_dict`` would take none of them. A
    checkpoint already named as the model names them (``TieredOptimizer(model)``) keeps its names whatever the
    model given freezes: they are only checked to be the model's, with the shapes saved."""
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a floating torch.dtype (e.g. torch.bfloat16) or None, got {dtype!r}")
    if dtype is not None and not dtype.is_floating_point:  # an integer dtype would truncate every weight
        raise ValueError(f"dtype must be a floating torch.dtype (e.g. torch.bfloat16) or None, got {dtype}")
    with _open(path) as parts:
        _, params = whole_params(parts)
        names = export_names(parts.root, params, model_or_named_params)  # checked before any row is read
        masters = read_whole(parts, params, rows=(0,), io=io)[0]  # the empty ones too: every byte checked
    return {
        n: m.to(dtype or getattr(torch, p.dtype)) for n, p, m in zip(names, params, masters) if not holds_no_state(p)
    }


def _open(path: str | os.PathLike[str]) -> Parts:
    return Parts(checkpoint_path(path))  # "" refused: it would name the current folder


def whole_params(parts: Parts) -> tuple[CheckpointReader, list[ParamEntry]]:
    """The checkpoint's first part (the whole of a single-process one) and every parameter, whole: for a
    checkpoint saved by several ranks, global shapes (as a plain process loads it). An entry that holds no state
    (``plan.holds_no_state``: frozen at the save) stays as it is, empty; the exports leave it out."""
    first, shards = parts.reader(0), parts.shards
    if shards is None:
        return first, list(first.manifest.params)
    local = {p.name: p for p in first.manifest.params}
    params, offset = [], 0
    for s in shards.ranks[0]:
        p, numel = local[s.name], math.prod(s.shape)
        params.append(ParamEntry(s.name, s.shape, p.dtype, offset, numel, p.group, p.step))
        offset += numel
    return first, params


def read_whole(
    parts: Parts, params: list[ParamEntry], *, rows: tuple[int, ...], io: IOConfig | None
) -> dict[int, list[torch.Tensor]]:
    """Each requested row of each parameter (``whole_params``) as an fp32 tensor of its global shape, every byte
    checked, gathered from every rank's part for a sharded checkpoint. The host memory it needs is checked
    against what is available before anything is allocated: a manifest may claim any size."""
    need = len(rows) * ELEMENT_BYTES * sum(p.numel for p in params)
    free = available_memory()
    fix = (
        "load it into a TieredOptimizer instead (opt.load_checkpoint(path): it streams within host_budget, and "
        "its state_dict() lives on disk), or export on a machine with more memory"
    )
    path = parts.root
    if need > free:
        raise InsufficientMemoryError(path, need, free, fix)
    try:
        out = {r: [torch.empty(p.shape, dtype=torch.float32) for p in params] for r in rows}
    except RuntimeError as e:  # the allocator refused (overcommit rules): the same situation, by name
        raise InsufficientMemoryError(path, need, free, fix) from e
    for k, held in enumerate(parts.held):
        _read_part(parts.reader(k), held, params, out, rows, io)
    return out


def _read_part(reader: CheckpointReader, held: list[Shard], params: list[ParamEntry],
               out: dict[int, list[torch.Tensor]], rows: tuple[int, ...], io: IOConfig | None) -> None:  # fmt: skip
    """Part ``reader``'s rows of every parameter, into their places in ``out``."""
    try:
        where = {p.name: i for i, p in enumerate(params)}
        dest = {
            r: [out[r][where[s.name]].view(-1)[s.first * row_numel(s.shape) : (s.first + s.rows) * row_numel(s.shape)]
                for s in held]
            for r in rows
        }  # fmt: skip
        entries = {p.name: p for p in reader.manifest.params}
        read_into(reader, [entries[s.name] for s in held], dest, io)
    finally:
        reader.close()


def available_memory() -> int:
    """Bytes of host memory available without swapping (MemAvailable), or all of it where that is unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def read_into(
    reader: CheckpointReader, params: list[ParamEntry], dest: dict[int, list[torch.Tensor]], io: IOConfig | None
) -> None:
    """Read each row ``r`` of each parameter into the flat fp32 ``dest[r][i]``, CRC-checked: every byte of each
    row file read (its segments must all be complete)."""
    with reader.stream(io) as s:
        for r, outs in dest.items():
            reads = [(p, t, s.read(r, p.offset, t)) for p, t in zip(params, outs)]
            for p, t, fut in reads:
                s.wait(fut)
                bad = s.check(r, p.offset, t)
                if bad:
                    raise CheckpointCorruptError(reader.path, bad)
        bad = [b for r in dest for b in s.checkers[r].finish()]
        if bad:
            raise CheckpointCorruptError(reader.path, bad)


def import_torch_state_dict(
    opt_state_dict: dict[str, Any],
    model_or_named_params: Any,
    path: str | os.PathLike[str],
    *,
    extra: dict[str, Any] | None = None,
    scheduler: Any = None,
    step: int | None = None,
    keep_last: int | None = None,
    io: IOConfig | None = None,
) -> str:
    """Write a tiered checkpoint at ``path`` from a ``torch.optim.AdamW`` (or Adam with decoupled weight decay)
    state dict and the parameters it belongs to. Returns the checkpoint's path.

    ``model_or_named_params``: the ``nn.Module`` (its parameters that require grad, in
    ``named_parameters()`` order, as ``TieredOptimizer(model)`` takes them), an iterable of
    ``(name, parameter)`` pairs, or of parameters (then named ``group{g}.param{i}``, as TieredOptimizer names
    a parameter list), in the order the torch optimizer was given them. Their values are the master weights
    (the ``"master"`` entry of a state wins, for low-precision parameters). ``scheduler``: an lr scheduler or
    its state dict. ``step``: the optimizer step count to record (default: the largest parameter step).
    """
    path = checkpoint_path(path)  # first: "" (an unset variable) is refused, not taken for the current folder
    groups, state = _check_state_dict(opt_state_dict)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step must be an int >= 0 (the optimizer step count to record) or None, got {step!r}")
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict (e.g. {{'epoch': 3}}) or None, got {type(extra).__name__}")
    if (
        scheduler is not None
        and not isinstance(scheduler, dict)
        and not callable(getattr(scheduler, "state_dict", None))
    ):
        raise TypeError(f"scheduler must be an lr scheduler or its state_dict(), got {type(scheduler).__name__}")
    named = named_params(model_or_named_params)
    ids = [i for g in groups for i in g["params"]]
    if len(named) != len(ids):
        raise ValueError(
            f"the state dict has {len(ids)} parameters, model_or_named_params gives {len(named)}: pass "
            "the (name, parameter) pairs the torch optimizer was built from, in its order"
        )
    names = state_dict_names(groups, named)
    params, masters, moments, offset, problems = [], [], [], 0, []
    k = 0
    for gi, g in enumerate(groups):
        for pid in g["params"]:
            name, tensor = names[k], named[k][1].detach()
            k += 1
            s = state.get(pid) or {}
            if "max_exp_avg_sq" in s:
                problems.append(f"{name!r}: has max_exp_avg_sq (amsgrad), which tiered does not implement")
            for key in ("exp_avg", "exp_avg_sq", "master"):
                if key in s and tuple(s[key].shape) != tuple(tensor.shape):
                    problems.append(
                        f"{name!r}: {key} has shape {list(s[key].shape)}, the parameter {list(tensor.shape)}"
                    )
            saved_step = float(s["step"]) if "step" in s else 0.0
            if not (math.isfinite(saved_step) and saved_step >= 0):
                problems.append(f"{name!r}: its step is {saved_step}, not a count >= 0")
                saved_step = 0.0
            n = tensor.numel()
            params.append(
                ParamEntry(
                    name,
                    tuple(tensor.shape),
                    dtype_name(tensor.dtype),
                    offset,
                    n,
                    gi,
                    int(saved_step),
                )
            )
            masters.append(s.get("master", tensor))
            moments.append((s.get("exp_avg"), s.get("exp_avg_sq")))
            offset += n
    if problems:
        raise CheckpointMismatchError("(import)", problems, "Pass the parameters the state dict belongs to.")
    sched_state = scheduler.state_dict() if callable(getattr(scheduler, "state_dict", None)) else scheduler
    # plain numbers, as a save stores them (a tensor lr or betas, a numpy lr), then checked
    clean = [{k: v for k, v in g.items() if k != "param_names"} for g in saved_groups(groups)]
    for gi, g in enumerate(clean):  # what load_checkpoint will demand of them: refused now, not after writing
        try:
            check_group(g, gi)
        except Invalid as e:
            raise ValueError(f"opt_state_dict: {e}; import the state dict of an optimizer that could train") from e
    blob, weights_only = objects_blob(clean, sched_state, extra)
    writer = CheckpointWriter(
        path,
        numel=offset,
        objects=blob,
        io=io,
        keep_last=keep_last,
        manifest_bytes=manifest_estimate(len(params), 3 * len(params) + offset // SEGMENT_ELEMENTS),
    )
    with writer:
        for p, master, (m, v) in zip(params, masters, moments):
            for r, src in enumerate((master, m, v)):
                f32 = torch.float32  # whatever the default dtype: the rows are fp32
                flat = (torch.zeros(p.numel, dtype=f32) if src is None else src.detach().to("cpu", f32)).reshape(-1)
                flat = flat.contiguous()
                futs = [
                    writer.write(r, p.offset + a, flat[a : a + SEGMENT_ELEMENTS])
                    for a in range(0, p.numel, SEGMENT_ELEMENTS)
                ]
                for f in futs:
                    writer.wait(f)
        manifest = Manifest(
            step=max((p.step for p in params), default=0) if step is None else int(step),
            params=params,
            files={},
            param_groups=[json_view(g) for g in clean],
            has_scheduler=sched_state is not None,
            extra_keys=sorted(str(k) for k in (extra or {})),
            objects_weights_only=weights_only,
            source={"imported": "torch.optim state_dict"},
            versions=versions(),
        )
        return writer.commit(manifest)


def _check_state_dict(sd: Any) -> tuple[list[dict[str, Any]], dict[Any, dict[str, Any]]]:
    if (
        not isinstance(sd, dict)
        or not isinstance(sd.get("param_groups"), list)
        or not isinstance(sd.get("state"), dict)
    ):
        raise ValueError(
            "opt_state_dict must be a torch optimizer's state_dict(): a dict with 'state' (dict) and "
            "'param_groups' (list)"
        )
    for gi, g in enumerate(sd["param_groups"]):
        if not isinstance(g, dict) or not isinstance(g.get("params"), list):
            raise ValueError(f"param_groups[{gi}] has no 'params' list: not a torch optimizer state_dict")
        if g.get("amsgrad"):
            raise ValueError(
                f"param_groups[{gi}] uses amsgrad=True, which tiered does not implement: train "
                "without amsgrad, or stay with torch"
            )
        if g.get("decoupled_weight_decay") is False and g.get("weight_decay", 0):
            raise ValueError(
                f"param_groups[{gi}] is torch.optim.Adam with L2 weight decay (weight_decay="
                f"{g['weight_decay']}); tiered is AdamW (decoupled). Import an AdamW state dict"
            )
        for key in ("lr", "betas", "eps", "weight_decay"):
            if key not in g:
                raise ValueError(f"param_groups[{gi}] lacks {key!r}: not an Adam/AdamW state_dict")
    return sd["param_groups"], sd["state"]
