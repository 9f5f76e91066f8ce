"""Which modules ``offload_model`` shards one at a time (its blocks): those named, else HF's ``_no_split_modules``
(a decoder layer), else the children of the largest ``nn.ModuleList`` (or of a container in it with no forward of
its own, which FSDP2 cannot shard as a unit: a ``ModuleList([attention, feed-forward])``). FSDP2 shards each
parameter in one unit and fails at the first forward on one held in a block and anywhere else (a tied weight):
blocks found that hold one are left out, so that it joins the model's root unit (a BERT masked-LM's embeddings,
whose word embedding is its head's), and blocks named that do are refused, before anything is sharded, as are
named ones that hold nothing to stream or are containers with no forward."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, cast

from torch import nn

__all__ = ["find_blocks"]

_log = logging.getLogger("tiered")


def find_blocks(model: nn.Module, blocks: Iterable[nn.Module] | Iterable[str] | str | None = None) -> list[nn.Module]:
    """The modules to shard one by one: ``blocks`` (modules, or class names), else the submodules whose
    class HF names in ``_no_split_modules`` (a decoder layer), else the children of the largest
    ``nn.ModuleList`` (looking into those with no forward); of those found, the ones that hold a parameter held
    elsewhere too are left out (logged). ValueError, naming the fix, when none is found, or a block named holds
    such a parameter or is a container with no forward."""
    if blocks is not None:
        items = [blocks] if isinstance(blocks, str) else list(blocks)  # one class name, given alone
        if all(isinstance(b, str) for b in items):
            names = {str(b) for b in items}
            found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
            if not found:
                raise ValueError(f"blocks={sorted(names)} names no submodule class of {type(model).__name__}")
            return _checked(_outermost(found), model, explicit=True)
        if not all(isinstance(b, nn.Module) for b in items):
            raise TypeError("blocks must be nn.Modules of the model or their class names (str)")
        inside = {id(m) for m in model.modules()}
        stray = [type(b).__name__ for b in items if id(b) not in inside or b is model]
        if stray:
            raise ValueError(f"blocks {stray} are not submodules of the model: pass modules of the model itself")
        if len({id(b) for b in items}) != len(items):
            raise ValueError("blocks lists a module twice: give each block once")
        mods = cast("list[nn.Module]", items)
        nested = [(type(m).__name__, type(c).__name__) for m in mods for c in m.modules() if c is not m
                  and any(c is b for b in mods)]  # fmt: skip
        if nested:
            raise ValueError(f"blocks {list(nested[0])} are nested, one inside the other: give the outer blocks or "
                             "the inner ones, not both")  # fmt: skip
        return _checked(items, model, explicit=True)  # type: ignore[arg-type]
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if found:
        return _checked(_outermost(found), model)
    lists: list[nn.Module] = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if lists:
        return _checked(_runnable(list(max(lists, key=_numel).children())), model)
    raise ValueError(
        f"found no repeated blocks in {type(model).__name__} (no _no_split_modules, no nn.ModuleList): pass "
        "blocks=[...] (the layers to stream one at a time)"
    )


def _checked(units: list[nn.Module], model: nn.Module, explicit: bool = False) -> list[nn.Module]:
    """Blocks FSDP2 would fail on part-way, at the first forward: a parameter held both in a block and anywhere
    else (another block, or the rest of the model: a head tied to an embeddings block), and blocks given that hold
    nothing to stream (a module without parameters: counted as a block, streaming none). Found blocks that hold
    such a parameter are left out, so that it joins the model's root unit (a BERT masked-LM's embeddings, tied to
    its head); named ones are refused, by name, before anything is sharded."""
    if explicit:
        for unit in units:
            if _container(unit):
                inside = sorted({type(c).__name__ for c in _runnable([unit])})
                raise ValueError(f"block {type(unit).__name__} is a container with no forward of its own, which "
                                 f"FSDP2 cannot shard as a unit (it never runs): name the modules inside it in "
                                 f"blocks= (blocks={inside})")  # fmt: skip
            if next(unit.parameters(), None) is None:
                raise ValueError(f"block {type(unit).__name__} has no parameters: nothing of it would be streamed; "
                                 "leave it out of blocks=")  # fmt: skip
    shared = _shared(model, units)
    if not shared:
        return units
    if explicit:
        (a, a_name), (b, b_name) = shared[0]
        if b is None:
            raise ValueError(f"block {type(a).__name__} holds {a_name!r}, which the model also holds outside every "
                             f"block as {b_name!r} (tied weights): FSDP2 shards each parameter in one unit; leave "
                             f"{type(a).__name__} out of blocks= (the model's root unit then holds it)")  # fmt: skip
        raise ValueError(f"blocks {type(a).__name__} and {type(b).__name__} share a parameter ({a_name!r}, "
                         f"{b_name!r}: tied weights): FSDP2 shards each parameter in one block; leave one of them out "
                         "of blocks= (or both: the model's root unit then holds it)")  # fmt: skip
    # Every block that holds one goes: with one of two blocks left out, the other would share it with the root.
    out = {id(unit): (unit, name, other) for pair in shared for (unit, name), (_, other) in (pair, pair[::-1])
           if unit is not None}  # fmt: skip
    kept = [u for u in units if id(u) not in out]
    said = "; ".join(f"{type(u).__name__} holds {name!r}, also {other!r}" for u, name, other in out.values())
    if not kept:
        raise ValueError(f"the blocks found in {type(model).__name__} share a parameter with another block or the "
                         f"rest of the model ({said}: tied weights), so none is left to stream: pass blocks=[...] "
                         "(the layers to stream one at a time)")  # fmt: skip
    _log.info("tiered: %d of the blocks found left out, their parameters in the model's root unit, since FSDP2 "
              "shards each parameter in one unit (tied weights): %s", len(out), said)  # fmt: skip
    return kept


def _shared(model: nn.Module, units: list[nn.Module]) -> list[tuple[tuple[Any, str], tuple[Any, str]]]:
    """Each parameter held in a block and elsewhere as a pair ((block, its name there), (the other block, or
    None for the rest of the model; its name there)). Walks every registration, as ``named_parameters`` with
    ``remove_duplicate=False`` does, to see a tied weight under each of its names."""
    blocks = {id(u): u for u in units}
    held: dict[int, dict[int | None, str]] = {}  # id(parameter) -> id(block) (None: outside every block) -> name

    def walk(module: nn.Module, prefix: str, block: int | None) -> None:
        block = id(module) if id(module) in blocks else block
        for name, p in module._parameters.items():
            if p is not None:
                held.setdefault(id(p), {}).setdefault(block, prefix + name)
        for name, child in module._modules.items():
            if child is not None:
                walk(child, f"{prefix}{name}.", block)

    walk(model, "", None)
    pairs = []
    for by in held.values():
        where = sorted(by, key=lambda k: k is None)  # the blocks first, the rest of the model last
        pairs += [
            ((blocks[where[0]], by[where[0]]), (None if w is None else blocks[w], by[w]))
            for w in where[1:]
            if where[0] is not None
        ]
    return pairs


def _container(m: nn.Module) -> bool:
    """A ModuleList or ModuleDict without a forward of its own: FSDP2 refuses it as a unit (its hooks would never
    run), as ``fully_shard`` checks."""
    return isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward


def _runnable(mods: list[nn.Module]) -> list[nn.Module]:
    """``mods`` with each container without forward replaced by its children, in order, to any depth: a layer
    built as ``ModuleList([attention, feed-forward])`` (vit-pytorch, x-transformers) gives its two modules."""
    out: list[nn.Module] = []
    for m in mods:
        out += _runnable(list(m.children())) if _container(m) else [m]
    return out


def _numel(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _outermost(mods: list[nn.Module]) -> list[nn.Module]:
    """Drop blocks nested in other blocks (FSDP2 units must not overlap in an odd way; the outer one wins)."""
    nested = {id(c) for m in mods for c in m.modules() if c is not m}
    return [m for m in mods if id(m) not in nested]
