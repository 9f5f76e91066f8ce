"""The ranks' optimizers compared when they are built: what every rank of the parameters' mesh must build alike.

Under FSDP2 (or tensor parallel) the step holds a collective that torch's AdamW has not: ``max_grad_norm``'s
all-reduce of the gradient norms (shards.py), which every rank of the mesh joins, with one entry a parameter. A
rank built without the clip (a per-node config, an environment variable one node lacks) leaves the others waiting
in it until the process group's timeout (30 minutes by default), which then fails with a timeout naming nothing;
ranks passing other parameters send vectors of other lengths (gloo aborts the process; NCCL may hang or mix the
numbers up). So the constructor gathers, over the mesh, what decides the step's collectives: whether it clips, and
the parameters (how many a group; each one's global shape and placements). Where any differ, every rank raises the
same ``ValueError``, naming what differs and on which ranks. Hyperparameters that change only the numbers (lr,
moments_dtype, the budgets) are not compared, as torch's AdamW compares none.

Cost: one ``all_gather_object`` a mesh dimension with more than one rank (one under FSDP2), of a few bytes a
parameter, once. Each gathers what the ranks before it gathered, so after the last every rank holds every
rank's; a mesh of one rank gathers nothing. Every rank of the mesh must build its optimizer (it always must: each
holds pieces of the same parameters).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from .shards import Shards

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["check_ranks_agree"]


class _Built(NamedTuple):
    """One rank's optimizer, as far as the step's collectives depend on it."""

    clips: bool
    group_sizes: tuple[int, ...]
    params: tuple[tuple[tuple[int, ...], str], ...]  # each parameter's global shape and placements


def check_ranks_agree(shards: Shards, names: list[str], param_groups: list[dict[str, Any]],
                      max_grad_norm: float | None) -> None:  # fmt: skip
    """Raise ``ValueError`` on every rank of ``shards``' mesh where the ranks built their optimizers differently
    (see the module's docstring); nothing outside a process group, nor over plain (not DTensor) parameters."""
    mesh = shards.mesh
    if mesh is None:
        return
    import torch.distributed as dist

    mine = _Built(max_grad_norm is not None, tuple(len(g["params"]) for g in param_groups),
                  tuple((tuple(p.shape), str(cast("DTensor", p).placements)) for p in shards.params))  # fmt: skip
    seen: dict[int, _Built] = {dist.get_rank(): mine}
    for d in range(mesh.ndim):
        group = mesh.get_group(d)
        if group.size() > 1:
            out: list[Any] = [None] * group.size()
            dist.all_gather_object(out, seen, group=group)
            seen = {r: b for part in out for r, b in cast("dict[int, _Built]", part).items()}
    problem = _difference(seen, names)
    if problem is not None:
        raise ValueError(f"the ranks built TieredOptimizer differently: {problem}")


def _difference(seen: dict[int, _Built], names: list[str]) -> str | None:
    """What differs between the ranks' ``_Built`` (the first thing, in the order below), or None."""
    split = _by({r: b.clips for r, b in seen.items()})
    if len(split) > 1:
        return (f"max_grad_norm is set on {split[True]} and None on {split[False]}. Every rank must clip, or none: "
                "the clip's global norm is a collective that every rank joins")  # fmt: skip
    split = _by({r: b.group_sizes for r, b in seen.items()})
    if len(split) > 1:
        return ("they pass different parameters: " + "; ".join(f"groups of {list(k)} parameters on {v}"
                for k, v in split.items()) + ". Every rank must pass the same parameters, in the same order "
                "(each holds its own pieces of them), an empty local shard's included")  # fmt: skip
    for i, name in enumerate(names):
        split = _by({r: b.params[i] for r, b in seen.items()})
        if len(split) > 1:
            return (f"parameter {name!r} is " + "; ".join(f"of shape {list(k[0])}, placed {k[1]}, on {v}"
                    for k, v in split.items()) + ". Every rank must pass the same parameters, in the same order, "
                    "sharded alike")  # fmt: skip
    return None


def _by(values: dict[int, Hashable]) -> dict[Any, str]:
    """The ranks by their value: ``{value: "ranks 0, 2"}``, in rank order."""
    out: dict[Any, list[int]] = {}
    for rank in sorted(values):
        out.setdefault(values[rank], []).append(rank)
    return {k: ("rank " if len(v) == 1 else "ranks ") + ", ".join(map(str, v)) for k, v in out.items()}
