"""The AdamW math: torch's own fused kernel, called on lists of flat fp32 views.

We own where tensors live; the update stays torch's. ``torch._fused_adamw_`` is what
``torch.optim.AdamW(fused=True)`` calls on CPU and CUDA (torch >= 2.4); it updates params, exp_avg and
exp_avg_sq in place and reads per-tensor step counts, which we hold ourselves so that a parameter split
over several chunks keeps one step count.

``hyperparameters(group, where)`` is the one way a param group's lr, betas, eps and weight decay are read: by the
update (update.py) for each chunk, and by ``step()`` for every group before the step starts (step.py), so that a
value the update could not read is refused while nothing has changed yet.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["adamw_update", "hyperparameters"]


def adamw_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool = False,
) -> None:
    """One AdamW update of each (param, grad, m, v) in place. ``steps`` already count this step."""
    if not params:
        return
    torch._fused_adamw_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        lr=float(lr),
        beta1=float(beta1),
        beta2=float(beta2),
        weight_decay=float(weight_decay),
        eps=float(eps),
        amsgrad=False,
        maximize=maximize,
    )


def hyperparameters(group: dict[str, Any], where: str) -> tuple[float, float, float, float, float]:
    """``(lr, beta1, beta2, eps, weight_decay)`` of a param group (``where``: its name in errors) as the kernel takes
    them: each a number, a one-element tensor read as its value (as torch's fused AdamW reads a CPU lr), betas a
    pair of them. One missing, or one the kernel could not take, raises what torch's AdamW raises (``KeyError``,
    ``TypeError``, ``ValueError``), naming the group and the key. No range is checked: whatever torch's AdamW steps
    with (a negative lr) steps here too; the constructor's and ``add_param_group``'s checks are torch's own."""
    for key in ("lr", "betas", "eps", "weight_decay"):
        if key not in group:
            raise KeyError(f"{where}: {key!r} is missing; give the group one (opt.defaults[{key!r}] is the default): "
                           "a group assigned to opt.param_groups needs every hyperparameter")  # fmt: skip
    lr, eps, weight_decay = (_number(group[key], where, key) for key in ("lr", "eps", "weight_decay"))
    betas = group["betas"]
    try:
        if isinstance(betas, (str, bytes)):
            raise TypeError
        beta1, beta2 = betas  # as torch's AdamW: a tuple, a list or a tensor of two
    except (TypeError, ValueError) as e:  # no pair (0.9, a 0-d tensor) or another length
        raise type(e)(f"{where}: 'betas' must be two numbers, got {_show(betas)}") from None
    return lr, _number(beta1, where, "betas", betas), _number(beta2, where, "betas", betas), eps, weight_decay


def _number(value: Any, where: str, key: str, shown: Any = None) -> float:
    """``value`` as the float the kernel takes, else the error torch would raise: a string is none (torch's kernel
    takes none, though ``float`` would), a tensor of more elements than one is not one either. ``shown``: what the
    error shows, where that is not ``value`` (a beta of betas)."""
    error: type[Exception] = TypeError
    if not isinstance(value, (str, bytes)):
        try:
            return float(value)
        except TypeError:
            pass
        except (ValueError, RuntimeError):  # a tensor of several elements
            error = ValueError
    what = "two numbers" if key == "betas" else "a number"
    raise error(f"{where}: {key!r} must be {what}, got {_show(value if shown is None else shown)}")


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value)
