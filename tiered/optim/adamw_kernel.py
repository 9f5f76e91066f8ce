"""The AdamW math: torch's own fused kernel, called on lists of flat fp32 views.

We own where tensors live; the update stays torch's. ``torch._fused_adamw_`` is what
``torch.optim.AdamW(fused=True)`` calls on CPU and CUDA (torch >= 2.4); it updates params, exp_avg and
exp_avg_sq in place and reads per-tensor step counts, which we hold ourselves so that a parameter split
over several chunks keeps one step count.
"""

from __future__ import annotations

import torch


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
