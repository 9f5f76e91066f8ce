"""An offloaded model's state dicts at world size 1, as without offload: ``state_dict()`` of the model and of any
module in it holds plain tensors, ``load_state_dict`` takes them (checking their shapes as torch does), and
``plain_tensors`` does the same for an optimizer's state dict.

A shard over one rank is the whole parameter. Frameworks save the model through its state dict (HF
``save_pretrained`` through safetensors, which cannot read a DTensor's storage; accelerate's ``save_state``;
Lightning's checkpoint) and load plain files back, and the files are those of a run without offload, loadable
with or without it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..optim.shards import sharded_like

__all__ = ["holders", "plain_state_dicts", "plain_tensors"]


def holders(model: nn.Module) -> dict[nn.Module, nn.Module]:
    """Each module of ``model`` with parameters of its own -> their unit (the innermost FSDP module holding it):
    the state dict hooks go on each, as a submodule's own ``state_dict()`` runs only the hooks in its tree."""
    from torch.distributed.fsdp import FSDPModule

    unit_of: dict[nn.Module, nn.Module] = {}
    for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):  # outer units first: inner ones win
        unit_of.update((m, unit) for m in unit.modules())
    return {m: u for m, u in unit_of.items() if any(p is not None for p in m._parameters.values())}


def plain_state_dicts(model: nn.Module) -> None:
    """Make ``state_dict()`` of the model and of any module in it (peft's ``merge_and_unload()`` returns one)
    hold plain tensors and ``load_state_dict`` take them. Each module's hooks see to its own parameters (a tied
    weight under each name). A plain tensor is made a DTensor only where its shape is the parameter's: labelled
    with the parameter's shape, one of another shape would pass torch's check and be broadcast into the shard
    (a ``[1]`` into a ``[32]``); left plain, torch reports the size mismatch as without offload."""
    from torch.distributed.tensor import DTensor

    def to_plain(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        for name in module._parameters:
            if isinstance(value := state_dict.get(prefix + name), DTensor):
                state_dict[prefix + name] = value.to_local()

    def to_dtensor(module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
        for name, param in module._parameters.items():
            value = state_dict.get(prefix + name)
            if (
                isinstance(param, DTensor)
                and isinstance(value, torch.Tensor)
                and not isinstance(value, DTensor)
                and value.shape == param.shape
            ):
                state_dict[prefix + name] = sharded_like(value.to(param.to_local().device), param)

    for module in holders(model):
        module.register_state_dict_post_hook(to_plain)
        module.register_load_state_dict_pre_hook(to_dtensor)


def plain_tensors(obj: Any) -> Any:
    """``obj`` (a state dict, or any nest of dicts, lists and tuples) with each DTensor over one rank replaced
    by its local tensor, which at world size 1 is the whole tensor. For a checkpoint that a framework loads
    with a callable ``map_location`` (Lightning does), which ``torch.load`` cannot apply to a DTensor: the
    optimizer's state dict holds DTensors under FSDP2, as torch's AdamW's does, and loads plain ones back.
    A DTensor over more ranks is refused: its local tensor is only a shard (save it with
    torch.distributed.checkpoint instead)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        if obj.device_mesh.size() != 1:
            raise ValueError(f"plain_tensors: a DTensor over {obj.device_mesh.size()} ranks is a shard, not the "
                             "whole tensor: save it with torch.distributed.checkpoint")  # fmt: skip
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: plain_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain_tensors(v) for v in obj)
    return obj
