"""A module of an offloaded model's root unit called while its weights are sharded is refused by name.

FSDP2 gathers the root unit's weights (the embeddings, the final norm, the head: what no block holds) in the
root module's pre-forward hook, and keeps them gathered through backward. Called alone, outside that window, such a
module (``model.get_input_embeddings()(ids)`` to build ``inputs_embeds``; the backbone ``model.model(...)`` for a
reward or embedding head; an encoder-decoder's encoder in ``generate``) met its sharded weights and failed inside
torch with "got mixed torch.Tensor and DTensor". Gathering them from its own hook is not enough: FSDP2's backward
of the root unit runs once its forward's inputs have their gradients, before those of a module run ahead of it, and
the gradients come out wrong. So such a call raises, naming the module and what to call instead.

The test is the weights' state at the call, not where the call comes from: inside the model's forward, and in a
recompute of activation checkpointing during backward (after the forward has returned), they are gathered and the
call goes on, as without offload."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["refuse_root_calls_outside"]


def refuse_root_calls_outside(model: nn.Module, units: list[nn.Module]) -> None:
    """Hook every module of ``model`` outside its ``units`` (the blocks) that holds a weight of the root unit, so
    that a call of it while those weights are sharded (outside the model's forward and backward) raises
    ``RuntimeError``."""
    in_units = {id(m) for unit in units for m in unit.modules()}
    for name, module in model.named_modules():
        if module is model or id(module) in in_units:
            continue
        # (holder, attribute) of each root weight under it: FSDP2 swaps the registered tensor (sharded DTensor,
        # gathered plain tensor), so it is looked up at each call
        holders = [
            (sub, pname)
            for sub in module.modules()
            if id(sub) not in in_units
            for pname, _ in sub.named_parameters(recurse=False)
        ]
        if holders:
            module.register_forward_pre_hook(_refusal(name, type(module).__name__, holders))


def _refusal(name: str, cls: str, holders: list[tuple[nn.Module, str]]) -> Any:
    def check(*_: Any) -> None:
        if any(isinstance(getattr(sub, pname), DTensor) for sub, pname in holders):
            raise RuntimeError(
                f"{name} ({cls}) was called outside the offloaded model's forward: it holds weights of the model's "
                "root unit (embeddings, final norm, head), which FSDP2 gathers only in the model's own forward. "
                "Call the model itself (for the backbone's last hidden state, model(..., output_hidden_states=True)"
                ".hidden_states[-1]; for generate() of an encoder-decoder model, pass encoder_outputs= built from "
                "the model's own call, out.encoder_last_hidden_state), or make this call inside the forward of a "
                "module of your own that holds the model, and offload that module in its place"
            )

    return check
