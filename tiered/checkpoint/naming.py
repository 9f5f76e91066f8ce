"""Names for the parameters a checkpoint's entries are: the way in from a torch optimizer's state dict, keyed by
index, and the way out to a model's state dict from a checkpoint of an optimizer built from a parameter list, keyed
by position (``group{g}.param{i}``). Both take ``model_or_named_params``: the ``nn.Module``, or ``(name,
parameter)`` pairs in the order the optimizer was given them (convert.py)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

from ..arguments import module_names, plain_names
from .errors import CheckpointMismatchError
from .manifest import ParamEntry
from .plan import holds_no_state, is_positional

__all__ = ["export_names", "named_params", "state_dict_names"]


def export_names(path: str, params: list[ParamEntry], given: Any) -> list[str]:
    """Each checkpoint entry's name in a model export: its own, a positional one (``plan.is_positional``) taken
    from ``given`` (``model_or_named_params``) at its place in the optimizer's order, checked against it. A
    checkpoint without positional names keeps its own, which ``given`` need only hold with the shapes saved: its
    count and order are not the optimizer's where the model given freezes other parameters than the one saved."""
    names = [p.name for p in params]
    positional = [n for n in names if is_positional(n)]
    if given is not None and not positional:
        _check_held(path, params, given)
        return names
    if given is None:
        if positional:
            warnings.warn(
                f"checkpoint {path} names its parameters by position ({positional[0]!r}, ...): it was saved by an "
                "optimizer built from a parameter list, and model.load_state_dict(sd, strict=False) would load none "
                "of them. Pass model_or_named_params=model (or the (name, parameter) pairs the optimizer was given, "
                "in its order) to name them as the model does",
                UserWarning,
                stacklevel=3,
            )
        return names
    named: list[tuple[str | None, torch.Tensor]]
    if isinstance(given, torch.nn.Module):
        if len({p.group for p in params}) > 1:  # a module's order is not that of the optimizer's groups
            raise ValueError(
                f"checkpoint {path} has several param groups, whose order the model does not tell: pass "
                "model_or_named_params as the (name, parameter) pairs of the optimizer's groups, in their order"
            )
        every, trainable = module_names(given, every=True), module_names(given)
        # model.parameters() as the optimizer's list, or those that require grad
        named = list(every if len(every) == len(params) else trainable)
        gives = f"{len(every)} (all of the model's) or {len(trainable)} (those that require grad)"
    else:
        named = list(_given_names(given))
        gives = str(len(named))
    if len(named) != len(params):
        raise ValueError(
            f"the checkpoint has {len(params)} parameters, model_or_named_params gives {gives}: pass the "
            "(name, parameter) pairs the optimizer was built from, in its order"
        )
    problems = []
    for k, (p, (name, t)) in enumerate(zip(params, named)):
        if not is_positional(p.name) and p.name != name:
            problems.append(f"parameter {k}: {p.name!r} in the checkpoint, {name!r} given")
        elif not holds_no_state(p) and tuple(t.shape) != p.shape:  # an entry without weights is left out anyway
            problems.append(f"{name!r}: shape {list(p.shape)} in the checkpoint, {list(t.shape)} given")
    if problems:
        raise CheckpointMismatchError(
            path, problems, "Pass the model the checkpoint was saved from, or the (name, parameter) pairs its "
            "optimizer was given, in that order."
        )  # fmt: skip
    out = [str(n) for n, _ in named]
    if len(set(out)) != len(out):
        raise ValueError("model_or_named_params: parameter names repeat; each parameter needs its own name")
    return out


def _check_held(path: str, params: list[ParamEntry], given: Any) -> None:
    """Refuse ``given`` (``model_or_named_params``) for a checkpoint whose names it does not hold, or holds with
    other shapes: the model it names is not the one the checkpoint was saved from. A module gives all of its
    parameters, frozen or not, so that the names hold whatever it freezes."""
    named = module_names(given, every=True) if isinstance(given, torch.nn.Module) else _given_names(given)
    shapes = {n: tuple(t.shape) for n, t in named}
    problems = []
    for p in params:
        if p.name not in shapes:
            problems.append(f"{p.name!r} in the checkpoint, not among the names given")
        elif not holds_no_state(p) and shapes[p.name] != p.shape:  # an entry without weights is left out anyway
            problems.append(f"{p.name!r}: shape {list(p.shape)} in the checkpoint, {list(shapes[p.name])} given")
    if problems:
        raise CheckpointMismatchError(
            path, problems, "Pass the model the checkpoint was saved from, or (name, parameter) pairs of its "
            "parameters."
        )  # fmt: skip


def _given_names(given: Any) -> list[tuple[str, torch.Tensor]]:
    named = named_params(given)
    if any(n is None for n, _ in named):
        raise TypeError(
            "model_or_named_params must name the parameters: the nn.Module, or (name, parameter) pairs, "
            "not the parameters alone"
        )
    return [(str(n), t) for n, t in named]


def named_params(obj: Any) -> list[tuple[str | None, torch.Tensor]]:
    """``model_or_named_params`` as (name, parameter) pairs: a module's parameters that require grad, named as
    ``TieredOptimizer(module)`` names them, or the pairs given (a bare parameter's name None), names made plain."""
    if isinstance(obj, torch.nn.Module):  # named as TieredOptimizer(obj) names them: a compiled one uncompiled
        return list(module_names(obj))
    if isinstance(obj, torch.Tensor) or not isinstance(obj, Iterable):
        raise TypeError(
            "model_or_named_params must be an nn.Module, or an iterable of (name, parameter) pairs "
            f"or of parameters, got {type(obj).__name__}"
        )
    out: list[tuple[str | None, torch.Tensor]] = []
    for item in obj:
        if isinstance(item, torch.Tensor):
            out.append((None, item))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
            out.append((str(item[0]), item[1]))
        else:
            raise TypeError(
                f"model_or_named_params item {len(out)} is a {type(item).__name__}, not a parameter "
                "or a (name, parameter) pair"
            )
    plain = iter(plain_names([n for n, _ in out if n is not None]))  # all at once: where they stay distinct
    return [(next(plain) if n is not None else None, p) for n, p in out]


def state_dict_names(groups: list[dict[str, Any]], named: list[tuple[str | None, torch.Tensor]]) -> list[str]:
    """One name per parameter: the state dict's param_names, else the given names, else positional."""
    out: list[str] = []
    clashes = []
    k = 0
    every = [n for g in groups for n in g.get("param_names") or () if isinstance(n, str)]
    plain = dict(zip(every, plain_names(every)))  # torch keeps a compiled model's as given
    for gi, g in enumerate(groups):
        saved_names = g.get("param_names")
        for pi in range(len(g["params"])):
            given = named[k][0]
            saved = saved_names[pi] if saved_names else None
            saved = plain.get(saved, saved) if isinstance(saved, str) else saved
            if saved is not None and given is not None and saved != given:
                clashes.append(f"parameter {k}: {saved!r} in the state dict's param_names, {given!r} given")
            out.append(saved or given or f"group{gi}.param{pi}")
            k += 1
    if clashes:
        raise CheckpointMismatchError(
            "(import)", clashes, "Pass the parameters in the order the torch optimizer was given them."
        )
    if len(set(out)) != len(out):
        raise ValueError("parameter names repeat: each parameter needs its own name")
    return out
