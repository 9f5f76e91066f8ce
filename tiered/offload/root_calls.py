"""A module of an offloaded model's root unit called outside the model's own forward is refused by name.

FSDP2 gathers the root unit's weights (the embeddings, the final norm, the head: what no block holds) in the
root module's pre-forward hook only. Called alone, such a module (``model.get_input_embeddings()(ids)`` to build
``inputs_embeds``; the backbone ``model.model(...)`` for a reward or embedding head) met its sharded weights and
failed inside torch with "got mixed torch.Tensor and DTensor". Gathering them from its own hook is not enough:
FSDP2's backward of the root unit runs once its forward's inputs have their gradients, before those of a module
run ahead of it, and the gradients come out wrong. So such a call raises, naming the module and what to call
instead: the model itself, or a module of the user's own that makes the call inside its forward and is offloaded
in the model's place (then the call is inside the root's forward)."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["refuse_root_calls_outside"]


def refuse_root_calls_outside(model: nn.Module, units: list[nn.Module]) -> None:
    """Hook every module of ``model`` outside its ``units`` (the blocks) that holds a weight of the root unit, so
    that a call of it outside the model's forward raises ``RuntimeError``."""
    depth = [0]  # the model's forwards under way (a forward may call the model again)

    def enter(*_: Any) -> None:
        depth[0] += 1

    def leave(*_: Any) -> None:
        depth[0] -= 1

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)  # a forward that raised has left too
    in_units = {id(m) for unit in units for m in unit.modules()}
    root_params = {id(p) for p in model.parameters()} - {id(p) for unit in units for p in unit.parameters()}
    for name, module in model.named_modules():
        if module is model or id(module) in in_units:
            continue
        if any(id(p) in root_params for p in module.parameters()):
            module.register_forward_pre_hook(_refusal(name, type(module).__name__, depth))


def _refusal(name: str, cls: str, depth: list[int]) -> Any:
    def check(*_: Any) -> None:
        if depth[0] <= 0:
            raise RuntimeError(
                f"{name} ({cls}) was called outside the offloaded model's forward: it holds weights of the model's "
                "root unit (embeddings, final norm, head), which FSDP2 gathers only in the model's own forward. "
                "Call the model itself (for the backbone's last hidden state, model(..., output_hidden_states=True)"
                ".hidden_states[-1]), or make this call inside the forward of a module of your own that holds the "
                "model, and offload that module in its place"
            )

    return check
