"""Which modules ``offload_model`` shards one at a time (its blocks): those named, else HF's decoder layers, else
the children of the largest ``nn.ModuleList``; refused, before anything is sharded, where FSDP2 would fail part-way
or a block would stream nothing."""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

from torch import nn

__all__ = ["find_blocks"]


def find_blocks(model: nn.Module, blocks: Iterable[nn.Module] | Iterable[str] | str | None = None) -> list[nn.Module]:
    """The modules to shard one by one: ``blocks`` (modules, or class names), else the submodules whose
    class HF names in ``_no_split_modules`` (a decoder layer), else the children of the largest
    ``nn.ModuleList``. ValueError, naming the fix, when none is found."""
    if blocks is not None:
        items = [blocks] if isinstance(blocks, str) else list(blocks)  # one class name, given alone
        if all(isinstance(b, str) for b in items):
            names = {str(b) for b in items}
            found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
            if not found:
                raise ValueError(f"blocks={sorted(names)} names no submodule class of {type(model).__name__}")
            return _checked(_outermost(found), explicit=True)
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
        return _checked(items, explicit=True)  # type: ignore[arg-type]
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if found:
        return _checked(_outermost(found))
    lists: list[nn.Module] = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if lists:
        return _checked(list(max(lists, key=_numel).children()))
    raise ValueError(
        f"found no repeated blocks in {type(model).__name__} (no _no_split_modules, no nn.ModuleList): pass "
        "blocks=[...] (the layers to stream one at a time)"
    )


def _checked(units: list[nn.Module], explicit: bool = False) -> list[nn.Module]:
    """Refuse, before anything is sharded, blocks FSDP2 would fail on part-way (a parameter in two of them) and
    blocks given that hold nothing to stream (a module without parameters: counted as a block, streaming none)."""
    owner: dict[int, nn.Module] = {}
    for unit in units:
        params = list(unit.parameters())
        if explicit and not params:
            raise ValueError(f"block {type(unit).__name__} has no parameters: nothing of it would be streamed; "
                             "leave it out of blocks=")  # fmt: skip
        for p in params:
            first = owner.setdefault(id(p), unit)
            if first is not unit:
                raise ValueError(f"blocks {type(first).__name__} and {type(unit).__name__} share a parameter (tied "
                                 "weights): FSDP2 shards each parameter in one block; leave one of them out of "
                                 "blocks= (or both: the model's root unit then holds it)")  # fmt: skip
    return units


def _numel(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _outermost(mods: list[nn.Module]) -> list[nn.Module]:
    """Drop blocks nested in other blocks (FSDP2 units must not overlap in an odd way; the outer one wins)."""
    nested = {id(c) for m in mods for c in m.modules() if c is not m}
    return [m for m in mods if id(m) not in nested]
