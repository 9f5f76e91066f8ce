"""TieredOptimizer as a drop-in for torch.optim.AdamW where users leave the beaten path: gradients that are
views, parameters given by name, on the meta device, frozen or thawed, and state dicts loaded around them.
Each is the regression test of a defect found where the drop-in once differed from torch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tiered import TieredOptimizer

KW = dict(lr=1e-2, host_budget="60KiB", chunk_bytes="12KiB", prefetch_depth=2)


def mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).to(dtype)


def backward(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 8, generator=g).to(next(model.parameters()).dtype)
    model(x).float().pow(2).mean().backward()


@pytest.mark.parametrize(
    "grad_of_step",
    [
        lambda s: torch.randn(128, generator=torch.Generator().manual_seed(s))[::2],  # a view into a flat buffer
        lambda s: torch.randn(1, generator=torch.Generator().manual_seed(s)).expand(64),  # a broadcast gradient
    ],
    ids=["strided", "expanded"],
)
def test_a_strided_or_expanded_grad_updates_as_its_values_say(tmp_path, grad_of_step):
    """torch's fused CPU kernel reads a gradient's memory as if it were dense: the update must read the values."""
    ours, ref = (nn.Parameter(torch.linspace(-1, 1, 64)) for _ in range(2))
    torch_opt = torch.optim.AdamW([ref], lr=1e-2, fused=True)
    with TieredOptimizer([ours], tmp_path, **KW) as opt:
        for s in range(3):
            ours.grad = grad_of_step(s)
            assert not ours.grad.is_contiguous()
            ref.grad = grad_of_step(s).contiguous()
            opt.step()
            torch_opt.step()
            assert torch.equal(ours, ref), s


def test_a_meta_parameter_is_refused_by_name_with_the_fix(tmp_path):
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"parameter 'weight' is on the meta device.*to_empty"):
        TieredOptimizer(model, tmp_path)
    assert not any(tmp_path.iterdir())  # its folder is gone again
